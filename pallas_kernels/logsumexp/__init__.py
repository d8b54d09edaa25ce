"""Row log-sum-exp of large float32 or bf16 matrices (the LM-head loss's logits), one read of
the input.

``implementation``: ``"xla"`` (:mod:`pallas_kernels.logsumexp.reference`, a one-pass variadic
reduction), ``"pallas_gpu"`` (a Triton kernel, :mod:`pallas_kernels.logsumexp.gpu`; interpret
mode on CPU), ``"pallas"`` (``pallas_gpu`` off TPU; on TPU ``"xla"``) or ``None`` (``pallas_gpu``
on GPU, ``xla`` elsewhere). Not differentiable: the loss forms its own gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import resolve_gpu_kernel
from pallas_kernels.logsumexp import reference

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas")


def resolve(implementation: str | None) -> str:
  """``"xla"`` or ``"pallas_gpu"``: the concrete implementation on the current backend."""
  return resolve_gpu_kernel("logsumexp", implementation, IMPLEMENTATIONS)


def logsumexp(x: jax.Array, *, implementation: str | None = None, config=None) -> jax.Array:
  """``log(sum(exp(x), -1))`` of ``x [..., V]`` -> ``[...]`` (float32 for bf16 input); the
  Pallas kernel takes float32 and bf16 (float64 goes to XLA unless the kernel is asked for).
  ``config``: the kernel's tiling (:class:`pallas_kernels.logsumexp.gpu.Config`; default its
  ``default_config``)."""
  impl = resolve(implementation)
  kernel_types = (jnp.float32, jnp.bfloat16)
  if impl == "xla" or (implementation is None and x.dtype not in kernel_types):
    return reference.logsumexp(x)
  if x.dtype not in kernel_types:
    raise ValueError(f"logsumexp: the Pallas kernel takes float32 or bfloat16, got {x.dtype}")
  from pallas_kernels.logsumexp import gpu
  return gpu.logsumexp(x, config)


__all__ = ["logsumexp", "resolve", "IMPLEMENTATIONS"]
