"""Rollouts on the serving engine, in-process, with partial rollout.

:class:`Rollouts` keeps ``posttrain.prompts_per_step`` groups in flight (``group_size`` samples
of one problem each). :meth:`Rollouts.collect` resumes the requests it paused last time first,
submits new groups to fill up, and steps the engine until ``posttrain.partial_fraction`` of the
groups in flight have finished; the unfinished requests are paused with their cache (MLA pages
and KDA slot stay on the device, :meth:`k3jax.serve.engine.Engine.pause`) and continue in the
next call, under the weights pushed to the engine in between. Every token keeps the log-prob the
engine gave it when it was sampled and the policy version that sampled it, so a trajectory that
spans updates carries its stale tokens' behaviour log-probs into the loss.

:func:`to_batches` packs trajectories into ``[B, T]`` training batches for
:mod:`k3jax.posttrain.objective`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterator

import numpy as np

from k3jax.config import PostTrainConfig
from k3jax.posttrain import sft
from k3jax.posttrain.tasks import Problem
from k3jax.serve.engine import Engine
from k3jax.serve.types import SamplingParams, TokenOutput
from k3jax.tokenizer import Tokenizer


@dataclasses.dataclass
class Trajectory:
  problem: Problem
  prompt: list[int]
  tokens: list[int] = dataclasses.field(default_factory=list)
  logps: list[float] = dataclasses.field(default_factory=list)  # behaviour log-prob per token
  versions: list[int] = dataclasses.field(default_factory=list)  # policy version per token
  finish: str | None = None
  request_id: int = 0


class Rollouts:
  """Groups of trajectories sampled by ``engine`` (see the module docstring)."""

  def __init__(self, engine: Engine, tokenizer: Tokenizer, post: PostTrainConfig,
               problems: Iterator[Problem], *, bos: int, eos: int):
    self.engine, self.tokenizer, self.post = engine, tokenizer, post
    self.problems, self.bos, self.eos = problems, bos, eos
    self.version = 0  # bumped by the loop after each weight push
    self.groups: list[list[Trajectory]] = []  # in flight, oldest first
    self._by_id: dict[int, Trajectory] = {}
    self._paused: list[int] = []
    self._seeds = 0

  def _on_token(self, o: TokenOutput) -> None:
    t = self._by_id[o.request_id]
    if o.token is not None:
      t.tokens.append(o.token)
      t.logps.append(o.logprob)
      t.versions.append(self.version)
    if o.finish_reason is not None:
      t.finish = o.finish_reason
      if o.error:
        raise RuntimeError(f"rollout request failed: {o.error}")

  def _submit_group(self, problem: Problem) -> None:
    prompt = sft.prompt_ids(self.tokenizer, [{"role": "user", "content": problem.prompt}], self.bos)
    group = []
    for _ in range(self.post.group_size):
      seed = (self.post.seed * 1_000_003 + self._seeds) % 2**32
      self._seeds += 1
      t = Trajectory(problem, prompt)
      params = SamplingParams(max_tokens=problem.budget, temperature=self.post.temperature,
                              seed=seed, stop_token_ids=(self.eos,))
      t.request_id = self.engine.submit(prompt, params, self._on_token)
      self._by_id[t.request_id] = t
      group.append(t)
    self.groups.append(group)

  def collect(self) -> tuple[list[list[Trajectory]], dict]:
    """(the finished groups, stats: ``rollout_tokens``, ``rollout_s``, ``resumed``)."""
    t0 = time.perf_counter()
    resumed = len(self._paused)
    for rid in self._paused:  # paused trajectories go first
      self.engine.resume(rid)
    self._paused = []
    while len(self.groups) < self.post.prompts_per_step:
      self._submit_group(next(self.problems))
    before = sum(len(t.tokens) for g in self.groups for t in g)
    need = math.ceil(self.post.partial_fraction * len(self.groups))
    done = lambda g: all(t.finish is not None for t in g)
    while sum(map(done, self.groups)) < need and self.engine.has_work():
      self.engine.step()
    self.engine.flush()  # the tokens still in flight, before the groups are split
    finished = [g for g in self.groups if done(g)]
    self.groups = [g for g in self.groups if not done(g)]
    for g in self.groups:
      for t in g:
        if t.finish is None:
          self.engine.pause(t.request_id)
          self._paused.append(t.request_id)
    after = sum(len(t.tokens) for g in finished + self.groups for t in g)
    for g in finished:
      for t in g:
        del self._by_id[t.request_id]
    return finished, {"rollout_tokens": after - before, "rollout_s": time.perf_counter() - t0,
                      "resumed": resumed}


def to_batches(trajs: list[Trajectory], version: int, *, rows: int, seq_len: int, pad: int,
               per_token: dict[str, list[np.ndarray]]) -> list[dict[str, np.ndarray]]:
  """Packs each trajectory (prompt + completion) as one segment of a ``[rows, seq_len]`` batch,
  in order, row after row (as many batches as needed): inputs ``x[:-1]``, targets ``x[1:]``,
  ``weights`` 1 on completion targets, ``behaviour_logp``, ``stale`` where the token's policy
  version is older than ``version``, and each ``per_token`` field (one ``[n]`` array per
  trajectory, one value per completion token, e.g. ``advantages``) on its completion targets."""
  floats = ("weights", "behaviour_logp", "stale", *per_token)
  keys = ("input_ids", "targets", "segment_ids", "positions", *floats)
  batches: list[dict[str, np.ndarray]] = []
  row, s = rows, 0  # the row being filled and its next free position (rows: no batch yet)
  for i, t in enumerate(trajs):
    x = t.prompt + t.tokens
    n = len(x) - 1
    if n > seq_len:
      raise ValueError(f"a trajectory of {n + 1} tokens does not fit data.seq_len={seq_len}")
    if s + n > seq_len:  # next row (segments stay in trajectory order, row by row)
      row, s = row + 1, 0
    if row == rows:
      batches.append({k: np.zeros((rows, seq_len), np.float32 if k in floats else np.int32)
                      for k in keys})
      batches[-1]["input_ids"][:] = pad
      batches[-1]["targets"][:] = pad
      row, s = 0, 0
    b = batches[-1]
    seg = int(b["segment_ids"][row].max()) + 1
    sl = slice(s, s + n)
    b["input_ids"][row, sl], b["targets"][row, sl] = x[:-1], x[1:]
    b["segment_ids"][row, sl], b["positions"][row, sl] = seg, np.arange(n)
    c = slice(s + len(t.prompt) - 1, s + n)  # the completion's targets
    b["weights"][row, c] = 1.0
    b["behaviour_logp"][row, c] = t.logps
    b["stale"][row, c] = np.asarray(t.versions) < version
    for k, values in per_token.items():
      b[k][row, c] = values[i]
    s += n
  return batches
