"""Causal depthwise short convolution followed by SiLU (the KDA layer's q/k/v short convs).

``implementation``: ``"xla"`` (:mod:`pallas_kernels.conv.reference`, the reference),
``"pallas_gpu"`` (Triton kernels through Pallas, one pass forward and one pass backward,
:mod:`pallas_kernels.conv.gpu`; interpret mode on CPU), ``"pallas"`` (``pallas_gpu`` off TPU; on
TPU there is no kernel and it means ``"xla"``) or ``None`` (``pallas_gpu`` on GPU, ``xla`` on CPU
and TPU).
"""

from __future__ import annotations

import jax

from pallas_kernels import resolve_gpu_kernel
from pallas_kernels.conv import reference

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas")


def resolve(implementation: str | None) -> str:
  """The concrete implementation name for ``implementation`` on the current backend."""
  return resolve_gpu_kernel("conv", implementation, IMPLEMENTATIONS)


def causal_conv_silu(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None, *,
                     implementation: str | None = None) -> jax.Array:
  """``y[b, t] = silu(sum_j w[j] * x[b, t - (W-1-j)])`` computed in float32, in x.dtype.

  x: ``[B, T, C]`` (bf16 or f32); w: ``[W, C]`` (tap ``W-1`` multiplies the current token);
  segment_ids: ``[B, T]`` int or None: a tap reading position ``t-s`` contributes only when
  ``segment_ids[t-s] == segment_ids[t]``; positions before 0 read zeros. Returns y ``[B, T, C]``.
  Differentiable in x and w. Same values as ``k3jax.kda.short_conv(x, w, segment_ids)[0]``.
  """
  if x.ndim != 3 or w.ndim != 2 or w.shape[0] < 1 or w.shape[1] != x.shape[2]:
    raise ValueError(f"causal_conv_silu: x {x.shape} must be [B, T, C] and w {w.shape} [W, C] "
                     "with the same C")
  if segment_ids is not None and segment_ids.shape != x.shape[:2]:
    raise ValueError(f"causal_conv_silu: segment_ids {segment_ids.shape} must be [B, T] = "
                     f"{x.shape[:2]}")
  if resolve(implementation) == "xla":
    return reference.causal_conv_silu(x, w, segment_ids)
  from pallas_kernels.conv import gpu
  return gpu.causal_conv_silu(x, w, segment_ids)


__all__ = ["causal_conv_silu", "resolve", "IMPLEMENTATIONS"]
