"""The static description of a prefill call and its block tables: which (query block, key block)
pairs are skipped, visited with a mask or visited without one (see :mod:`.prefill`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes (powers of two) and Triton launch parameters of the three kernels.

  The GPU defaults won a sweep on the H200 at B2 T8192 H96 causal (``benchmarks/mla.py``)."""
  fwd_q: int = 128
  fwd_k: int = 64
  fwd_warps: int = 8
  fwd_stages: int = 3
  dkv_q: int = 64
  dkv_k: int = 128
  dkv_warps: int = 8
  dkv_stages: int = 2
  dq_q: int = 128
  dq_k: int = 64
  dq_warps: int = 8
  dq_stages: int = 2

  def fitted(self, t: int, s: int) -> "Blocks":
    """Tiles no longer than the (power-of-two rounded, at least 16) sequence they cover."""
    cap_t = max(16, pl.next_power_of_2(t))
    cap_s = max(16, pl.next_power_of_2(s))
    return dataclasses.replace(
        self, fwd_q=min(self.fwd_q, cap_t), fwd_k=min(self.fwd_k, cap_s),
        dkv_q=min(self.dkv_q, cap_t), dkv_k=min(self.dkv_k, cap_s),
        dq_q=min(self.dq_q, cap_t), dq_k=min(self.dq_k, cap_s))

  def pad_to(self) -> int:
    return max(self.fwd_q, self.fwd_k, self.dkv_q, self.dkv_k, self.dq_q, self.dq_k)


GPU_BLOCKS = Blocks()
TPU_BLOCKS = Blocks(fwd_q=128, fwd_k=128, dkv_q=128, dkv_k=128, dq_q=128, dq_k=128)



@dataclasses.dataclass(frozen=True)
class Static:
  """A prefill call's static arguments (the custom VJP's nondifferentiable one)."""
  backend: str
  causal: bool
  scale: float
  t: int  # true query length
  s: int  # true key length
  blocks: Blocks
  interpret: bool
  static_off: int | None = None  # the query offset when known at trace time (then compiled in)


def query_offset(st: Static, off_ref):
  """The key position of query row 0: the static one, else the runtime input's."""
  return off_ref[0] if st.static_off is None else st.static_off



def _seg_minmax(seg, blk):
  """``[B, n]`` min and max segment id of each block of ``seg [B, Tp]``."""
  r = seg.reshape(seg.shape[0], -1, blk)
  return r.min(-1), r.max(-1)


def _visibility(qseg, kseg, *, t, s, tp, sp, bq, bk, causal, off):
  """``(any, full)`` bool ``[B or 1, nq, nk]``: some / every element of the block pair visible.

  qseg ``[B, Tp]`` / kseg ``[B, Sp]`` (both or neither); off: key position of query row 0."""
  nq, nk = tp // bq, sp // bk
  qi = jnp.arange(nq)[:, None]
  kj = jnp.arange(nk)[None, :]
  q_first = qi * bq + off
  q_last = jnp.minimum(qi * bq + bq - 1, t - 1) + off
  k_first, k_last = kj * bk, kj * bk + bk - 1
  vis = (k_first < s) & (qi * bq < t)
  full = (k_last < s) & (qi * bq < t)
  if causal:
    vis &= k_first <= q_last
    full &= k_last <= q_first
  vis, full = vis[None], full[None]
  if qseg is not None:
    qmin, qmax = _seg_minmax(qseg, bq)
    kmin, kmax = _seg_minmax(kseg, bk)
    vis = vis & (kmax[:, None, :] >= qmin[:, :, None]) & (kmin[:, None, :] <= qmax[:, :, None])
    uniform = ((qmin == qmax)[:, :, None] & (kmin == kmax)[:, None, :]
               & (qmin[:, :, None] == kmin[:, None, :]))
    full = full & uniform
  return vis, full


def _summarise(vis, full):
  """``[..., n]`` visibility rows -> ``[..., 4]`` int32 ``(lo, a, b, hi)`` (see module doc)."""
  n = vis.shape[-1]
  j = jnp.arange(n)
  anyv = vis.any(-1)
  lo = jnp.where(anyv, jnp.argmax(vis, -1), 0)
  hi = jnp.where(anyv, n - jnp.argmax(vis[..., ::-1], -1), 0)
  anyf = full.any(-1)
  a = jnp.where(anyf, jnp.argmax(full, -1), hi)
  after = ~full & (j >= a[..., None])
  b = jnp.where(after.any(-1), jnp.argmax(after, -1), n)
  b = jnp.where(anyf, jnp.minimum(b, hi), hi)
  return jnp.stack([lo, a, b, hi], -1).astype(jnp.int32)


def block_tables(qseg, kseg=None, *, t, s, tp, sp, bq, bk, causal, off=None):
  """``(rows, cols)``: ``[B or 1, nq, 4]`` key-block ranges per query block and
  ``[B or 1, nk, 4]`` query-block ranges per key block. kseg defaults to qseg (S == T), off
  (int or int32 scalar, may be traced) to ``s - t``."""
  kseg = qseg if kseg is None else kseg
  off = s - t if off is None else off
  vis, full = _visibility(qseg, kseg, t=t, s=s, tp=tp, sp=sp, bq=bq, bk=bk, causal=causal,
                          off=off)
  return _summarise(vis, full), _summarise(vis.swapaxes(1, 2), full.swapaxes(1, 2))



def element_mask(qpos, kpos, qseg, kseg, *, causal, s):
  """Element mask from broadcastable key positions of the queries / keys and segment ids."""
  m = kpos < s
  if causal:
    m = m & (kpos <= qpos)
  if qseg is not None:
    m = m & (qseg == kseg)
  return m

