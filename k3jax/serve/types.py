"""What the serving engine takes and gives: sampling parameters, per-token outputs, statistics.

The HTTP layer (:mod:`k3jax.serve.api`) turns OpenAI requests into ``(prompt ids,
SamplingParams)``, submits them to :class:`k3jax.serve.engine.Engine` and streams back the
:class:`TokenOutput` events the engine hands to the request's callback (from the engine's thread).
"""

from __future__ import annotations

import dataclasses

TOP_LOGPROBS = 5  # alternatives the engine returns per token (OpenAI's maximum for completions)


class RequestError(ValueError):
  """A request the engine cannot run (too long for the context or the cache, bad ids or
  parameters): the HTTP layer answers 400 with this message."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request decodes. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 cut
  nothing; ``seed`` fixes the request's random stream (token ``i`` uses ``fold_in(key(seed), i)``,
  so results do not depend on what else is batched); ``stop_token_ids`` end the request (the
  model's eos unless ``ignore_eos``); ``logprobs``: how many top alternatives to report per token
  (0 to :data:`TOP_LOGPROBS`; the chosen token's logprob is always reported)."""
  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  logprobs: int = 0


@dataclasses.dataclass(frozen=True)
class TokenOutput:
  """One generated token of a request (or, with ``token`` None, the request's end without one).

  ``finish_reason``: None while the request runs; ``"stop"`` (a stop token, which is ``token``
  itself), ``"length"`` (``max_tokens`` reached), ``"abort"`` (cancelled) or ``"error"``
  (``error`` says why) on its last event. ``top_logprobs``: ``(token id, logprob)`` pairs,
  likeliest first, ``SamplingParams.logprobs`` of them."""
  request_id: int
  token: int | None
  logprob: float | None = None
  top_logprobs: tuple[tuple[int, float], ...] = ()
  finish_reason: str | None = None
  error: str | None = None
  prompt_tokens: int = 0
  cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclasses.dataclass
class EngineStats:
  """Counters and gauges the engine keeps up to date (read by ``/metrics`` at scrape time)."""
  running: int = 0
  waiting: int = 0
  pages_used: int = 0
  pages_total: int = 0
  slots_used: int = 0
  slots_total: int = 0
  prefix_hit_tokens: int = 0  # MLA tokens served from cached pages
  kda_checkpoint_hits: int = 0  # KDA state checkpoints restored into a request's slot
  preemptions: int = 0
  prompt_tokens: int = 0
  generation_tokens: int = 0
  steps: int = 0
