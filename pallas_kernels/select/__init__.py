"""The k-th smallest value of each column of a float32 matrix, exactly (exact Quantile Balancing's
per-expert quantile of the routing margins).

``implementation``: ``"xla"`` (a 4-bit radix select of fused XLA reductions,
:mod:`pallas_kernels.select.reference`, the reference), ``"pallas_gpu"`` (one Triton kernel
through Pallas, :mod:`pallas_kernels.select.gpu`; interpret mode on CPU), ``"pallas"``
(``pallas_gpu`` off TPU; on TPU there is no kernel and it means ``"xla"``) or ``None``
(``pallas_gpu`` on GPU, ``xla`` on CPU and TPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import resolve_gpu_kernel
from pallas_kernels.select import reference

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas")


def resolve(implementation: str | None) -> str:
  """The concrete implementation name for ``implementation`` on the current backend."""
  return resolve_gpu_kernel("select", implementation, IMPLEMENTATIONS)


def kth_smallest(x: jax.Array, k, *, implementation: str | None = None) -> jax.Array:
  """``jnp.sort(x, axis=0)[k]`` bit for bit, without a sort.

  x: ``[N, E]`` float32 without NaNs (+inf allowed; -0.0 counts as below +0.0); k: int or traced
  int32 scalar with ``0 <= k < N`` (not checked when traced). Returns ``[E]`` float32.
  """
  if x.ndim != 2 or x.shape[0] < 1 or x.dtype != jnp.float32:
    raise ValueError(f"kth_smallest: x {x.shape} {x.dtype} must be float32 [N, E] with N >= 1")
  if resolve(implementation) == "xla":
    return reference.kth_smallest(x, k)
  from pallas_kernels.select import gpu
  return gpu.kth_smallest(x, k)


__all__ = ["kth_smallest", "resolve", "IMPLEMENTATIONS"]
