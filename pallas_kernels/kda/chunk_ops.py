"""What the chunk-local kernels of both paths share: products with float32 accumulation, the
inverse of a unit lower-triangular chunk matrix, and the launch of one chunk kernel."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.config import BF16, X3, KdaOptions, compiler_params, interpret, stages

HI = jax.lax.Precision.HIGHEST


# Inside gpu_rounding(), products round their operands as the GPU's matrix units do (interpret
# mode on the CPU otherwise computes them in exact float32). Part of JAX's jit cache key.
_GPU_ROUNDING = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def gpu_rounding():
  """Emulates the GPU's matrix-unit roundings in the chunk kernels' products (CPU checks of the
  kernels' accuracy, ``benchmarks/kda.py --emulate``): TF32 for float32 operands, bf16 or three
  bf16 passes for those algorithms."""
  with _GPU_ROUNDING(True):
    yield


def round_mantissa(x, bits: int):
  """float32 ``x`` rounded to ``bits`` mantissa bits (to nearest)."""
  i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  drop = 23 - bits
  i = (i + (1 << (drop - 1))) & ~jnp.uint32((1 << drop) - 1)
  return jax.lax.bitcast_convert_type(i, jnp.float32)


def _exact(a, b, ta, tb, precision):
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def _rounded(a, b, ta, tb, precision):
  """The product as the GPU's matrix units round it, in exact float32 arithmetic."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  f = lambda x, y: _exact(x, y, ta, tb, HI)
  bf16 = lambda x: round_mantissa(x, 7)
  if precision == X3:
    ah, bh = bf16(a), bf16(b)
    return f(ah, bh) + f(bf16(a - ah), bh) + f(ah, bf16(b - bh))
  if precision == BF16:
    return f(bf16(a), bf16(b))
  return f(a, b) if precision == HI else f(round_mantissa(a, 10), round_mantissa(b, 10))


def mm(a, b, *, ta=False, tb=False, dt=None, precision=None):
  """``a @ b`` (optionally transposed operands) with float32 accumulation; ``dt`` casts the
  operands (bf16 for the matrix units)."""
  if dt is not None:
    a, b = a.astype(dt), b.astype(dt)
  return (_rounded if _GPU_ROUNDING.value else _exact)(a, b, ta, tb, precision)


def lower_inverse(a, c, precision=None):
  """``(I + a)^-1`` for a strictly lower [C, C] ``a`` by doubling its diagonal blocks: with X the
  inverse of the block diagonal of 1-row blocks (I), each level merges pairs of n-row blocks,
  ``[[P, 0], [L, Q]]^-1 = [[P^-1, 0], [-Q^-1 L P^-1, Q^-1]]``, for all pairs at once as
  ``X <- X - X (L X)`` with L the lower-left blocks of the pairs. Every intermediate is a block of
  the inverse, so the rounding errors stay at the size of the inverse's entries (a series in
  powers of ``a`` loses every digit for similar keys: benchmarks/RESULTS.md, KDA runs 30-33).
  Float32 products at ``precision`` (by default TF32 on the GPU's matrix units): 2 log2(C) - 2 of
  them (ten at C = 64)."""
  ii, jj = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
  x = (ii == jj).astype(jnp.float32) - jnp.where((ii == jj + 1) & (ii % 2 == 1), a, 0.0)
  n = 2
  while n < c:
    rb, cb = ii // n, jj // n
    low = jnp.where((rb == cb + 1) & (rb % 2 == 1), a, 0.0)
    x = x - mm(x, mm(low, x, precision=precision), precision=precision)
    n *= 2
  return x


def call(opts: KdaOptions, kern, name, grid, out_shape, *args, chunk_axis=None, aliases=None):
  """One chunk kernel, at ``opts.tuning``'s warps for ``name``. With ``chunk_axis`` (the grid
  axis of the chunks) the kernel takes ``pid``, its grid indices with the chunk's at
  ``chunk_axis``, and walks the tuning's ``chunk_loop`` chunks per program (the program ids are
  read outside the loop, as interpret mode needs). ``aliases``: inputs (by index) that are
  outputs (by index), updated in place."""
  per, want = opts.tuning.chunk_loop_of(name)
  if chunk_axis is not None:
    nc = grid[chunk_axis]
    per = math.gcd(per, nc)
    # what one chunk's program reads of each chunk-indexed input ([B, Tp, ...] / [B, NC, ...])
    want = stages(want, sum(x.dtype.itemsize * (x.shape[1] // nc) * math.prod(x.shape[3:])
                            for x in args if x.ndim >= 3 and x.shape[1] % nc == 0))
    grid = grid[:chunk_axis] + (nc // per,) + grid[chunk_axis + 1:]
    one = kern

    def kern(*refs):
      ids = tuple(pl.program_id(i) for i in range(len(grid)))
      at = lambda ci: ids[:chunk_axis] + (ci,) + ids[chunk_axis + 1:]

      def step(j, carry):
        one(*refs, pid=at(ids[chunk_axis] * per + j))
        return carry

      if per == 1:
        one(*refs, pid=ids)
      else:
        jax.lax.fori_loop(0, per, step, 0)

  return pl.pallas_call(kern, grid=grid, out_shape=out_shape, interpret=interpret(),
                        compiler_params=compiler_params(opts.tuning.warps_of(name), want),
                        input_output_aliases=aliases or {}, name=name)(*args)


def tok(x, d, dtype):
  """[B, Tp, HV, d] of ``dtype`` shaped like the value-side input x [B, Tp, HV, *]."""
  return jax.ShapeDtypeStruct(x.shape[:3] + (d,), dtype)
