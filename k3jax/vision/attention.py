"""Bidirectional attention over packed images: the project's MLA attention kernels with
segment ids (``causal=False``), so patches attend only within their segment."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla import mla_attention, resolve

_KERNEL_DIM = 16  # the Pallas kernels take head dims that are multiples of 16


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                     implementation: str | None) -> jax.Array:
  """q, k, v ``[B, P, H, D]``, segment_ids ``[B, P]`` (0: padding, given zeros) -> ``[B, P, H, D]``, softmax scale ``D ** -0.5``. A head dim the kernels cannot take
  (K2.5's 72) is zero-padded to a multiple of 16: the scores and the kept columns are unchanged."""
  d = q.shape[-1]
  impl = resolve(implementation)
  pad = (-d) % _KERNEL_DIM if impl != "xla" else 0
  if pad:
    q, k, v = (jnp.pad(t, ((0, 0), (0, 0), (0, 0), (0, pad))) for t in (q, k, v))
  o = mla_attention(q, k, v, segment_ids=segment_ids, causal=False, scale=d ** -0.5,
                    implementation=implementation)
  return jnp.where((segment_ids > 0)[..., None, None], o[..., :d], 0).astype(q.dtype)
