"""The 2D rotary position embedding of the MoonViT line (``Rope2DPosEmb``).

Each head's dims are taken as ``head_dim / 2`` complex pairs ``(x[2j], x[2j+1])``; pair ``j``
turns by ``col * f_{j//2}`` for even ``j`` and ``row * f_{j//2}`` for odd ``j``, with
``f_i = theta ** (-4 i / head_dim)``: columns and rows interleave. Computed in float32 like the
reference; every frame of a video chunk gets the same rotation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """positions ``[..., 2]`` int (patch row, column) -> (cos, sin) ``[..., head_dim / 2]`` float32."""
  quarter = jnp.arange(0, head_dim, 4, dtype=jnp.float32)[:head_dim // 4]
  freqs = 1.0 / (jnp.float32(theta) ** (quarter / jnp.float32(head_dim)))
  pos = positions.astype(jnp.float32)
  col = pos[..., 1:2] * freqs  # [..., head_dim / 4]
  row = pos[..., 0:1] * freqs
  angle = jnp.stack([col, row], axis=-1).reshape(*positions.shape[:-1], head_dim // 2)
  return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x ``[..., H, head_dim]`` rotated by (cos, sin) ``[..., head_dim / 2]``, in float32,
  returned in x's dtype."""
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  a, b = xf[..., 0], xf[..., 1]
  c, s = cos[..., None, :], sin[..., None, :]
  out = jnp.stack([a * c - b * s, a * s + b * c], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)
