"""A stand-in for :class:`k3jax.serve.engine.Engine`: the same interface, tokens from a thread.

Request ``r`` generates the UTF-8 bytes of :data:`TEXT` over and over (multi-byte characters
split over byte tokens), starting at an offset set by its prompt (and its seed when sampling),
one token per step of ``step_s`` seconds; it reports made-up logprobs and, as cached, the longest
block-aligned prefix it shares with an earlier prompt. ``cancelled`` records cancel calls.
"""

from __future__ import annotations

import threading
import time

from k3jax.config import ModelConfig, ServeConfig
from k3jax.serve.types import EngineStats, RequestError, SamplingParams, TokenOutput

TEXT = "héllo wörld ☃ 𝄞 — Grüße, ça va? "
BYTES = TEXT.encode()


STARTS = [len(TEXT[:i].encode()) for i in range(len(TEXT))]  # where characters start


def tokens(prompt: list[int], params: SamplingParams, count: int) -> list[int]:
  """The first ``count`` tokens the fake generates for ``prompt`` (from a character's start)."""
  seed = 0 if params.temperature == 0 or params.seed is None else params.seed
  start = STARTS[(sum(prompt) + seed) % len(STARTS)]
  return [BYTES[(start + i) % len(BYTES)] for i in range(count)]


def logprob(i: int) -> float:
  return -0.125 - 0.25 * (i % 5)


class FakeEngine:

  def __init__(self, cfg: ModelConfig, serve: ServeConfig, *, step_s: float = 0.002):
    self.cfg, self.serve, self.step_s = cfg, serve, step_s
    self.stats = EngineStats()
    self.max_model_len = serve.max_model_len
    self.submitted: dict[int, tuple[list[int], SamplingParams]] = {}
    self.cancelled: set[int] = set()
    self._active: dict[int, dict] = {}
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()

  def validate(self, prompt: list[int], params: SamplingParams) -> None:
    if not prompt or any(not 0 <= t < self.cfg.vocab_size for t in prompt):
      raise RequestError(f"prompt ids must be given and lie in [0, {self.cfg.vocab_size})")
    need = len(prompt) + params.max_tokens
    if need > self.max_model_len:
      raise RequestError(f"the prompt ({len(prompt)} tokens) plus max_tokens "
                         f"({params.max_tokens}) exceeds serve.max_model_len={self.max_model_len}")
    if self.serve.num_pages and need > self.serve.num_pages * self.serve.page_size:
      raise RequestError(f"the request needs {need} tokens of cache, more than the whole cache "
                         f"({self.serve.num_pages} pages of {self.serve.page_size})")

  def submit(self, prompt, params, callback) -> int:
    self.validate(prompt, params)
    block = self.serve.block_size
    with self._lock:
      shared = max((_common(prompt, p) for p, _ in self.submitted.values()), default=0)
      rid = len(self.submitted)
      self.submitted[rid] = (list(prompt), params)
      self._active[rid] = {"tokens": tokens(prompt, params, params.max_tokens), "i": 0,
                           "callback": callback, "prompt": len(prompt),
                           "cached": min(shared, len(prompt) - 1) // block * block,
                           "logprobs": params.logprobs, "cancel": False}
    return rid

  def cancel(self, request_id: int) -> None:
    with self._lock:
      self.cancelled.add(request_id)
      if request_id in self._active:
        self._active[request_id]["cancel"] = True

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def shutdown(self) -> None:
    self._stop.set()
    self._thread.join()

  def _run(self) -> None:
    while not self._stop.is_set():
      with self._lock:
        active = list(self._active.items())
        self.stats.running = len(active)
        self.stats.steps += bool(active)
      for rid, r in active:
        if r["cancel"]:
          out = TokenOutput(rid, None, finish_reason="abort")
        else:
          i, tok = r["i"], r["tokens"][r["i"]]
          r["i"] += 1
          top = ((tok, logprob(i)),) + tuple(((tok + j) % 256, logprob(i) - j)
                                             for j in range(1, r["logprobs"]))
          out = TokenOutput(rid, tok, logprob(i), top[:r["logprobs"]],
                            finish_reason="length" if r["i"] == len(r["tokens"]) else None,
                            prompt_tokens=r["prompt"], cached_tokens=r["cached"])
          self.stats.generation_tokens += 1
        if out.finish_reason is not None:
          with self._lock:
            del self._active[rid]
            self.stats.prefix_hit_tokens += r["cached"]
        r["callback"](out)
      time.sleep(self.step_s)


def _common(a: list[int], b: list[int]) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n
