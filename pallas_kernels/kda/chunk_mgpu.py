"""What the Mosaic GPU chunk kernels of the dense path share (``a_mgpu``, ``dqkg_mgpu``): the
gate fused from the raw f, the per-token segment marks, float32 sums of 0/1 matrices' products
through bf16 parts, and SMEM phases that take the last one's place. Tiles are one chunk's
[C, SLICE] (C = 64) in the WGMMA layout of one warpgroup."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import wgmma
from pallas_kernels.kda.config import KdaOptions
from pallas_kernels.kda.recurrence_mgpu import CHUNK

SLICE = 64  # K channels per slice (a [C, SLICE] float32 tile is 32 registers a thread)


def gate(cfg: KdaOptions, x, e, dtb):
  """The per-token log decay [C, BK] float32 from the raw f ``x`` [C, BK] float32, ``e`` =
  e^{A_log} (scalar) and dt_bias ``dtb`` (broadcast to [C, BK]), for the bounded or softplus
  gate (``x`` itself without one)."""
  if cfg.gate is None:
    return x
  x = x + dtb
  if cfg.gate == "bounded":
    return cfg.lower_bound / (1.0 + jnp.exp(-e * x))
  # -e softplus(x) = -e (max(x, 0) + log1p(u)), u = e^{-|x|}
  u = jnp.exp(-jnp.abs(x))
  w = 1.0 + u  # log1p(u) = log(w) u / (w - 1) to float32 (Mosaic GPU lowers no log1p)
  return -e * (jnp.maximum(x, 0.0) + jnp.where(w == 1.0, u, jnp.log(w) * (u / (w - 1.0))))


def marks(seg, cont):
  """``[B, 4, Tp]`` float32 per token: segment (read for rows), cont (1 where the token continues
  the state entering its chunk), in its chunk's last segment, segment (read for columns): one
  load per row of marks, as two layouts of one ref defeat the layout inference."""
  c = CHUNK
  ends = jnp.arange(seg.shape[1]) // c * c + c - 1
  segf = seg.astype(jnp.float32)  # exact to 2^24 segments
  return jnp.stack([segf, cont, (seg == seg[:, ends]).astype(jnp.float32), segf], axis=1)


def scoped(body, *bufs):
  """``pl.run_scoped`` after a barrier: each phase's SMEM takes the last one's place, whose reads
  (plain loads, or the wgmma of another warp) are then done."""
  plgpu.commit_smem()
  return pl.run_scoped(body, *bufs)


def split(x, n: int):
  """``n`` bf16 parts of float32 ``x`` (x ~ their sum), the largest first."""
  parts = []
  for _ in range(n):
    part = x.astype(jnp.bfloat16)
    x = x - part.astype(jnp.float32)
    parts.append(part)
  return parts


def store_split(x, bufs):
  """float32 ``x``'s ``len(bufs)`` bf16 parts (:func:`split`) into the SMEM ``bufs``."""
  for buf, part in zip(bufs, split(x, len(bufs))):
    buf[...] = part


def exact_products(terms, *bufs, interpret: bool):
  """``sum_i m_i @ x_i`` [C, BK] float32 for ``terms`` ((m_i, x_i), ...): m_i a 0/1 (or other
  bf16-exact) [C, C] bf16 matrix, x_i [C, BK] float32 on its three bf16 parts (x = a + b + c
  exactly to float32); ``bufs`` holds four bf16 tiles per term, m_i's then x_i's parts: float32
  sums without a scan across the rows' threads and warps. m_i goes through SMEM: as a register
  operand the product's rows 8-15 of every 16 came out wrong on the card (KDA run 15, an H200: a
  one-CTA probe, ``benchmarks/wgmma_regs_probe.py``)."""
  pairs, bufs = [], iter(bufs)
  for m, x in terms:
    lhs = next(bufs)
    lhs[...] = m
    for part in split(x, 3):
      buf = next(bufs)
      buf[...] = part
      pairs.append((lhs, buf))
  plgpu.commit_smem()
  return wgmma.product(terms[0][1].shape, *pairs, interpret=interpret)


def tile(dtype, c: int = CHUNK):
  """SMEM of one [C, SLICE] operand tile."""
  return wgmma.swizzled((c, SLICE), dtype)


def iota(c: int = CHUNK):
  """(row, column) indices [C, C] int32 in the WGMMA layout."""
  wg = plgpu.Layout.WGMMA
  return (plgpu.broadcasted_iota(jnp.int32, (c, c), 0, layout=wg),
          plgpu.broadcasted_iota(jnp.int32, (c, c), 1, layout=wg))


def vec(ref, layout):
  """A 1-D ref (GMEM or SMEM) loaded in ``layout`` (``wgmma.ROWS`` or ``wgmma.COLS``)."""
  return plgpu.load(ref, layout=layout, optimized=False)


def bcast(x, dim: int, c: int = CHUNK):
  """[C] -> [C, C] along ``dim`` (0: a value per row; C = SLICE)."""
  return lax.broadcast_in_dim(x, (c, c), [dim])
