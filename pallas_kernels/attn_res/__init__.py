"""Block Attention Residuals mixing (SPEC section 4): a softmax over depth sources.

``implementation``: ``"xla"`` (:mod:`pallas_kernels.attn_res.reference`, the reference),
``"pallas_gpu"`` (Triton kernels through Pallas, one forward and one backward kernel reading the
sources as separate refs, :mod:`pallas_kernels.attn_res.gpu`; interpret mode on CPU),
``"pallas"`` (``pallas_gpu`` off TPU; on TPU there is no kernel and it means ``"xla"``) or
``None`` (``pallas_gpu`` on GPU, ``xla`` on CPU and TPU).
"""

from __future__ import annotations

from typing import Sequence

import jax

from pallas_kernels import resolve_gpu_kernel
from pallas_kernels.attn_res import reference

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas")


def resolve(implementation: str | None) -> str:
  """The concrete implementation name for ``implementation`` on the current backend."""
  return resolve_gpu_kernel("attn_res", implementation, IMPLEMENTATIONS)


def attn_res(sources: Sequence[jax.Array], proj: jax.Array, norm: jax.Array | None, eps: float, *,
             implementation: str | None = None) -> jax.Array:
  """``out = sum_i p_i v_i`` with ``p = softmax_i((norm * proj) . v_i * rsqrt(mean(v_i^2) + eps))``.

  sources: S >= 1 arrays ``[B, T, d]`` of one shape (bf16 or f32); proj, norm: ``[d]`` (norm
  None: proj is the whole query ``norm * proj``, as a served model holds it). Returns ``[B, T, d]``
  in the first source's dtype; logits, softmax and the sum run in float32. Differentiable in every
  source, proj and norm.
  """
  sources = tuple(sources)
  if not sources:
    raise ValueError("attn_res: no sources (need at least one [B, T, d] array)")
  shape = sources[0].shape
  if len(shape) != 3 or any(x.shape != shape for x in sources):
    raise ValueError(f"attn_res: sources must all be [B, T, d] of one shape, got "
                     f"{[tuple(x.shape) for x in sources]}")
  if proj.shape != shape[-1:] or (norm is not None and norm.shape != shape[-1:]):
    raise ValueError(f"attn_res: proj {tuple(proj.shape)} and norm "
                     f"{None if norm is None else tuple(norm.shape)} must be [d] = {shape[-1:]}")
  if resolve(implementation) == "xla":
    return reference.attn_res(sources, proj, norm, eps)
  from pallas_kernels.attn_res import gpu
  return gpu.attn_res(sources, proj, norm, eps)


__all__ = ["attn_res", "resolve", "IMPLEMENTATIONS"]
