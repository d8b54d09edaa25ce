"""Mosaic GPU (Hopper, sm_90a) grouped-matmul kernels for MoE.

Two kernels, both persistent over the streaming multiprocessors (SMs), bf16/f16 operands with
float32 accumulation in WGMMA registers and TMA loads through a multi-stage shared-memory pipeline:

* :func:`gmm`: ``out [M, N] = lhs [M, K] @ rhs[g(r)] [K, N]`` (or ``rhs [E, N, K]`` transposed, the
  ``d_lhs`` product, read in place), rows sorted by group. A few fused XLA reductions
  (:func:`row_tiles`, no scan or while loop) build a table of row tiles: each group's tiles start
  at its first row rounded down to 8 (TMA row tiling), so a group of ``s`` rows costs
  ``ceil((s + 7) / block_m)`` tiles, empty groups none; rows past ``sum(group_sizes)`` form one
  more pseudo-group whose tiles store zeros (no extra masking pass over the output). On a GPU each
  SM runs its share of the (row tile, column tile) items as ONE software pipeline over (item, K
  step), so the next item's loads are in flight during the current item's epilogue; optionally a
  TMA producer warpgroup feeds two consumer warpgroups (128 x 256 tiles) and items are ordered in
  bands of row tiles for L2 reuse (:class:`Tiles`, chosen by :func:`default_tiles`). The CPU
  interpreter cannot reset a WGMMA accumulator, so interpret mode (and ``persistent=False``) runs
  one pipeline per item instead (same tiles and item order, same results). Valid rows are stored
  with a binary ladder of static-size TMA stores.
* :func:`tgmm`: ``out [E, K, N] = lhs_g^T [K, rows_g] @ dout_g [rows_g, N]`` (the ``d_rhs``
  product): one item per (group, K tile, N tile) with a pipeline over the group's 64-row blocks;
  the first and last block of a group are masked in shared memory; empty groups store zeros.

Why our own kernels rather than ``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` as shipped:
the shipped forward kernel runs a full contraction for every tile in its grid, also the up to
``E - 1`` tiles that own no rows (20% extra work at 64 groups of 512 rows), restarts its pipeline
for every tile, never writes rows past ``sum(group_sizes)`` and fixes 132 SMs; the shipped
transposed kernel reads the SM count from the device (which fails under the CPU interpreter). The
kernels here keep the same building blocks (``plgpu.emit_pipeline``, ``plgpu.wgmma``, TMA) and fix
those points (the 8-row-aligned tile table and the persistent pipeline follow the ideas of jla's
Mosaic GPU ragged_dot, written anew). Mosaic GPU rather than Triton: WGMMA and TMA are what reach
500+ TFLOP/s on Hopper, and Mosaic GPU kernels run in JAX's GPU interpreter on CPU for the tests.
Under a CPU backend they run in that interpreter on a few simulated SMs.

Timings against XLA and jla: benchmarks/RESULTS.md, "MoE"; ``python benchmarks/moe.py --sweep``
times the tilings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import default_backend, gpu_interpret, num_sms
from pallas_kernels.wgmma import SMEM_BYTES

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ROW_ALIGN = 8  # a row tile starts at a multiple of this (TMA tiles rows by 8)
MIN_ROWS = 128  # M of :func:`gmm`: at least the largest block_m
INTERPRET_SMS = 3  # simulated SMs in interpret mode (exercises several items per SM)


def _interpret():
  return gpu_interpret() if default_backend() == "cpu" else None


def _num_sms() -> int:
  if default_backend() == "cpu":
    return INTERPRET_SMS
  return num_sms()


def block_n_for(n: int) -> int:
  """Output columns of a tile: 128 where it divides ``n``, else 64."""
  return 128 if n % 128 == 0 else 64


def check(lhs, rhs):
  """Raises ValueError unless the kernels take these operands (dtype, K and N); shapes are checked
  by :func:`pallas_kernels.moe.pallas.check`."""
  if jnp.dtype(lhs.dtype) not in DTYPES or lhs.dtype != rhs.dtype:
    raise ValueError(f"moe.gmm pallas_gpu: needs bfloat16 or float16 lhs and rhs of one dtype, got "
                     f"{lhs.dtype} and {rhs.dtype}")
  k, n = rhs.shape[1:]
  if k % 64 or n % 64:
    raise ValueError(f"moe.gmm pallas_gpu: K={k} and N={n} must be multiples of 64")


class Tiles(NamedTuple):
  """Tiling of :func:`gmm`: ``block_m x (consumers * block_n)`` output tiles, each consumer
  warpgroup accumulating ``block_m x block_n`` in float32 registers over ``block_k``-wide
  contraction steps, ``steps`` of them in flight. ``consumers=2``: a TMA producer warpgroup feeds
  two consumer warpgroups (warp specialisation; GPU only, the per-item form runs them as one).
  ``band``: work items (row tile, column tile) are ordered in bands of ``band`` row tiles,
  column-major inside a band, so the items in flight together share rows and weight columns in L2
  (1: row-major)."""
  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  steps: int = 5
  band: int = 1
  consumers: int = 1

  @property
  def tile_n(self) -> int:
    return self.block_n * self.consumers

  def smem_bytes(self, itemsize: int = 2) -> int:
    stage = self.block_m * self.block_k + self.block_k * self.tile_n
    return (self.steps * stage + self.block_m * self.tile_n) * itemsize

  def check(self, k: int, n: int):
    """Raises ValueError unless this tiling runs a product of contraction ``k`` and width ``n``."""
    if (self.block_m not in (64, 128) or self.block_n % 64 or self.block_k not in (32, 64, 128)
        or self.block_m * self.block_n > 128 * 128 or self.steps < 2 or self.band < 1
        or self.consumers not in (1, 2)):
      raise ValueError(f"moe gpu.gmm: unsupported tiling {self}")
    if k % self.block_k or n % self.tile_n:
      raise ValueError(f"moe gpu.gmm: tiling {self} does not divide K={k}, N={n}")
    if self.smem_bytes() > SMEM_BYTES:
      raise ValueError(f"moe gpu.gmm: tiling {self} needs {self.smem_bytes()} bytes of shared "
                       f"memory, more than {SMEM_BYTES}")


@dataclasses.dataclass(frozen=True)
class TgmmTiles:
  """Tiling of :func:`tgmm`: ``rows`` rows of a group per pipeline step, ``steps`` steps in
  flight (the output tile is :func:`block_n_for` of K by that of N)."""
  rows: int = 64
  steps: int = 4


def default_tiles(m: int, e: int, k: int, n: int) -> Tiles:
  """The tiling of :func:`gmm` for ``M`` rows in ``E`` groups, contraction ``k`` and width ``n``
  (one heuristic for every shape): 128x128 tiles (64 columns where 128 does not divide ``n``; 64
  rows when the mean group has fewer than 128 rows, so small groups do not run mostly-empty
  tiles), 64-wide contraction steps, as many pipeline stages as fit up to 5."""
  del k
  block_m = 64 if m < 128 * e else 128
  tiles = Tiles(block_m=block_m, block_n=block_n_for(n))
  while tiles.smem_bytes() > SMEM_BYTES:
    tiles = tiles._replace(steps=tiles.steps - 1)
  return tiles


def row_tiles(group_sizes, m: int, block_m: int):
  """Row-tile table ``[5, T]`` int32 (group, first row, offset of the first valid row, valid rows,
  1 for the zero pseudo-group) and ``[1]`` int32 the number of tiles in use (a prefix of T).

  Each group's tiles start at its first row rounded down to 8 (TMA row tiling), so a group of
  ``s`` rows costs ``ceil((s + 7) / block_m)`` tiles, empty groups none; rows past
  ``sum(group_sizes)`` form one more pseudo-group whose tiles store zeros. Prefix sums and the
  tile -> group search are compare-and-sum reductions ([E+1, E+1] and [T, E+1]): a few fused XLA
  kernels, no scan or while loop before the grouped matmul."""
  e = group_sizes.shape[0]
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  g = jnp.arange(e + 1, dtype=jnp.int32)
  before = jnp.sum(jnp.where(g[None, :e] < g[:, None], sizes[None, :], 0), axis=1)
  starts = jnp.minimum(before, m)  # [E + 1]; the pseudo-group E starts at sum(group_sizes)
  ends = jnp.concatenate([starts[1:], jnp.full((1,), m, jnp.int32)])
  first = starts // ROW_ALIGN * ROW_ALIGN
  tiles = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
  tile_end = jnp.sum(jnp.where(g[None, :] <= g[:, None], tiles[None, :], 0), axis=1)
  capacity = pl.cdiv(m + (ROW_ALIGN - 1) * (e + 1), block_m) + e + 1
  t = jnp.arange(capacity, dtype=jnp.int32)
  grp = jnp.minimum(jnp.sum((tile_end[None, :] <= t[:, None]).astype(jnp.int32), axis=1), e)
  r0 = first[grp] + (t - (tile_end[grp] - tiles[grp])) * block_m
  lo = jnp.maximum(r0, starts[grp])
  size = jnp.maximum(jnp.minimum(r0 + block_m, ends[grp]) - lo, 0)
  table = jnp.stack([jnp.minimum(grp, e - 1), r0, lo - r0, size, (grp == e).astype(jnp.int32)])
  return table.astype(jnp.int32), tile_end[-1:].astype(jnp.int32)


def _item(w, used, grid_n: int, band: int):
  """(row tile, column tile) of work item ``w`` < ``used * grid_n`` (``used`` row tiles)."""
  if band == 1:
    return lax.div(w, jnp.int32(grid_n)), lax.rem(w, jnp.int32(grid_n))
  b = lax.div(w, jnp.int32(band * grid_n))
  r = lax.rem(w, jnp.int32(band * grid_n))
  rows = jnp.minimum(jnp.int32(band), used - b * band)  # the last band may be shorter
  return b * band + lax.rem(r, rows), lax.div(r, rows)


def _store_rows(o_smem, o_gmem, *, row0, start, size, max_rows: int, columns):
  """TMA-stores rows ``[start, start + size)`` of ``o_smem`` to ``o_gmem[row0 + ...]``: boxes have
  static shapes, so the dynamic count is written as a sum of powers of two."""
  offset = start
  rows = 1 << (max_rows.bit_length() - 1)
  while rows >= 1:
    @pl.when(size & rows != 0)
    def _():
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, rows)],
                              o_gmem.at[pl.ds(row0 + offset, rows), columns])
    offset = offset + (size & rows)
    rows //= 2


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "config", "persistent"))
def gmm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, config: Tiles | None = None,
        persistent=None):
  """``lhs [M, K]`` x ``rhs [E, K, N]`` (``[E, N, K]`` with ``transpose_rhs``) -> ``[M, N]`` in
  lhs.dtype; rows past ``sum(group_sizes)`` are zero. ``M`` a multiple of 8, at least
  ``MIN_ROWS``. ``config``: default :func:`default_tiles`; ``persistent``: see
  :func:`gmm_tiled`."""
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  config = config or default_tiles(m, rhs.shape[0], k, n)
  table, count = row_tiles(group_sizes, m, config.block_m)
  return gmm_tiled(lhs, rhs, table, count, transpose_rhs=transpose_rhs, config=config,
                   persistent=persistent)


def gmm_tiled(lhs, rhs, table, count, *, transpose_rhs: bool, config: Tiles, persistent=None):
  """:func:`gmm` on a row-tile table from :func:`row_tiles` (built with ``config.block_m``).

  ``persistent`` (default: on a GPU, not in interpret mode): each SM runs its share of the
  (row tile, column tile) items as ONE software pipeline over (item, K step), the accumulator
  reset at each item's first step, so the next item's loads are in flight during the current
  item's epilogue. Otherwise one pipeline per item with one consumer warpgroup: the interpreter has
  no rule for writing a WGMMA accumulator, so CPU tests cover that form (same tiles and item order,
  same results) and the persistent one is checked on the GPU by ``benchmarks/moe.py``."""
  if persistent is None:
    persistent = default_backend() != "cpu"
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  config.check(k, n)
  if persistent:
    return _gmm_persistent(lhs, rhs, table, count, transpose_rhs=transpose_rhs, config=config)
  block_m, block_n, block_k, steps, band, consumers = config
  block_n *= consumers
  grid_n, k_steps = n // block_n, k // block_k
  capacity = table.shape[1]

  def body(table_ref, count_ref, lhs_ref, rhs_ref, out_ref):
    @plgpu.nd_loop((capacity * grid_n,), collective_axes="sm")
    def _item_loop(loop_info: plgpu.NDLoopInfo):
      w = loop_info.index[0]
      used = count_ref[0]

      @pl.when(w < used * grid_n)
      def _():
        mi, ni = _item(w, used, grid_n, band)
        group, row0, start, size, zero = (table_ref[j, mi] for j in range(5))
        row0 = pl.multiple_of(row0, ROW_ALIGN)

        def acc_scope(acc_ref):
          @pl.when(zero == 0)  # the pseudo-group past sum(group_sizes) keeps the zero accumulator
          def _():
            rhs_block = (block_n, block_k) if transpose_rhs else (block_k, block_n)
            plgpu.emit_pipeline(
                lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                    acc_ref, lhs_smem, rhs_smem.T if transpose_rhs else rhs_smem),
                grid=(k_steps,),
                in_specs=[
                    plgpu.BlockSpec((pl.Element(block_m), block_k), lambda kk: (row0, kk),
                                    delay_release=1),
                    plgpu.BlockSpec(rhs_block, (lambda kk: (ni, kk)) if transpose_rhs else
                                    (lambda kk: (kk, ni)), delay_release=1),
                ],
                max_concurrent_steps=steps,
            )(lhs_ref, rhs_ref.at[group])

          return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), out_ref.dtype))
        def _store(o_smem):
          o_smem[...] = acc.astype(o_smem.dtype)
          plgpu.commit_smem()
          _store_rows(o_smem, out_ref, row0=row0, start=start, size=size, max_rows=block_m,
                      columns=pl.ds(ni * block_n, block_n))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
      grid=(_num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret(),
  )
  return kernel(table, count, lhs, rhs)


def _gmm_persistent(lhs, rhs, table, count, *, transpose_rhs: bool, config: Tiles):
  """:func:`gmm_tiled` with one software pipeline per SM over (its items, K steps); with two
  consumers a producer warpgroup runs the loads and each consumer one half of the tile columns."""
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  block_m, block_n, block_k, steps, band, consumers = config
  tile_n = config.tile_n
  grid_n, k_steps = n // tile_n, k // block_k
  sms = _num_sms()
  itemsize = jnp.dtype(lhs.dtype).itemsize
  swizzle = plgpu.find_swizzle(block_k * itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

  def body(table_ref, count_ref, lhs_ref, rhs_ref, out_ref):
    sm = lax.axis_index("sm")
    used = count_ref[0]
    mine = lax.div(jnp.maximum(used * grid_n - sm, 0) + (sms - 1), jnp.int32(sms))
    wg = lax.axis_index("wg") if consumers > 1 else 0

    def coords(i):  # this SM's items: sm, sm + sms, ...
      return _item(sm + i * sms, used, grid_n, band)

    def lhs_index(i, kk):
      return pl.multiple_of(table_ref[1, coords(i)[0]], ROW_ALIGN), kk

    def rhs_index(i, kk):
      mi, ni = coords(i)
      return (table_ref[0, mi], ni, kk) if transpose_rhs else (table_ref[0, mi], kk, ni)

    extra = dict(transforms=transforms, memory_space=plgpu.SMEM) if consumers > 1 else {}
    in_specs = [
        plgpu.BlockSpec((pl.Element(block_m), block_k), lhs_index, delay_release=1, **extra),
        plgpu.BlockSpec((None, tile_n, block_k) if transpose_rhs else (None, block_k, tile_n),
                        rhs_index, delay_release=1, **extra),
    ]

    def mma(idx, lhs_smem, rhs_smem, acc_ref, o_smem):
      """One K step of item ``idx[0]``; at the item's last step, its epilogue."""
      i, kk = idx

      @pl.when(kk == 0)
      def _():
        acc_ref[...] = jnp.zeros((block_m, block_n), jnp.float32)

      if consumers > 1:
        cols = pl.ds(wg * block_n, block_n)
        plgpu.wgmma(acc_ref, lhs_smem, rhs_smem.at[cols].T if transpose_rhs else rhs_smem.at[:, cols])
        plgpu.wgmma_wait(1)
      else:
        plgpu.wgmma(acc_ref, lhs_smem, rhs_smem.T if transpose_rhs else rhs_smem)

      @pl.when(kk == k_steps - 1)
      def _():
        mi, ni = coords(i)
        acc = acc_ref[...] * (table_ref[4, mi] == 0).astype(jnp.float32)  # zero pseudo-group
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's stores read o_smem
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        _store_rows(o_smem, out_ref, row0=pl.multiple_of(table_ref[1, mi], ROW_ALIGN),
                    start=table_ref[2, mi], size=table_ref[3, mi], max_rows=block_m,
                    columns=pl.ds(ni * tile_n + wg * block_n, block_n))

    if consumers == 1:
      def scope(acc_ref, o_smem):
        @pl.when(mine > 0)
        def _():
          plgpu.emit_pipeline(
              lambda idx, lhs_smem, rhs_smem: mma(idx, lhs_smem, rhs_smem, acc_ref, o_smem),
              grid=(mine, k_steps), in_specs=in_specs, max_concurrent_steps=steps,
          )(lhs_ref, rhs_ref)

        plgpu.wait_smem_to_gmem(0)

      pl.run_scoped(scope, plgpu.ACC((block_m, block_n)),
                    plgpu.SMEM((block_m, block_n), out_ref.dtype))
      return

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((consumers, block_m, block_n), out_ref.dtype),
                       collective_axes="wg")
    def _scope(o_smem):
      def compute_context(run):
        pl.run_scoped(run, plgpu.ACC((block_m, block_n)))

      def step(idx, lhs_smem, rhs_smem, acc_ref):
        mma(idx, lhs_smem, rhs_smem, acc_ref, o_smem.at[wg])
        return acc_ref

      pipeline = plgpu.emit_pipeline_warp_specialized(
          step, grid=(mine, k_steps), memory_registers=40, in_specs=in_specs, wg_axis="wg",
          num_compute_wgs=consumers, max_concurrent_steps=steps, compute_context=compute_context)

      @pl.when(mine > 0)
      def _():
        pipeline(lhs_ref, rhs_ref)

      plgpu.wait_smem_to_gmem(0)

  threads = dict(num_threads=consumers + 1, thread_name="wg") if consumers > 1 else {}
  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
      grid=(sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      **threads,
  )
  return kernel(table, count, lhs, rhs)


@functools.partial(jax.jit, static_argnames=("config",))
def tgmm(lhs, dout, group_sizes, *, config: TgmmTiles = TgmmTiles()):
  """``lhs [R, K]``, ``dout [R, N]`` (rows sorted by group) -> ``[E, K, N]`` in lhs.dtype with
  ``out[g] = lhs[rows_g]^T @ dout[rows_g]``; rows past ``sum(group_sizes)`` are ignored, empty
  groups give zeros. ``R`` a multiple of 8; K, N multiples of 64."""
  r, k = lhs.shape
  n = dout.shape[1]
  e = group_sizes.shape[0]
  rows = config.rows
  tile_k, tile_n = block_n_for(k), block_n_for(n)
  grid_k, grid_n = k // tile_k, n // tile_n
  sms = _num_sms()
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), r)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  first = starts // rows
  blocks = jnp.where(ends > starts, (ends + rows - 1) // rows - first, 0)
  table = jnp.stack([starts, ends, first, blocks]).astype(jnp.int32)
  swizzle = plgpu.find_swizzle(rows * jnp.dtype(lhs.dtype).itemsize * 8)
  transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(lhs.dtype).itemsize)),
                plgpu.SwizzleTransform(swizzle))

  def body(table_ref, lhs_ref, dout_ref, out_ref):
    @plgpu.nd_loop((e * grid_k * grid_n,), collective_axes="sm")
    def _item(loop_info: plgpu.NDLoopInfo):
      w = loop_info.index[0]
      g = lax.div(w, jnp.int32(grid_k * grid_n))
      rest = lax.rem(w, jnp.int32(grid_k * grid_n))
      ki, ni = lax.div(rest, jnp.int32(grid_n)), lax.rem(rest, jnp.int32(grid_n))
      start, end, first_block, num_blocks = (table_ref[j, g] for j in range(4))

      def acc_scope(acc_ref):
        def step(idx, lhs_smem, dout_smem):
          j = idx[0]

          @pl.when((j == 0) | (j == num_blocks - 1))
          def _():  # rows of the neighbouring groups in the group's first and last block
            row = (first_block + j) * rows + plgpu.layout_cast(
                lax.broadcasted_iota(jnp.int32, (rows, tile_k), 0), plgpu.Layout.WGMMA)
            valid = (row >= start) & (row < end)
            lhs_smem[...] = jnp.where(valid, lhs_smem[...], jnp.zeros((), lhs_smem.dtype))
            plgpu.commit_smem()

          plgpu.wgmma(acc_ref, lhs_smem.T, dout_smem)

        @pl.when(num_blocks > 0)
        def _():
          plgpu.emit_pipeline(
              step,
              grid=(num_blocks,),
              in_specs=[
                  plgpu.BlockSpec((rows, tile_k), lambda j: (first_block + j, ki), delay_release=1,
                                  transforms=transforms),
                  plgpu.BlockSpec((rows, tile_n), lambda j: (first_block + j, ni), delay_release=1,
                                  transforms=transforms),
              ],
              max_concurrent_steps=config.steps,
          )(lhs_ref, dout_ref)

        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((tile_k, tile_n)))

      @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_k, tile_n), out_ref.dtype,
                                                          transforms=transforms))
      def _store(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem, out_ref.at[g, pl.ds(ki * tile_k, tile_k), pl.ds(ni * tile_n, tile_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((e, k, n), lhs.dtype),
      grid=(sms,),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret(),
  )
  return kernel(table, lhs, dout)
