"""WGMMA products for the bodies of our Mosaic GPU kernels (Hopper; GPU interpret mode on CPU)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_BYTES = 227 * 1024  # shared memory of one CTA on Hopper


def product(shape, *pairs):
  """``sum_i a_i @ b_i`` ``[M, N]`` float32 (WGMMA layout) for SMEM operands ``pairs`` ((a, b),
  ...), accumulated in one fresh accumulator."""
  def scope(acc):
    for a, b in pairs:
      plgpu.wgmma(acc, a, b)
    return acc[...]
  return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def add(acc, *pairs, interpret: bool):
  """``acc + sum_i a_i @ b_i`` with wgmma, accumulating in place. GPU interpret mode lacks
  ``run_state`` (a preinitialised accumulator), so there the products go to a fresh accumulator
  and are added."""
  if interpret:
    return acc + product(acc.shape, *pairs)

  def scope(ref):
    for a, b in pairs:
      plgpu.wgmma(ref, a, b)
  return pl.run_state(scope)(plgpu.ACC.init(acc))


def swizzled(shape, dtype, swizzle: int | None = None) -> plgpu.SMEM:
  """SMEM for a WGMMA operand or a TMA tile: tiled by 8 rows and swizzled (``swizzle`` bytes,
  by default the largest its minor dimension allows: conflict-free loads). The operands of one
  wgmma share a swizzle, so a tile multiplied with a narrower one takes that one's."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = swizzle or plgpu.find_swizzle(shape[-1] * itemsize * 8)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                              plgpu.SwizzleTransform(swizzle)))
