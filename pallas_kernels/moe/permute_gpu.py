"""The token permutation's Triton kernels through Pallas (interpret mode off GPU): the expansion
``x [N, D] -> xs [N*k, D]`` into expert order (a row gather) and the backward of
:func:`pallas_kernels.moe.reference.unpermute`. The expansion's backward and the unpermute's
forward stay XLA's (a gather-and-sum fusion each, near bandwidth).

Expansion: one program per ``rows`` sorted rows and ``block_d`` columns loads the rows' pairs
``order[r] = n*k + j``, gathers the token rows ``x[n]`` and stores its tile of xs contiguously.

Unpermute backward: for ``out[n] = sum_j weights[n, j] * y[inverse[n*k + j]]`` and the cotangent
``g [N, D]``, the sorted row r of pair ``order[r] = n*k + j`` gets ``dy[r] = weights[n, j] *
g[n]`` and ``dweights[n, j] = y[r] . g[n]`` (float32). One program takes ``rows`` sorted rows and
a ``block_d`` column tile: it loads their ``order``, gathers the rows of g and the routing
weights, stores its tile of dy contiguously and scatters the row dot products to their pairs,
``order[r]`` (a permutation, so a plain store). With D split into several tiles each tile writes
its partial dot products to its own row of a float32 ``[D tiles, pairs]`` buffer, summed
outside. Rows past ``N*k`` in the last block write their (zero) partials past the pairs, at their
own row index, so every store lands on a distinct element without a mask; the tail is sliced off.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend
from pallas_kernels.moe import reference

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The expansion's pallas_call name: the training step's remat policy recomputes this kernel's
# output rather than keep it (a cheap gather whose output is as large as the expert inputs).
EXPAND_KERNEL = "expand_gather"


@dataclasses.dataclass(frozen=True)
class Config:
  """``rows`` sorted rows x ``block_d`` columns per program (``block_d`` capped at D rounded up to
  a power of two: one tile over the whole row for D <= block_d), ``warps`` warps, ``stages``
  software-pipelining stages. Tiles are powers of two. The defaults are the unpermute backward's
  best of ``benchmarks/moe_permute.py``'s sweep on an H200 (the sweep's tilings lie close
  together); :data:`EXPAND_CONFIG` is the expansion's."""
  rows: int = 16
  block_d: int = 512
  warps: int = 4
  stages: int = 1

  def __post_init__(self):
    if any(v < 1 or v & (v - 1) for v in (self.rows, self.block_d)):
      raise ValueError(f"permute_gpu.Config: rows {self.rows} and block_d {self.block_d} must be "
                       "powers of two")


def _interpret() -> bool:
  return default_backend() != "gpu"


def _check_dtypes(op: str, **arrays):
  """The kernels take float32/bfloat16/float16 (float32 accumulation: no float64)."""
  bad = {name: str(a.dtype) for name, a in arrays.items() if a.dtype not in DTYPES}
  if bad:
    raise ValueError(f"{op}: the pallas_gpu kernels take float32/bfloat16/float16, got {bad}")


def _tile(order_ref, *, m, d, k, br, bd):
  """The program's tile of sorted rows and columns: (its ``(rows, columns)`` slices, the store
  mask ``[br, bd]`` (rows past ``m``, columns past ``d``), the rows' pairs ``order[r]`` ``[br]``
  (0 past the rows), and ``gather(ref)``: the load of ``ref[pair // k, columns]``,
  the token row of each sorted row)."""
  i, c = pl.program_id(0), pl.program_id(1)
  rows = i * br + jnp.arange(br, dtype=jnp.int32)
  cols = c * bd + jnp.arange(bd, dtype=jnp.int32)
  row_ok = rows < m
  col_ok = None if d % bd == 0 else (cols < d)[None, :]
  mask = row_ok[:, None] if col_ok is None else row_ok[:, None] & col_ok
  pair = plgpu.load(order_ref.at[pl.ds(i * br, br)], mask=row_ok, other=0)
  gather = lambda ref: plgpu.load(ref.at[(pair // k)[:, None], cols[None, :]],
                                  **({} if col_ok is None else {"mask": col_ok, "other": 0}))
  return (pl.ds(i * br, br), pl.ds(c * bd, bd)), mask, pair, gather


def _bwd_kernel(y_ref, order_ref, w_ref, g_ref, dy_ref, dw_ref, *, m, d, k, br, bd):
  at, mask, pair, gather = _tile(order_ref, m=m, d=d, k=k, br=br, bd=bd)
  wt = plgpu.load(w_ref.at[pair]).astype(jnp.float32)  # weights[n, j]
  g = gather(g_ref).astype(jnp.float32)
  y = plgpu.load(y_ref.at[at], mask=mask, other=0)
  plgpu.store(dy_ref.at[at], (g * wt[:, None]).astype(dy_ref.dtype), mask=mask)
  dot = jnp.sum(y.astype(jnp.float32) * g, axis=1)  # [br]; 0 on rows past m (y masked)
  rows = pl.program_id(0) * br + jnp.arange(br, dtype=jnp.int32)
  plgpu.store(dw_ref.at[pl.program_id(1), jnp.where(rows < m, pair, rows)], dot)


def _expand_kernel(x_ref, order_ref, out_ref, *, m, d, k, br, bd):
  at, mask, _, gather = _tile(order_ref, m=m, d=d, k=k, br=br, bd=bd)
  plgpu.store(out_ref.at[at], gather(x_ref), mask=mask)


def _expand_call(x, order, k, config):
  """``x[order // k]``: ``[N*k, D]`` in x's dtype."""
  m, d = order.shape[0], x.shape[1]
  br, bd = config.rows, min(config.block_d, pl.next_power_of_2(d))
  kern = functools.partial(_expand_kernel, m=m, d=d, k=k, br=br, bd=bd)
  return pl.pallas_call(
      kern, grid=(pl.cdiv(m, br), pl.cdiv(d, bd)),
      out_shape=jax.ShapeDtypeStruct((m, d), x.dtype), interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=config.stages),
      name=EXPAND_KERNEL)(x, order.astype(jnp.int32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _expand(config, x, order, inverse, k):
  return _expand_call(x, order, k, config)


def _expand_fwd(config, x, order, inverse, k):
  # The kernel itself, not ``_expand`` (a nested custom_vjp call): a remat policy sees its name.
  return _expand_call(x, order, k, config), inverse


def _expand_bwd(config, k, inverse, g):
  return reference.expand_grad(g, inverse, k), None, None


_expand.defvjp(_expand_fwd, _expand_bwd)


# The expansion's default tiling, the fastest of ``benchmarks/moe_permute.py``'s sweep on an H200.
EXPAND_CONFIG = Config(rows=64, block_d=128)


def expand(x, order, inverse, k: int, config: Config = EXPAND_CONFIG):
  """Tokens ``x [N, D]`` in expert order: row r of the result is token ``order[r] // k``
  (``order``, ``inverse`` from :func:`pallas_kernels.moe.reference.sort_pairs`). Returns
  ``[N*k, D]``; differentiable in x (its cotangent is XLA's gather-and-sum)."""
  if x.ndim != 2 or order.shape != (x.shape[0] * k,) or inverse.shape != order.shape:
    raise ValueError(f"expand: x {x.shape} must be [N, D] and order {order.shape}, inverse "
                     f"{inverse.shape} [N*k] with k = {k}")
  _check_dtypes("expand", x=x)
  return _expand(config, x, order, inverse, k)


def backward(y, order, weights, g, config: Config = Config()):
  """(dy ``[N*k, D]`` in y's dtype, dweights ``[N, k]`` in weights' dtype) for the cotangent
  ``g [N, D]`` of :func:`unpermute`'s output."""
  n, k = weights.shape
  m, d = y.shape
  br = config.rows
  bd = min(config.block_d, pl.next_power_of_2(d))
  nr, nd = pl.cdiv(m, br), pl.cdiv(d, bd)
  kern = functools.partial(_bwd_kernel, m=m, d=d, k=k, br=br, bd=bd)
  dy, dw = pl.pallas_call(
      kern, grid=(nr, nd),
      out_shape=(jax.ShapeDtypeStruct((m, d), y.dtype),
                 jax.ShapeDtypeStruct((nd, nr * br), jnp.float32)),
      interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=config.stages),
      name="unpermute_bwd")(y, order.astype(jnp.int32), weights.reshape(m), g.astype(y.dtype))
  dw = (dw[0] if nd == 1 else jnp.sum(dw, axis=0))[:m]
  return dy, dw.reshape(n, k).astype(weights.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpermute(config, y, order, weights):
  return reference.unpermute(y, order, weights)


def _unpermute_fwd(config, y, order, weights):
  return reference.unpermute(y, order, weights), (y, order, weights)


def _unpermute_bwd(config, res, g):
  y, order, weights = res
  dy, dw = backward(y, order, weights, g, config)
  return dy, None, dw


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute(y, order, weights, config: Config = Config()):
  """:func:`pallas_kernels.moe.reference.unpermute` (same forward) with the one-kernel backward.

  y: ``[N*k, D]`` rows sorted by expert; order: ``[N*k]`` int (the pair ``n*k + j`` of each sorted
  row, a permutation); weights: ``[N, k]``. Returns ``[N, D]`` in y's dtype."""
  if y.ndim != 2 or weights.ndim != 2 or order.shape != (y.shape[0],) \
      or y.shape[0] != weights.shape[0] * weights.shape[1]:
    raise ValueError(f"unpermute: y {y.shape} must be [N*k, D], order {order.shape} [N*k] and "
                     f"weights {weights.shape} [N, k]")
  _check_dtypes("unpermute", y=y, weights=weights)
  return _unpermute(config, y, order, weights)
