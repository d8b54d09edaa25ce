"""The learned positional grid (``Learnable2DInterpPosEmbDivided_fixed``): a ``[H0, W0, D]``
table resized to each image's patch grid with the host's taps (:mod:`k3jax.vision.pos_taps`),
plus, for the frames of a video chunk, a fixed 1D sin-cos embedding of the frame index."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.nn import normal, param


def time_embedding(frames: int, dim: int) -> np.ndarray:
  """``[frames, dim]`` float32: ``[sin(t w), cos(t w)]`` with ``w = 10000 ** (-i / (dim / 2))``
  (the reference's NumPy recipe, float32 throughout)."""
  omega = np.arange(dim // 2, dtype=np.float32)
  omega /= dim / 2.0
  omega = 1.0 / 10000 ** omega
  out = np.einsum("m,d->md", np.arange(frames, dtype=np.float32), omega)
  return np.concatenate([np.sin(out), np.cos(out)], axis=1).astype(np.float32)


class PositionalGrid(nnx.Module):
  def __init__(self, height: int, width: int, frames: int, dim: int, *, rngs: nnx.Rngs, dtype,
               std: float):
    self.weight = param(rngs, normal(std), (height, width, dim), ("grid", "grid", "embed"), dtype)
    self.frames = frames

  def __call__(self, v: dict, dtype) -> jax.Array:
    """The embedding of every patch ``[B, P, D]`` from ``batch``'s arrays ``v``."""
    h0, w0, d = self.weight.shape
    table = self.weight[...].astype(dtype).reshape(h0 * w0, d)
    idx = v["pos_rows"][..., :, None] * w0 + v["pos_cols"][..., None, :]  # [B, P, 4, 4]
    wts = v["pos_row_weights"][..., :, None] * v["pos_col_weights"][..., None, :]
    grid = jnp.einsum("bpij,bpijd->bpd", wts.astype(dtype), table[idx])
    times = v["times"]
    frame = jnp.asarray(time_embedding(self.frames, d), dtype)[jnp.clip(times, 0)]
    return grid + jnp.where((times >= 0)[..., None], frame, 0).astype(dtype)
