"""Paged latent-cache MLA decode as Pallas kernels (GPU: Triton or Mosaic GPU; TPU: Mosaic),
split-K.

Absorbed queries q ``[N, Tn, H, R + Dr]`` attend over a paged cache ``[P, page_size, R + Dr]``
(``[c, k_r]`` per token, shared by all heads) through ``page_table [N, max_pages]`` and
``lengths [N]`` (cached tokens *including* the Tn new ones, which attend causally). All ``Tn * H``
query rows of a request share the cache, so each program takes a block of rows and streams the
request's pages once. The sequence is cut into ``num_splits`` ranges of pages (split-K); each
range yields a partial output and log-sum-exp ``[N, splits, rows]``, merged at the end.

The Mosaic GPU kernel (``gpu_kernel="mosaic"``, Hopper: TMA and wgmma) is FlashMLA's layout:
64 query rows per program, the ``[64 tokens, R + Dr]`` cache tile shared by ``Q K^T`` and (its
first R columns) ``P V``, the ``[64, R]`` accumulator split over two warpgroups by value columns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import default_backend, num_sms, wgmma
from pallas_kernels.mla import reference
from pallas_kernels.mla.common import (LOG2E, dot_nt, finish, gpu_params, pow2_parts, scores,
                                       softmax_step)


def _step_tokens(page_size: int, cap: int) -> int:
  """Tokens per kernel step: the largest power of two <= cap dividing page_size."""
  bk = cap
  while page_size % bk:
    bk //= 2
  return bk


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How :func:`mla_decode` runs.

  ``gpu_kernel``: ``"triton"``, ``"mosaic"`` (Mosaic GPU: bf16/f16, rows in 64-row programs,
  64-token steps; ``block_rows``, ``step_tokens`` and ``warps`` do not apply) or ``"auto"``
  (``"mosaic"`` where its conditions hold, else Triton). ``num_splits``: sequence splits per
  request (None: :func:`default_splits` for ``waves``, or ``mgpu_waves`` for the Mosaic kernel,
  which holds one program per SM, so ragged lengths need finer splits to cut the tail);
  ``block_rows`` (Triton): query rows (of ``Tn * H``) per program; ``step_tokens``: cache tokens
  per step (a power of two dividing page_size; None: 64 on GPU, 512 on TPU); ``warps``/
  ``stages``: Triton launch parameters (``stages``: also the Mosaic kernel's cache ring, 2 fills
  its SMEM). ``mgpu_grid``: the Mosaic kernel's grid axes, outermost first; Pallas Mosaic GPU
  launches its grid reversed (the last axis is CUDA's x, dispatched first), so the row blocks go
  last: the programs sharing one request's cache tiles run side by side and the second reads
  them from L2. Split counts and grid order: benchmarks/RESULTS.md, "MLA", decode run 3."""
  gpu_kernel: str = "auto"
  num_splits: int | None = None
  block_rows: int = 32
  step_tokens: int | None = None
  warps: int = 4
  stages: int = 2
  waves: int = 2
  mgpu_waves: int = 8
  mgpu_grid: tuple[str, ...] = ("req", "split", "rb")


def default_splits(n: int, row_blocks: int, steps: int, backend: str, waves: int) -> int:
  """Enough (request, split, row block) programs to fill the chip ``waves`` times (GPU; TPU: 2
  splits for its cores), each split at least 16 steps long (the merge reads every split)."""
  target = waves * num_sms() if backend == "gpu" else 2
  return max(1, min(-(-target // (n * row_blocks)), steps // 16))


def _merge(o_part, lse_part):
  """``[N, S, R, Dv]`` partial outputs and base-2 lse ``[N, S, R]`` -> ``[N, R, Dv]``."""
  return reference.merge_partials(o_part, lse_part, 1, base2=True)


# --------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(lens_ref, table_ref, qoff_ref, q_ref, cache_ref, o_ref, lse_ref, *, scale: float,
                page_size: int, bk: int, steps_per_split: int, lat_parts, rope_parts):
  s_idx, n = pl.program_id(1), pl.program_id(2)
  length = lens_ref[n]
  qpos = (length + qoff_ref[...])[:, None]
  qk_parts = lat_parts + rope_parts
  q_parts = [q_ref[:, pl.ds(o, w)] for o, w in qk_parts]
  start = s_idx * steps_per_split
  bk32, per_page = jnp.int32(bk), jnp.int32(page_size // bk)  # lax.div: same dtypes, also under x64
  stop = jnp.minimum(start + steps_per_split, lax.div(length + bk - 1, bk32))

  def body(j, carry):
    m, l, accs = carry
    page = table_ref[lax.div(j, per_page)]
    rows = pl.ds(lax.rem(j, per_page) * bk, bk)
    kv = [cache_ref[page, rows, pl.ds(o, w)] for o, w in qk_parts]
    s = scores(q_parts, kv, scale * LOG2E)
    kpos = (j * bk + jnp.arange(bk))[None, :]
    s = jnp.where((kpos <= qpos) & (kpos < length), s, -jnp.inf)
    return softmax_step(s, m, l, accs, kv[:len(lat_parts)])

  bm = q_ref.shape[0]
  init = (jnp.full((bm, 1), -jnp.inf, jnp.float32), jnp.zeros((bm, 1), jnp.float32),
          tuple(jnp.zeros((bm, w), jnp.float32) for _, w in lat_parts))
  m, l, accs = lax.fori_loop(start, jnp.maximum(start, stop), body, init)
  outs, lse = finish(m, l, accs)
  for (o, w), out in zip(lat_parts, outs):
    o_ref[:, pl.ds(o, w)] = out
  lse_ref[...] = jnp.where(l[:, 0] > 0.0, lse[:, 0], -jnp.inf)


def _gpu_decode(q, cache, page_table, lengths, qoff, *, kv_lora_rank, scale, block_rows,
                config: DecodeConfig, interpret):
  n, rp, d = q.shape
  _, ps, _ = cache.shape
  max_pages = page_table.shape[1]
  bm = block_rows
  nr = rp // bm
  bk = _step_tokens(ps, config.step_tokens or 64)
  steps = max_pages * ps // bk
  ns = config.num_splits or default_splits(n, nr, steps, "gpu", config.waves)
  sps = -(-steps // ns)
  kernel = functools.partial(
      _gpu_kernel, scale=scale, page_size=ps, bk=bk, steps_per_split=sps,
      lat_parts=pow2_parts(kv_lora_rank),
      rope_parts=tuple((kv_lora_rank + o, w) for o, w in pow2_parts(d - kv_lora_rank)))
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
      compiler_params=gpu_params(config.warps, config.stages), interpret=interpret,
      name="mla_decode")(lengths, page_table, qoff, q, cache)
  return _merge(o_part, lse_part)


# --------------------------------------------------------------------------- GPU (Mosaic GPU)

# The Mosaic kernel's shape, which its code is written for (not options):
MGPU_ROWS = 64  # query rows per program: one wgmma M tile
MGPU_STEP = 64  # cache tokens per step
MGPU_THREADS = 3  # warpgroups: 0 softmax and half the value columns, 1 the other half, 2 TMA


def _mgpu_grid(n: int, ns: int, nr: int, axes: tuple[str, ...]) -> tuple[int, ...]:
  """Grid sizes in the order of ``axes`` (a permutation of requests, splits, row blocks)."""
  size = {"req": n, "split": ns, "rb": nr}
  return tuple(size[a] for a in axes)


def _mgpu_program(lens_ref, steps_per_split: int):
  """This program's (row block, split, request, warpgroup, request length, first cache step,
  steps)."""
  rb, s_idx, n = lax.axis_index("rb"), lax.axis_index("split"), lax.axis_index("req")
  length = lens_ref[n]
  start = s_idx * steps_per_split
  step32 = jnp.int32(MGPU_STEP)  # lax.div: same dtypes, also under x64
  stop = jnp.minimum(start + steps_per_split, lax.div(length + MGPU_STEP - 1, step32))
  return rb, s_idx, n, lax.axis_index("wg"), length, start, jnp.maximum(stop - start, 0)


def _mgpu_load_q(q_rows, q_smem, q_bar):
  """The softmax warpgroup's start: more registers, and its query rows copied to SMEM."""
  plgpu.set_max_registers(232, action="increase")
  plgpu.copy_gmem_to_smem(q_rows, q_smem, q_bar)
  plgpu.barrier_wait(q_bar)


def _mgpu_stream(table_ref, cache_ref, k_smem, k_ready, k_free, *, n, start, count, per_page):
  """Producer warpgroup: TMA request n's cache steps ``start .. start + count - 1`` (``[64, D]``
  each) into the ring ``k_smem [stages, 64, D]``; a slot is refilled once ``k_free`` says both
  consumer warpgroups are done with it."""
  # int32 like the loop index, also under x64 (lax.div / lax.rem take equal dtypes)
  stages, per_page = jnp.int32(k_smem.shape[0]), jnp.int32(per_page)
  plgpu.set_max_registers(40, action="decrease")

  @pl.loop(0, count)
  def _(k):
    slot = lax.rem(k, stages)
    j = start + k
    page = table_ref[n, lax.div(j, per_page)]  # read before waiting: hides its latency

    @pl.when(k >= stages)
    def _():
      plgpu.barrier_wait(k_free.at[slot])

    src = cache_ref.at[page, pl.ds(lax.rem(j, per_page) * MGPU_STEP, MGPU_STEP)]
    plgpu.copy_gmem_to_smem(src, k_smem.at[slot], k_ready.at[slot])

  @pl.loop(jnp.maximum(count, stages), count + stages)
  def _(k):  # observe the last slots' releases too: every barrier phase is waited on once
    plgpu.barrier_wait(k_free.at[lax.rem(k, stages)])


def _mgpu_visible(shape, first_row, first_token, length, tn: int, heads: int):
  """Bool ``shape`` ``[rows, tokens]`` (WGMMA layout), query rows from ``first_row``, cache tokens
  from ``first_token``: query row r (new token t = #{i in 1..tn-1: r >= i*heads}, at position
  length - tn + t) sees token c iff c <= its position and c < length."""
  iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
  row = first_row + iota(0)
  qpos = jnp.full(shape, length - tn, jnp.int32)
  for t in range(1, tn):
    qpos = qpos + jnp.where(row >= t * heads, 1, 0)
  kpos = first_token + iota(1)
  return (kpos <= qpos) & (kpos < length)


def _mgpu_kernel(lens_ref, table_ref, q_ref, cache_ref, o_ref, lse_ref, q_smem, k_smem, p_smem,
                 alpha_smem, lse_smem, q_bar, k_ready, k_free, p_ready, p_free, *, scale: float,
                 kv_lora_rank: int, tn: int, heads: int, per_page: int, steps_per_split: int,
                 stages: int, interpret: bool):
  """One program: 64 query rows of one request over one split of its cache, three warpgroups.

  Warpgroup 2 streams the split's cache steps ``[64, D]`` (``D = R + Dr``) into a ring of
  ``stages`` SMEM slots with TMA. Warpgroup 0 computes ``S = Q K^T`` (wgmma, ``[64, 64]``), the
  online softmax and ``P V`` for the first R/2 value columns (V = the first R columns of the same
  SMEM tile); it hands P (bf16) and the rows' rescale factor to warpgroup 1 through SMEM, which
  accumulates ``P V`` for the other R/2 columns. Each accumulator ``[64, R/2]`` float32 stays
  in registers. Outputs: the normalised partial ``o [64, R]`` float32 (stored from registers)
  and the base-2 log-sum-exp ``[64]`` (``-inf`` where this split saw no key).

  Barriers: ``k_ready``/``k_free`` per slot (TMA -> both consumers -> producer), ``p_ready``/
  ``p_free`` (warpgroup 0 -> 1 -> 0, one P buffer); a last ``p_ready`` hands 1/l to warpgroup 1.
  """
  rb, s_idx, n, wg, length, start, count = _mgpu_program(lens_ref, steps_per_split)
  half = kv_lora_rank // 2
  rows = pl.ds(rb * MGPU_ROWS, MGPU_ROWS)
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  @pl.when(wg == 2)
  def _producer():
    _mgpu_stream(table_ref, cache_ref, k_smem, k_ready, k_free, n=n, start=start, count=count,
                 per_page=per_page)

  @pl.when(wg == 0)
  def _softmax_wg():
    _mgpu_load_q(q_ref.at[n, rows], q_smem, q_bar)

    def step(k, carry, masked):
      acc, m, l = carry
      slot = lax.rem(k, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      kv = k_smem.at[slot]

      s = wgmma.product((MGPU_ROWS, MGPU_STEP), (q_smem, kv.transpose((1, 0)))) * (scale * LOG2E)
      if masked:
        s = jnp.where(_mgpu_visible(s.shape, rb * MGPU_ROWS, (start + k) * MGPU_STEP, length, tn,
                                    heads), s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_safe)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)

      @pl.when(k > 0)
      def _():
        plgpu.barrier_wait(p_free)

      p_smem[...] = p.astype(p_smem.dtype)
      alpha_smem[...] = alpha
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_ready)
      acc = wgmma.add(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]),
                      (p_smem, kv.at[:, pl.ds(0, half)]), interpret=interpret)
      plgpu.barrier_arrive(k_free.at[slot])
      return acc, m_new, l

    init = (plgpu.layout_cast(jnp.zeros((MGPU_ROWS, half), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((MGPU_ROWS,), -jnp.inf, jnp.float32), row_layout),
            plgpu.layout_cast(jnp.zeros((MGPU_ROWS,), jnp.float32), row_layout))
    # steps before ``full`` hold only keys every query row of the request sees: no mask
    full = jnp.clip(lax.div(length - tn + 1, jnp.int32(MGPU_STEP)) - start, 0, count)
    carry = lax.fori_loop(0, full, functools.partial(step, masked=False), init)
    acc, m, l = lax.fori_loop(full, count, functools.partial(step, masked=True), carry)
    seen = l > 0.0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)

    @pl.when(count > 0)
    def _():
      plgpu.barrier_wait(p_free)

    alpha_smem[...] = inv
    plgpu.barrier_arrive(p_ready)
    o_ref.at[n, s_idx, rows, pl.ds(0, half)][...] = (
        acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_ref.dtype)
    lse_smem[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * LOG2E, -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[n, s_idx, rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _value_wg():
    plgpu.set_max_registers(232, action="increase")

    def step(k, acc):
      slot = lax.rem(k, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])
      plgpu.barrier_wait(p_ready)
      alpha = plgpu.load(alpha_smem, layout=row_layout)
      acc = wgmma.add(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]),
                      (p_smem, k_smem.at[slot].at[:, pl.ds(half, half)]), interpret=interpret)
      plgpu.barrier_arrive(p_free)
      plgpu.barrier_arrive(k_free.at[slot])
      return acc

    init = plgpu.layout_cast(jnp.zeros((MGPU_ROWS, half), jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, count, step, init)
    plgpu.barrier_wait(p_ready)
    inv = plgpu.load(alpha_smem, layout=row_layout)
    o_ref.at[n, s_idx, rows, pl.ds(half, half)][...] = (
        acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_ref.dtype)


def _mgpu_decode(q, cache, page_table, lengths, *, kv_lora_rank, scale, tn, heads,
                 config: DecodeConfig, interpret):
  """Runs ``_mgpu_kernel`` over (request, split, row block) and merges the splits."""
  n, rp, d = q.shape
  ps = cache.shape[1]
  nr = rp // MGPU_ROWS
  per_page = ps // MGPU_STEP
  steps = page_table.shape[1] * per_page
  ns = config.num_splits or default_splits(n, nr, steps, "gpu", config.mgpu_waves)
  sps = -(-steps // ns)
  stages = config.stages
  swz = lambda: (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  kernel = functools.partial(
      _mgpu_kernel, scale=scale, kv_lora_rank=kv_lora_rank, tn=tn, heads=heads,
      per_page=per_page, steps_per_split=sps, stages=stages, interpret=interpret)
  kernel.__name__ = "mla_decode_mgpu"  # the kernel's name in profiles and HLO
  o_part, lse_part = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((n, ns, rp, kv_lora_rank), jnp.float32),
                jax.ShapeDtypeStruct((n, ns, rp), jnp.float32)),
      scratch_types=(
          plgpu.SMEM((MGPU_ROWS, d), q.dtype, transforms=swz()),
          plgpu.SMEM((stages, MGPU_STEP, d), q.dtype, transforms=swz()),
          plgpu.SMEM((MGPU_ROWS, MGPU_STEP), q.dtype, transforms=swz()),
          plgpu.SMEM((MGPU_ROWS,), jnp.float32),
          plgpu.SMEM((MGPU_ROWS,), jnp.float32),
          plgpu.Barrier(),
          plgpu.Barrier(num_barriers=stages),
          plgpu.Barrier(num_arrivals=2, num_barriers=stages),
          plgpu.Barrier(),
          plgpu.Barrier()),
      grid=_mgpu_grid(n, ns, nr, config.mgpu_grid), grid_names=config.mgpu_grid,
      **wgmma.kernel_params(interpret, MGPU_THREADS, reduction_scratch_bytes=0))(
          lengths, page_table, q, cache)
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
    s = dot_nt(q_ref[...], kv) * (scale * LOG2E)
    rows = q_ref.shape[0]
    kpos = step * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
    s = jnp.where((kpos <= length + qoff_ref[...]) & (kpos < length), s, -jnp.inf)
    m, l, (acc,) = softmax_step(s, m_ref[...], l_ref[...], (acc_ref[...],),
                                 [kv[:, :kv_lora_rank]])
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

  @pl.when(j == steps_per_split - 1)
  def _():
    (out,), lse = finish(m_ref[...], l_ref[...], (acc_ref[...],))
    o_ref[...] = out
    lse_ref[...] = jnp.where(l_ref[...] > 0.0, lse, -jnp.inf)


def _tpu_decode(q, cache, page_table, lengths, qoff, *, kv_lora_rank, scale, config: DecodeConfig,
                interpret):
  n, rp, d = q.shape
  _, ps, _ = cache.shape
  max_pages = page_table.shape[1]
  bk = _step_tokens(ps, config.step_tokens or 512)
  per_page = ps // bk
  steps = max_pages * per_page
  ns = config.num_splits or default_splits(n, 1, steps, "tpu", config.waves)
  sps = -(-steps // ns)

  def cache_idx(i, s, j, lens, table):
    bk32, pp = jnp.int32(bk), jnp.int32(per_page)  # lax.div: same dtypes, also under x64
    last = jnp.maximum(lax.div(lens[i] + bk - 1, bk32) - 1, 0)
    step = jnp.minimum(s * sps + j, last)  # past the end: same block again, no new DMA
    return table[i * max_pages + lax.div(step, pp)], lax.rem(step, pp), 0

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


def mla_decode(q, cache, page_table, lengths, *, kv_lora_rank, scale, backend,
               config: DecodeConfig = DecodeConfig(), interpret=None):
  """Paged latent decode (semantics of ``reference.paged_decode``) -> ``[N, Tn, H, R]``, run as
  ``config`` says (:class:`DecodeConfig`). Interpret mode by default off the matching platform.
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
  gpu_kernel = config.gpu_kernel
  if backend == "gpu" and gpu_kernel not in ("triton", "mosaic", "auto"):
    raise ValueError(f"mla_decode: unknown gpu_kernel {gpu_kernel!r}; expected 'triton', "
                     "'mosaic' or 'auto'")
  mosaic_ok = (q.dtype in (jnp.bfloat16, jnp.float16) and cache.dtype == q.dtype
               and kv_lora_rank % 128 == 0 and kv_lora_rank <= 512 and d % 64 == 0 and ps % 64 == 0)
  if gpu_kernel == "auto":
    gpu_kernel = "mosaic" if mosaic_ok else "triton"
  mosaic = backend == "gpu" and gpu_kernel == "mosaic"
  if mosaic and not mosaic_ok:
    raise ValueError(f"mla_decode(mosaic): needs bf16/f16 q and cache of one dtype (got {q.dtype}, "
                     f"{cache.dtype}), kv_lora_rank a multiple of 128 up to 512 (got "
                     f"{kv_lora_rank}), q dim and page_size multiples of 64 (got {d}, {ps})")
  if interpret is None:
    interpret = default_backend() != backend
  rows = tn * h
  if mosaic:
    bm = MGPU_ROWS
  else:
    bm = min(config.block_rows, max(16, pl.next_power_of_2(rows))) if backend == "gpu" else 16
  rp = -(-rows // bm) * bm
  qr = q.reshape(n, rows, d)
  if rp != rows:
    qr = jnp.pad(qr, ((0, 0), (0, rp - rows), (0, 0)))
  # query row r is token r // H of the Tn new ones: position lengths - Tn + r // H
  qoff = jnp.asarray([min(r // h, tn - 1) - tn for r in range(rp)], jnp.int32)
  page_table = page_table.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  if mosaic:
    o = _mgpu_decode(
        qr, cache, page_table, lengths, kv_lora_rank=kv_lora_rank, scale=scale, tn=tn, heads=h,
        config=config, interpret=interpret)
  elif backend == "gpu":
    o = _gpu_decode(qr, cache, page_table, lengths, qoff, kv_lora_rank=kv_lora_rank, scale=scale,
                    block_rows=bm, config=config, interpret=interpret)
  else:
    o = _tpu_decode(qr, cache, page_table, lengths, qoff, kv_lora_rank=kv_lora_rank, scale=scale,
                    config=config, interpret=interpret)
  return o[:, :rows].reshape(n, tn, h, kv_lora_rank).astype(q.dtype)


__all__ = ["mla_decode", "DecodeConfig", "default_splits"]
