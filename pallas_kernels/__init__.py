"""Ops with a pure-JAX reference and Pallas backends, selected by ``implementation=``.

- :mod:`pallas_kernels.kda`: Kimi Delta Attention (chunked training/prefill and decode).
- :mod:`pallas_kernels.mla`: MLA attention (prefill/training) and paged latent decode.
- :mod:`pallas_kernels.moe`: grouped matmuls and token permutation for the MoE layer.
"""

import jax


def default_backend() -> str:
  """'gpu', 'tpu' or 'cpu': the platform of the default device."""
  return jax.default_backend()
