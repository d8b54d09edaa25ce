"""Causal depthwise short conv + SiLU in plain jnp (the reference of :mod:`pallas_kernels.conv`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv_silu(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """``silu(sum_j w[j] * x[t - (W-1-j)])`` in float32 (float64 for float64 x), in x.dtype.

  x: ``[B, T, C]``; w: ``[W, C]``; segment_ids: ``[B, T]`` or None. Positions before 0 and taps
  reaching into another document (``segment_ids[t-s] != segment_ids[t]``) read zeros.
  """
  t, width = x.shape[1], w.shape[0]
  acc = jnp.promote_types(x.dtype, jnp.float32)
  xf = x.astype(acc)
  z = jnp.zeros(xf.shape, acc)
  for j in range(width):
    s = width - 1 - j  # tap j reads x[t - s]
    xs = jnp.pad(xf, ((0, 0), (s, 0), (0, 0)))[:, :t]
    if segment_ids is not None and s:
      prev = jnp.pad(segment_ids, ((0, 0), (s, 0)))[:, :t]  # padded rows read zeros anyway
      xs = jnp.where((prev == segment_ids)[..., None], xs, 0.0)
    z = z + xs * w[j].astype(acc)
  return jax.nn.silu(z).astype(x.dtype)
