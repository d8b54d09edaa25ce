"""Pallas grouped matmul with its VJP, on the GPU (Mosaic GPU, :mod:`.gpu`) or TPU (megablox,
:mod:`.tpu`) kernels.

``out = gmm(lhs [M, K], rhs [E, K, N], group_sizes [E])`` with rows of lhs sorted by group; rows
past ``sum(group_sizes)`` give zeros. Backward: ``d_lhs = gmm(d_out, rhs^T)`` (the same kernel
reading ``rhs`` transposed in place) and ``d_rhs[g] = lhs_g^T @ d_out_g`` (``tgmm``). Both kernels
accumulate in float32; the GPU kernels take bfloat16/float16 operands of one dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import kernel_output
from pallas_kernels.moe import gpu, tpu

BACKENDS = ("gpu", "tpu")


def _mask_rows(x, group_sizes):
  valid = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes.astype(jnp.int32))
  return jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))


def _product(lhs, rhs, group_sizes, backend, out_dtype, transpose_rhs):
  if backend == "gpu":  # rows past the groups are written as zeros in the kernel
    return gpu.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs).astype(out_dtype)
  out = tpu.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype)
  return _mask_rows(out, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs, rhs, group_sizes, backend, out_dtype):
  return _product(lhs, rhs, group_sizes, backend, out_dtype, False)


def _gmm_fwd(lhs, rhs, group_sizes, backend, out_dtype):
  return _gmm(lhs, rhs, group_sizes, backend, out_dtype), (lhs, rhs, group_sizes)


def _gmm_bwd(backend, out_dtype, residuals, d_out):
  lhs, rhs, group_sizes = residuals
  d_out = d_out.astype(lhs.dtype)
  d_lhs = _product(d_out, rhs, group_sizes, backend, lhs.dtype, True)
  if backend == "gpu":
    d_rhs = gpu.tgmm(lhs, d_out, group_sizes)
  else:
    d_rhs = tpu.tgmm(lhs, d_out, group_sizes, out_dtype=jnp.float32)
  # Tied, so that the layer below cannot start its backward before d_rhs exists: otherwise XLA
  # schedules the tgmm late (its result only feeds the optimizer) and keeps this layer's
  # [M, K] and [M, N] operands live into the backward of the layers below, one more pair per
  # layer (K3 at 1M: 6 MoE layers' operands at once, 55 GiB).
  d_lhs, d_rhs = jax.lax.optimization_barrier((d_lhs, d_rhs))
  return d_lhs, d_rhs.astype(rhs.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def check(lhs, rhs, group_sizes, backend):
  """Raises ValueError naming the problem unless ``backend``'s kernels take these operands."""
  if backend not in BACKENDS:
    raise ValueError(f"moe.gmm: unknown Pallas backend {backend!r}; expected one of {BACKENDS}")
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(f"moe.gmm: expected lhs [M, K], rhs [E, K, N], group_sizes [E]; got "
                     f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
  if lhs.shape[1] != rhs.shape[1] or group_sizes.shape[0] != rhs.shape[0]:
    raise ValueError(f"moe.gmm: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                     f"{group_sizes.shape} disagree on K or E")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"moe.gmm: group_sizes must be integers, got {group_sizes.dtype}")
  if backend == "gpu":
    gpu.check(lhs, rhs)


def supported(lhs, rhs, group_sizes, backend) -> bool:
  try:
    check(lhs, rhs, group_sizes, backend)
  except ValueError:
    return False
  return True


def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None, backend="gpu"):
  """Differentiable Pallas grouped matmul (see the module docstring); returns ``[M, N]`` in
  ``preferred_element_type`` (default lhs.dtype)."""
  check(lhs, rhs, group_sizes, backend)
  out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
  m = lhs.shape[0]
  rows = max(-(-m // 8) * 8, gpu.MIN_ROWS) if backend == "gpu" else -(-m // tpu.ROW_MULTIPLE) * tpu.ROW_MULTIPLE
  if rows != m:  # padded rows belong to no group
    lhs = jnp.pad(lhs, ((0, rows - m), (0, 0)))
  out = kernel_output(_gmm(lhs, rhs, group_sizes.astype(jnp.int32), backend, out_dtype))
  return out[:m] if rows != m else out
