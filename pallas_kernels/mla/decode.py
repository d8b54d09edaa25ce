"""Paged latent-cache MLA decode as Pallas kernels (GPU: Triton; TPU: Mosaic), split-K.

Absorbed queries q ``[N, Tn, H, R + Dr]`` attend over a paged cache ``[P, page_size, R + Dr]``
(``[c, k_r]`` per token, shared by all heads) through ``page_table [N, max_pages]`` and
``lengths [N]`` (cached tokens *including* the Tn new ones, which attend causally). All ``Tn * H``
query rows of a request share the cache, so each program takes a block of rows and streams the
request's pages once. The sequence is cut into ``num_splits`` ranges of pages (split-K); each
range yields a partial output and log-sum-exp ``[N, splits, rows]``, merged at the end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import default_backend
from pallas_kernels.mla.prefill import (LOG2E, _dot_nt, _finish, _gpu_params, _pow2_parts,
                                        _scores, _softmax_step)


def _step_tokens(page_size: int, cap: int) -> int:
  """Tokens per kernel step: the largest power of two <= cap dividing page_size."""
  bk = cap
  while page_size % bk:
    bk //= 2
  return bk


def _default_splits(n: int, row_blocks: int, steps: int, backend: str) -> int:
  """Enough (request, split, row block) programs to fill the chip about twice (GPU; TPU: 2
  splits for its cores), each split at least 16 steps long (the merge reads every split)."""
  cores = getattr(jax.devices()[0], "core_count", None) or 132
  target = 2 * cores if backend == "gpu" else 2
  return max(1, min(-(-target // (n * row_blocks)), steps // 16))


def _merge(o_part, lse_part):
  """``[N, S, R, Dv]`` partial outputs and base-2 lse ``[N, S, R]`` -> ``[N, R, Dv]``."""
  if o_part.shape[1] == 1:
    return o_part[:, 0]
  mx = lse_part.max(1, keepdims=True)
  w = jnp.exp2(lse_part - jnp.where(mx == -jnp.inf, 0.0, mx))
  den = w.sum(1)
  return (o_part * w[..., None]).sum(1) / jnp.where(den > 0, den, 1.0)[..., None]


# --------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(lens_ref, table_ref, qoff_ref, q_ref, cache_ref, o_ref, lse_ref, *, scale: float,
                page_size: int, bk: int, steps_per_split: int, lat_parts, rope_parts):
  s_idx, n = pl.program_id(1), pl.program_id(2)
  length = lens_ref[n]
  qpos = (length + qoff_ref[...])[:, None]
  qk_parts = lat_parts + rope_parts
  q_parts = [q_ref[:, pl.ds(o, w)] for o, w in qk_parts]
  start = s_idx * steps_per_split
  stop = jnp.minimum(start + steps_per_split, lax.div(length + bk - 1, bk))
  per_page = page_size // bk

  def body(j, carry):
    m, l, accs = carry
    page = table_ref[lax.div(j, per_page)]
    rows = pl.ds(lax.rem(j, per_page) * bk, bk)
    kv = [cache_ref[page, rows, pl.ds(o, w)] for o, w in qk_parts]
    s = _scores(q_parts, kv, scale * LOG2E)
    kpos = (j * bk + jnp.arange(bk))[None, :]
    s = jnp.where((kpos <= qpos) & (kpos < length), s, -jnp.inf)
    return _softmax_step(s, m, l, accs, kv[:len(lat_parts)])

  bm = q_ref.shape[0]
  init = (jnp.full((bm, 1), -jnp.inf, jnp.float32), jnp.zeros((bm, 1), jnp.float32),
          tuple(jnp.zeros((bm, w), jnp.float32) for _, w in lat_parts))
  m, l, accs = lax.fori_loop(start, jnp.maximum(start, stop), body, init)
  outs, lse = _finish(m, l, accs)
  for (o, w), out in zip(lat_parts, outs):
    o_ref[:, pl.ds(o, w)] = out
  lse_ref[...] = jnp.where(l[:, 0] > 0.0, lse[:, 0], -jnp.inf)


def _gpu_decode(q, cache, page_table, lengths, qoff, *, kv_lora_rank, scale, num_splits,
                block_rows, step_tokens, warps, stages, interpret):
  n, rp, d = q.shape
  _, ps, _ = cache.shape
  max_pages = page_table.shape[1]
  bm = block_rows
  nr = rp // bm
  bk = _step_tokens(ps, step_tokens)
  steps = max_pages * ps // bk
  ns = num_splits or _default_splits(n, nr, steps, "gpu")
  sps = -(-steps // ns)
  kernel = functools.partial(
      _gpu_kernel, scale=scale, page_size=ps, bk=bk, steps_per_split=sps,
      lat_parts=_pow2_parts(kv_lora_rank),
      rope_parts=tuple((kv_lora_rank + o, w) for o, w in _pow2_parts(d - kv_lora_rank)))
  o_part, lse_part = pl.pallas_call(
      kernel, grid=(nr, ns, n),
      in_specs=[pl.BlockSpec((n,), lambda r, s, i: (0,)),
                pl.BlockSpec((None, max_pages), lambda r, s, i: (i, 0)),
                pl.BlockSpec((bm,), lambda r, s, i: (r,)),
                pl.BlockSpec((None, bm, d), lambda r, s, i: (i, r, 0)),
                pl.BlockSpec(cache.shape, lambda r, s, i: (0, 0, 0))],
      out_specs=[pl.BlockSpec((None, None, bm, kv_lora_rank), lambda r, s, i: (i, s, r, 0)),
                 pl.BlockSpec((None, None, bm), lambda r, s, i: (i, s, r))],
      out_shape=[jax.ShapeDtypeStruct((n, ns, rp, kv_lora_rank), jnp.float32),
                 jax.ShapeDtypeStruct((n, ns, rp), jnp.float32)],
      compiler_params=_gpu_params(warps, stages), interpret=interpret,
      name="mla_decode")(lengths, page_table, qoff, q, cache)
  return _merge(o_part, lse_part)


# --------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(lens_ref, table_ref, qoff_ref, q_ref, cache_ref, o_ref, lse_ref, m_ref, l_ref,
                acc_ref, *, scale: float, bk: int, steps_per_split: int, kv_lora_rank: int):
  n, s_idx, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = lens_ref[n]
  step = s_idx * steps_per_split + j

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(step * bk < length)
  def _():
    kv = cache_ref[...]
    s = _dot_nt(q_ref[...], kv) * (scale * LOG2E)
    rows = q_ref.shape[0]
    kpos = step * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
    s = jnp.where((kpos <= length + qoff_ref[...]) & (kpos < length), s, -jnp.inf)
    m, l, (acc,) = _softmax_step(s, m_ref[...], l_ref[...], (acc_ref[...],),
                                 [kv[:, :kv_lora_rank]])
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

  @pl.when(j == steps_per_split - 1)
  def _():
    (out,), lse = _finish(m_ref[...], l_ref[...], (acc_ref[...],))
    o_ref[...] = out
    lse_ref[...] = jnp.where(l_ref[...] > 0.0, lse, -jnp.inf)


def _tpu_decode(q, cache, page_table, lengths, qoff, *, kv_lora_rank, scale, num_splits,
                step_tokens, interpret):
  n, rp, d = q.shape
  _, ps, _ = cache.shape
  max_pages = page_table.shape[1]
  bk = _step_tokens(ps, step_tokens)
  per_page = ps // bk
  steps = max_pages * per_page
  ns = num_splits or _default_splits(n, 1, steps, "tpu")
  sps = -(-steps // ns)

  def cache_idx(i, s, j, lens, table):
    last = jnp.maximum(lax.div(lens[i] + bk - 1, bk) - 1, 0)
    step = jnp.minimum(s * sps + j, last)  # past the end: same block again, no new DMA
    return table[i * max_pages + lax.div(step, per_page)], lax.rem(step, per_page), 0

  kernel = functools.partial(_tpu_kernel, scale=scale, bk=bk, steps_per_split=sps,
                             kv_lora_rank=kv_lora_rank)
  o_part, lse_part = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(n, ns, sps),
          in_specs=[pl.BlockSpec((rp, 1), lambda i, s, j, lens, table: (0, 0)),
                    pl.BlockSpec((None, rp, d), lambda i, s, j, lens, table: (i, 0, 0)),
                    pl.BlockSpec((None, bk, d), cache_idx)],
          out_specs=[pl.BlockSpec((None, None, rp, kv_lora_rank),
                                  lambda i, s, j, lens, table: (i, s, 0, 0)),
                     pl.BlockSpec((None, None, rp, 1), lambda i, s, j, lens, table: (i, s, 0, 0))],
          scratch_shapes=[pltpu.VMEM((rp, 1), jnp.float32), pltpu.VMEM((rp, 1), jnp.float32),
                          pltpu.VMEM((rp, kv_lora_rank), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((n, ns, rp, kv_lora_rank), jnp.float32),
                 jax.ShapeDtypeStruct((n, ns, rp, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False,
      name="mla_decode")(lengths, page_table.reshape(-1), qoff[:, None], q, cache)
  return _merge(o_part, lse_part[..., 0])


# --------------------------------------------------------------------------- entry point


def mla_decode(q, cache, page_table, lengths, *, kv_lora_rank, scale, backend, num_splits=None,
               block_rows=32, step_tokens=None, warps=4, stages=2, interpret=None):
  """Paged latent decode (semantics of ``reference.paged_decode``) -> ``[N, Tn, H, R]``.

  ``num_splits``: sequence splits per request (default: enough to fill the chip);
  ``block_rows`` (GPU): query rows (of ``Tn * H``) per program; ``step_tokens``: cache tokens per
  step (a power of two dividing page_size; default 64 on GPU, 512 on TPU); ``warps``/``stages``:
  Triton launch parameters. Interpret mode by default off the matching platform.
  """
  if backend not in ("gpu", "tpu"):
    raise ValueError(f"mla_decode: unknown Pallas backend {backend!r}; expected 'gpu' or 'tpu'")
  if q.ndim != 4 or cache.ndim != 3 or page_table.ndim != 2 or lengths.ndim != 1:
    raise ValueError(f"mla_decode: expected q [N, Tn, H, D], cache [P, page_size, D], page_table "
                     f"[N, max_pages], lengths [N]; got {q.shape}, {cache.shape}, "
                     f"{page_table.shape}, {lengths.shape}")
  n, tn, h, d = q.shape
  ps = cache.shape[1]
  if cache.shape[2] != d or page_table.shape[0] != n or lengths.shape[0] != n:
    raise ValueError(f"mla_decode: shapes disagree: q {q.shape}, cache {cache.shape}, "
                     f"page_table {page_table.shape}, lengths {lengths.shape}")
  if not 0 < kv_lora_rank < d or kv_lora_rank % 16 or (d - kv_lora_rank) % 16 or ps % 16:
    raise ValueError(f"mla_decode: kv_lora_rank ({kv_lora_rank}), the rope dim "
                     f"({d - kv_lora_rank}) and page_size ({ps}) must be positive multiples of 16")
  if interpret is None:
    interpret = default_backend() != backend
  rows = tn * h
  bm = min(block_rows, max(16, pl.next_power_of_2(rows))) if backend == "gpu" else 16
  rp = -(-rows // bm) * bm
  qr = q.reshape(n, rows, d)
  if rp != rows:
    qr = jnp.pad(qr, ((0, 0), (0, rp - rows), (0, 0)))
  # query row r is token r // H of the Tn new ones: position lengths - Tn + r // H
  qoff = jnp.asarray([min(r // h, tn - 1) - tn for r in range(rp)], jnp.int32)
  page_table = page_table.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  if backend == "gpu":
    o = _gpu_decode(qr, cache, page_table, lengths, qoff, kv_lora_rank=kv_lora_rank, scale=scale,
                    num_splits=num_splits, block_rows=bm, step_tokens=step_tokens or 64,
                    warps=warps, stages=stages, interpret=interpret)
  else:
    o = _tpu_decode(qr, cache, page_table, lengths, qoff, kv_lora_rank=kv_lora_rank, scale=scale,
                    num_splits=num_splits, step_tokens=step_tokens or 512, interpret=interpret)
  return o[:, :rows].reshape(n, tn, h, kv_lora_rank).astype(q.dtype)


__all__ = ["mla_decode"]
