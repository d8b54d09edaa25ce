"""The RL (``train.mode=rl``) and OPD (``train.mode=opd``) loops behind ``train.py``.

One iteration (one ``train.steps`` step): :meth:`Rollouts.collect` samples on the engine with the
current weights (partial rollout: it returns the groups finished so far) -> rewards or teacher
scores -> advantages -> packed batches -> the training step of :mod:`k3jax.train_step` with the
loss of :mod:`k3jax.posttrain.objective` (one optimizer update per batch) -> the new weights
pushed to the engine (:meth:`Engine.update_weights`, no restart, no recompile).

RL: rewards from the task checker (:func:`k3jax.posttrain.tasks.reward`, -1 over the problem's
token budget), normalised within each group (GRPO), the same advantage on every token of a
trajectory. OPD: the student samples; the teacher routed by the problem's task
(``posttrain.teacher_tasks``) scores every position the student sampled, and the loss adds the
exact reverse KL to that teacher's distribution there (:mod:`k3jax.posttrain.objective`).

Metrics per iteration in ``metrics.jsonl``: ``loss``, ``grad_norm``, ``lr``, ``reward``,
``length`` (completion tokens), ``over_budget``, ``kl`` (to the behaviour policy), ``ratio``,
``clipped``, ``stale_fraction``, ``rollout_tokens_per_s``, ``train_step_s``, OPD's
``teacher_kl`` (reverse KL to the routed teachers at the sampled positions) and ``eval_kl`` (exact reverse KL of the
first reply token on ``posttrain.eval_prompts`` fixed problems, at the start and every
``train.eval_every`` steps). Checkpoints hold the weights (a run directory that
``train.init_from`` and ``posttrain.teachers`` read); a run does not resume its rollouts.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np

import sharding
from k3jax import checkpoint as checkpoint_lib
from k3jax import metrics as metrics_lib
from k3jax import train as train_lib
from k3jax import train_step as step_lib
from k3jax.config import Config, ConfigError
from k3jax.posttrain import objective, sft, tasks
from k3jax.posttrain.rollout import Rollouts, Trajectory, to_batches
from k3jax.serve.engine import Engine
from k3jax.tokenizer import make_tokenizer
from k3jax.train_state import init_train_state


def group_advantages(rewards: np.ndarray) -> np.ndarray:
  """``[G, n]`` rewards -> ``(r - group mean) / (group std + 1e-6)``."""
  return (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)


def load_weights(cfg: Config, state, directory: str):
  """(params, biases) of ``directory`` laid out as ``state``'s (:func:`train.init_weights`)."""
  s = train_lib.init_weights(dataclasses.replace(
      cfg, train=dataclasses.replace(cfg.train, init_from=directory)), state)
  return s.params, s.biases


def _teacher_of(cfg: Config, task: str) -> int:
  routes = cfg.posttrain.teacher_tasks
  return routes.index(task) if task in routes else 0


def _problem_stream(post):
  """Endless problems of ``posttrain.tasks``, a fresh draw per thousand."""
  for i in itertools.count():
    yield from tasks.problems(post.tasks, 1000, budget=post.token_budget, seed=post.seed + 7 * i + 2)


def _score(batch: dict, teachers, full_logp) -> None:
  """Puts into ``batch`` the log-probs ``[B, T, V]`` of the teacher each position's trajectory
  routes to (``route``: teacher index per completion token)."""
  route = batch.pop("route").astype(np.int32)
  scores = np.stack([np.asarray(full_logp(*t, batch)) for t in teachers])
  batch["teacher_logp"] = np.take_along_axis(scores, route[None, ..., None], 0)[0]


def reply_kl(graphdef, student, teacher, batch) -> jax.Array:
  """Mean over weighted positions of KL(student || teacher) over the whole vocabulary;
  ``student``/``teacher``: (params, biases)."""
  ls = objective.log_probs(graphdef, *student, batch)[0]
  lt = objective.log_probs(graphdef, *teacher, batch)[0]
  kl = jnp.sum(jnp.exp(ls) * (ls - lt), -1)
  return jnp.sum(kl * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)


def run(cfg: Config, run_dir: Path, *, progress: bool = True, teachers=None) -> list[dict]:
  """Runs ``cfg.train.steps`` RL or OPD iterations into ``run_dir``; returns the metrics records.
  ``teachers``: (params, biases) per teacher instead of reading ``posttrain.teachers``."""
  with sharding.layout(cfg.mesh):
    return _run(cfg, Path(run_dir), progress, teachers)


def _run(cfg: Config, run_dir: Path, progress: bool, teachers) -> list[dict]:
  post, m = cfg.posttrain, cfg.model
  opd = cfg.train.mode == "opd"
  train_lib.check_run_dir(run_dir, cfg)
  mesh = sharding.make_mesh(cfg.mesh)
  state = init_train_state(cfg, mesh)
  if cfg.train.init_from:
    state = state.replace(**dict(zip(("params", "biases"),
                                     load_weights(cfg, state, cfg.train.init_from))))
  if opd and teachers is None:
    teachers = [load_weights(cfg, state, d) for d in post.teachers]
  tokenizer = make_tokenizer(cfg.data.tokenizer)
  engine = Engine(state.model(), cfg.serve)
  problems = _problem_stream(post)
  rollouts = Rollouts(engine, tokenizer, post, problems, bos=m.bos_token_id, eos=m.eos_token_id)
  step_fn = step_lib.jit_train_step(step_lib.make_train_step(
      cfg, state.graphdef, state.tx, state.schedule, loss=objective.policy_loss(post)),
      donate=False)
  full_logp = jax.jit(lambda p, b, batch: objective.log_probs(state.graphdef, p, b, batch)[0])
  kl_fn = jax.jit(lambda s, t, batch: reply_kl(state.graphdef, s, t, batch))
  rows, seq_len = cfg.train.batch_size, cfg.data.seq_len
  to_b = lambda trajs, v, **per_token: to_batches(trajs, v, rows=rows, seq_len=seq_len,
                                                  pad=m.pad_token_id, per_token=per_token)
  eval_set = [Trajectory(p, sft.prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}],
                                           m.bos_token_id), [m.eos_token_id], [0.0], [0])
              for p in tasks.problems(post.tasks, post.eval_prompts, budget=post.token_budget,
                                      seed=post.seed + 1)]

  longest = max(len(t.prompt) for t in eval_set) + post.token_budget
  room = min(seq_len, engine.max_model_len)
  if longest > room:
    raise ConfigError(f"posttrain.token_budget={post.token_budget}: a prompt of the tasks plus its "
                      f"budget takes {longest} tokens, more than data.seq_len / "
                      f"serve.max_model_len allow ({room})")

  def eval_kl() -> float:  # one problem per batch: each goes to its own teacher
    out = []
    for t in eval_set:
      b = to_b([t], 0)[0]
      out.append(float(kl_fn((state.params, state.biases),
                             teachers[_teacher_of(cfg, t.problem.task)], b)))
    return float(np.mean(out))

  ckpt = None
  if cfg.checkpoint.enabled:
    ckpt = checkpoint_lib.Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                       async_save=cfg.checkpoint.async_save)
  marker = iter(grain.MapDataset.source([0]).repeat(None).to_iter_dataset())  # no data position
  train_lib.record_config(run_dir, cfg)
  metrics = metrics_lib.Metrics(run_dir, total_steps=cfg.train.steps, start_step=0,
                                progress=progress)
  records: list[dict] = []
  if opd:
    rec = {"step": 0, "eval_kl": eval_kl()}
    metrics.write(rec)
    records.append(rec)
  metrics.say(f"{cfg.train.mode}: {cfg.train.steps} iterations of {post.prompts_per_step} x "
              f"{post.group_size} samples, tasks {list(post.tasks)}, run dir {run_dir}")
  try:
    for step in range(1, cfg.train.steps + 1):
      groups, stats = rollouts.collect()
      trajs = [t for g in groups for t in g]
      rewards = np.asarray([[tasks.reward(t.problem, tokenizer.decode(
          [x for x in t.tokens if x != m.eos_token_id]), t.finish == "stop", len(t.tokens))
          for t in g] for g in groups], np.float32).reshape(len(groups), -1)
      rec: dict = {"step": step, "reward": float(rewards.mean()) if trajs else None,
                   "length": float(np.mean([len(t.tokens) for t in trajs])) if trajs else None,
                   "over_budget": float(np.mean(rewards == -1)) if trajs else None,
                   "groups": len(groups), "resumed": stats["resumed"],
                   "rollout_tokens_per_s": stats["rollout_tokens"] / max(stats["rollout_s"], 1e-9)}
      if opd:  # advantages 0: the loss is the routed teachers' reverse KL (objective)
        zeros = [np.zeros(len(t.tokens), np.float32) for t in trajs]
        routes = [np.full(len(t.tokens), _teacher_of(cfg, t.problem.task)) for t in trajs]
        batches = to_b(trajs, rollouts.version, advantages=zeros, route=routes) if trajs else []
        for b in batches:
          _score(b, teachers, full_logp)
      else:
        per = group_advantages(rewards).reshape(-1) if trajs else []
        adv = [np.full(len(t.tokens), a, np.float32) for t, a in zip(trajs, per)]
        batches = to_b(trajs, rollouts.version, advantages=adv) if trajs else []
      sampled = sum(float(b["weights"].sum()) for b in batches)
      rec["stale_fraction"] = (sum(float((b["stale"] * b["weights"]).sum()) for b in batches)
                               / sampled) if sampled else 0.0
      t0 = time.perf_counter()
      outs = []
      for b in batches:
        with jax.set_mesh(mesh):
          state, out = step_lib.apply_step(step_fn, state, step - 1, b)
        outs.append(jax.device_get(out))
      rec["train_step_s"] = (time.perf_counter() - t0) / max(len(batches), 1)
      for k in ("loss", "grad_norm", "lr", "ratio", "kl", "clipped") + (("teacher_kl",) if opd
                                                                         else ()):
        rec[k] = float(np.mean([o[k] for o in outs])) if outs else None
      if outs:
        engine.update_weights(*state.arrays("params", "biases").values())
        rollouts.version += 1
      if opd and cfg.train.eval_every and (step % cfg.train.eval_every == 0
                                           or step == cfg.train.steps):
        rec["eval_kl"] = eval_kl()
      metrics.write(rec)
      records.append(rec)
      metrics.say(f"step {step:4d}  reward {rec['reward']}  length {rec['length']}  kl "
                  f"{rec['kl']}  stale {rec['stale_fraction']:.2f}  "
                  f"{rec['rollout_tokens_per_s']:.0f} rollout tok/s"
                  + (f"  eval_kl {rec['eval_kl']:.4f}" if "eval_kl" in rec else ""))
      metrics.progress(step, reward=rec["reward"])
      if ckpt is not None and (step % cfg.checkpoint.every == 0 or step == cfg.train.steps):
        ckpt.save(step, state.arrays(), marker, {"step": step, "mode": cfg.train.mode},
                  wait=step == cfg.train.steps)
  finally:
    if ckpt is not None:
      ckpt.close()
    metrics.close()
  return records
