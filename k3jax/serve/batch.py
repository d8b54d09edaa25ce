"""The serving engine's host side of a step: requests, the step shapes' buckets, and the per-row
inputs of a compiled step (:func:`k3jax.serve.step.step`) built from requests as whole columns."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from k3jax.serve.cache import Block
from k3jax.serve.types import SamplingParams, TokenOutput


def buckets(limit: int, smallest: int = 1) -> tuple[int, ...]:
  """Powers of two from ``smallest`` below ``limit``, then ``limit``."""
  out = []
  n = smallest
  while n < limit:
    out.append(n)
    n *= 2
  return tuple(out) + (limit,)


def fit(sizes: tuple[int, ...], n: int) -> int:
  """The smallest of ``sizes`` (ascending) that holds ``n``."""
  return next(s for s in sizes if s >= n)


@dataclasses.dataclass(eq=False)
class Request:
  """One request's state in the engine (host side)."""
  id: int
  prompt: tuple[int, ...]
  params: SamplingParams
  callback: Callable[[TokenOutput], None]
  seed: int
  stop_ids: frozenset[int]
  tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
  computed: int = 0  # leading tokens whose cache entries are written
  slot: int | None = None
  pages: list[int] = dataclasses.field(default_factory=list)  # page of each page-size span
  blocks: list[Block] = dataclasses.field(default_factory=list)  # its prefix-index blocks, in order
  cached: int = 0  # prompt tokens of the first admission served from the prefix cache
  # images: their vision items (in placeholder order); keys: what the prefix index hashes per
  # token (an image's placeholders by the image's digest); before[p]: placeholders before p;
  # visual: the items' visual tokens [M, d] on device while prompt placeholders remain to prefill
  images: tuple = ()
  keys: list = dataclasses.field(default_factory=list)
  before: np.ndarray | None = None
  visual: jax.Array | None = None
  # dispatched steps that sample a token of this request whose output the host has not read;
  # feed: the index of the newest one's token in the previous steps' outputs (the engine's feed);
  # epoch: bumped whenever outputs in flight must be dropped (finished, preempted)
  inflight: int = 0
  feed: int = -1
  epoch: int = 0

  @property
  def generated(self) -> int:
    return len(self.tokens) - len(self.prompt)

  @property
  def pending(self) -> int:
    return len(self.tokens) - self.computed


def host_inputs(rows: list[tuple[Request, int, int]], n: int, t: int, table_width: int, *,
                decode: bool):
  """The step inputs of ``rows`` (request, start, tokens) padded to ``n`` rows of ``t`` tokens:
  (tokens ``[n, t]``, starts, nvalid, page table ``[n, table_width]``, slots, temperature,
  top_p, top_k, seeds, counters, src), numpy; ``src[b]`` the index of a decode row's input token
  in the previous steps' outputs where the host has not read it (else -1)."""
  pad = n - len(rows)
  reqs = [r for r, _, _ in rows]
  col = lambda values, fill, dtype: np.array(list(values) + [fill] * pad, dtype)
  starts = col((s for _, s, _ in rows), 0, np.int32)
  nvalid = col((c for _, _, c in rows), 1, np.int32)
  slots = col((r.slot for r in reqs), 0, np.int32)
  temp = col((r.params.temperature for r in reqs), 0.0, np.float32)
  top_p = col((r.params.top_p for r in reqs), 1.0, np.float32)
  top_k = col((r.params.top_k for r in reqs), 0, np.int32)
  seeds = col((r.seed for r in reqs), 0, np.uint32)
  counters = col((len(r.tokens) + r.inflight - len(r.prompt) for r in reqs), 0, np.int32)
  # a decode row whose token the host has not read takes it from the previous steps' outputs
  src = col((-1 if s < len(r.tokens) else r.feed for r, s, _ in rows), -1, np.int32)
  table = np.zeros((n, table_width), np.int32)
  for i, r in enumerate(reqs):
    table[i, :len(r.pages)] = r.pages
  if decode:
    tokens = col((r.tokens[s] if s < len(r.tokens) else 0 for r, s, _ in rows), 0, np.int32)
    tokens = tokens[:, None]
  else:
    tokens = np.zeros((n, t), np.int32)
    for i, (r, s, c) in enumerate(rows):
      tokens[i, :c] = r.tokens[s:s + c]
  return tokens, starts, nvalid, table, slots, temp, top_p, top_k, seeds, counters, src
