"""MXFP4 as compressed-tensors ``mxfp4-pack-quantized`` stores K3's routed experts.

Per weight ``weight_packed [R, C/2] uint8`` (two E2M1 codes per byte, the even column in the low
nibble) and ``weight_scale [R, C/32] uint8`` (E8M0: ``2 ** (s - 127)`` for each group of 32
columns). :func:`mxfp4_dequantize` is exact in bfloat16/float32; :func:`mxfp4_quantize` follows
the compressed-tensors rule and is lossless on dequantized values, so HF -> Orbax -> HF reproduces
the original bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from k3jax.convert.errors import ConversionError


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
MXFP4_GROUP = 32
_CODES = np.concatenate([E2M1, -E2M1])  # code -> value; code 8 is -0.0
# byte -> (even, odd) values, each pair packed in one 64-bit (float32) / 32-bit (bfloat16) word so
# that dequantization is one np.take
_PAIRS = np.stack([_CODES[np.arange(256) & 15], _CODES[np.arange(256) >> 4]], 1)
_MXFP4_PAIRS = _PAIRS.astype(np.float32).view(np.float64).reshape(256)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_MXFP4_BF16_PAIRS = _PAIRS.astype(_BF16).view(np.uint32).reshape(256)
_MXFP4_NONZERO = np.where(_PAIRS != 0, 0xFFFF, 0).astype(np.uint16).view(np.uint32).reshape(256)
_E8M0 = np.append(np.ldexp(np.float32(1), np.arange(255) - 127), np.nan).astype(np.float32)  # 255: NaN


def mxfp4_dequantize(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
  """``packed [R, C/2] uint8``, ``scale [R, C/32] uint8`` -> ``[R, C]`` in ``dtype`` (float32 or
  bfloat16; exact in both)."""
  r, half = packed.shape
  c = 2 * half
  if packed.dtype != np.uint8 or scale.dtype != np.uint8:
    raise ConversionError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
  if c % MXFP4_GROUP or scale.shape != (r, c // MXFP4_GROUP):
    raise ConversionError(f"MXFP4 scale shape {scale.shape} does not fit packed shape {packed.shape}")
  if np.any(scale == 255):
    raise ConversionError("MXFP4 scale holds the E8M0 NaN code 255")
  if np.dtype(dtype) == _BF16 and scale.min() >= 2 and scale.max() <= 252:
    # bfloat16 directly: add (scale - 127) to the exponent field of the non-zero codes (the
    # result stays a normal number for scales in [2, 252])
    grouped = (r, c // MXFP4_GROUP, MXFP4_GROUP)
    bits = np.take(_MXFP4_BF16_PAIRS, packed).view(np.uint16).reshape(grouped)
    shift = np.take(_MXFP4_NONZERO, packed).view(np.uint16).reshape(grouped)
    shift &= ((scale.astype(np.int32) - 127) << 7).astype(np.uint16)[..., None]
    bits += shift  # uint16 arithmetic: a negative shift wraps correctly
    return bits.reshape(r, c).view(_BF16)
  vals = np.take(_MXFP4_PAIRS, packed).view(np.float32).reshape(r, c // MXFP4_GROUP, MXFP4_GROUP)
  vals *= _E8M0[scale][..., None]  # powers of two: exact
  return vals.reshape(r, c).astype(dtype, copy=False)


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``[R, C]`` float -> (``packed [R, C/2]``, ``scale [R, C/32]``), the compressed-tensors rule.

  The group scale is ``2 ** (floor(log2(round_to_power_2(amax))) - 2)`` and each value rounds
  to the nearest E2M1 code. Values that are already on the MXFP4 grid come back exactly, with the
  original scale whenever the group's largest code is 4 or 6 (always the case for checkpoints this
  rule produced). An all-zero group gets scale code 0.
  """
  r, c = w.shape
  if c % MXFP4_GROUP:
    raise ConversionError(f"MXFP4 needs a multiple of {MXFP4_GROUP} columns, got {c}")
  g = np.asarray(w, np.float32).reshape(r, c // MXFP4_GROUP, MXFP4_GROUP)
  amax = np.abs(g).max(-1)
  # round_to_power_2: add a quarter of the mantissa range, keep sign and exponent
  bits = (amax.view(np.uint32).astype(np.uint64) + (1 << 21)) & 0xFF800000
  biased = (bits >> 23).astype(np.int64)  # exponent field of the rounded power of two
  scale = np.where(amax > 0, np.clip(biased - 2, 0, 254), 0).astype(np.uint8)
  x = np.abs(np.ldexp(g, 127 - scale.astype(np.int32)[..., None]))
  idx = np.zeros(x.shape, np.uint8)
  # E2M1 rounding with the compressed-tensors tie rules
  for lo, inclusive, code in ((0.25, False, 1), (0.75, True, 2), (1.25, False, 3),
                              (1.75, True, 4), (2.5, False, 5), (3.5, True, 6), (5.0, False, 7)):
    idx = np.where((x >= lo) if inclusive else (x > lo), code, idx).astype(np.uint8)
  codes = (idx | (np.signbit(g).astype(np.uint8) << 3)).reshape(r, c)
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
  return packed, scale


def mxfp4_shapes(shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
  """(``weight_packed``, ``weight_scale``) shapes of an MXFP4 weight of float shape ``[R, C]``."""
  return (shape[0], shape[1] // 2), (shape[0], shape[1] // MXFP4_GROUP)
