"""Taps of the learned positional grid's interpolation, computed on the host.

The tower resizes its learned ``[H0, W0, D]`` positional grid to each image's patch grid the way
``torch.nn.functional.interpolate`` does (``align_corners=False``, bicubic with A = -0.75 and
edge-clamped indices, or bilinear). The resize is separable: each output row reads 4 source rows
with 4 weights, each column 4 source columns (bilinear uses 2, the other 2 weigh 0). Computing
them here, in float32 like the reference, keeps the model's shapes static.
"""

from __future__ import annotations

import numpy as np

_A = np.float32(-0.75)  # PyTorch's bicubic convolution constant


def _cubic_weights(t: np.ndarray) -> np.ndarray:
  """``[n] -> [n, 4]`` cubic convolution weights for source offsets -1, 0, 1, 2 (float32)."""
  a, one = _A, np.float32(1)
  two = np.float32(2)

  def near(x):  # |x| <= 1
    return ((a + two) * x - (a + np.float32(3))) * x * x + one

  def far(x):  # 1 < |x| < 2
    return ((a * x - np.float32(5) * a) * x + np.float32(8) * a) * x - np.float32(4) * a

  u = one - t
  return np.stack([far(t + one), near(t), near(u), far(u + one)], axis=-1)


def interpolation_taps(out_size: int, in_size: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
  """Source indices ``[out_size, 4]`` int32 and weights ``[out_size, 4]`` float32 along one
  axis; output position ``i`` is ``sum_j weights[i, j] * source[indices[i, j]]``. The identity
  when the sizes agree (the reference then uses the grid as it is)."""
  dst = np.arange(out_size)
  if out_size == in_size:
    idx = np.stack([dst] * 4, axis=-1)
    w = np.zeros((out_size, 4), np.float32)
    w[:, 1] = 1
    return idx.astype(np.int32), w
  scale = np.float32(in_size) / np.float32(out_size)
  src = scale * (dst.astype(np.float32) + np.float32(0.5)) - np.float32(0.5)
  if mode == "bicubic":
    lo = np.floor(src)
    w = _cubic_weights((src - lo).astype(np.float32))
    idx = lo.astype(np.int64)[:, None] + np.arange(-1, 3)
  elif mode == "bilinear":
    src = np.maximum(src, np.float32(0))
    lo = np.floor(src)
    lam = (src - lo).astype(np.float32)
    w = np.stack([np.zeros_like(lam), np.float32(1) - lam, lam, np.zeros_like(lam)], axis=-1)
    idx = lo.astype(np.int64)[:, None] + np.array([0, 0, 1, 1])
  else:
    raise ValueError(f"unknown interpolation {mode!r}")
  return np.clip(idx, 0, in_size - 1).astype(np.int32), w.astype(np.float32)
