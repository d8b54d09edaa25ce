"""WGMMA products for the bodies of our Mosaic GPU kernels (Hopper; GPU interpret mode on CPU)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_interpret

SMEM_BYTES = 227 * 1024  # shared memory of one CTA on Hopper
ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout array
COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def kernel_params(interpret: bool, threads: int = 1, **compiler) -> dict:
  """``plgpu.kernel``'s compiler parameters (fast exponentials and ``compiler``), its
  ``threads`` warpgroups (axis ``"wg"``) and interpret mode."""
  threads_kw = dict(num_threads=threads, thread_name="wg") if threads > 1 else {}
  return dict(compiler_params=plgpu.CompilerParams(approx_math=True, **compiler), **threads_kw,
              interpret=gpu_interpret(threads) if interpret else None)


class Regs(NamedTuple):
  """A 16-bit WGMMA-layout array in registers as the left operand of a product (Hopper's wgmma
  reads it from registers; GPU interpret mode, whose wgmma takes SMEM only, from a copy)."""
  value: jax.Array


def products(*specs, interpret: bool = False):
  """``[sum_i a_i @ b_i for (shape, pairs) in specs]``: each spec's ``[M, N]`` float32 sum (WGMMA
  layout) in a fresh accumulator, every product issued before the first wait. ``a`` is an SMEM
  ref or :class:`Regs`, ``b`` an SMEM ref."""
  regs = [a for _, pairs in specs for a, _ in pairs if isinstance(a, Regs)]
  if interpret and regs:
    def staged(*bufs):
      copies = iter(bufs)
      for buf, a in zip(bufs, regs):
        buf[...] = a.value
      plgpu.commit_smem()
      return products(*[(shape, [(next(copies) if isinstance(a, Regs) else a, b)
                                 for a, b in pairs]) for shape, pairs in specs])
    return pl.run_scoped(staged, *(swizzled(a.value.shape, a.value.dtype) for a in regs))

  def scope(*accs):
    for acc, (_, pairs) in zip(accs, specs):
      for a, b in pairs:
        plgpu.wgmma(acc, a.value if isinstance(a, Regs) else a, b)
    return tuple(acc[...] for acc in accs)
  return pl.run_scoped(scope, *(plgpu.ACC(shape, jnp.float32) for shape, _ in specs))


def product(shape, *pairs, interpret: bool = False):
  """``sum_i a_i @ b_i`` ``[M, N]`` float32 for ``pairs`` ((a, b), ...) as in :func:`products`."""
  return products((shape, pairs), interpret=interpret)[0]


def add(acc, *pairs, interpret: bool):
  """``acc + sum_i a_i @ b_i`` with wgmma (operands as in :func:`products`), accumulating in
  place; see :func:`add_all`."""
  return add_all((acc, pairs), interpret=interpret)[0]


def add_all(*specs, interpret: bool):
  """``[acc + sum_i a_i @ b_i for (acc, pairs) in specs]`` (operands as in :func:`products`),
  accumulating in place, every product issued before the first wait. GPU interpret mode lacks
  ``run_state`` (a preinitialised accumulator), so there the products go to fresh accumulators
  and are added."""
  if interpret:
    sums = products(*[(acc.shape, pairs) for acc, pairs in specs], interpret=True)
    return [acc + p for (acc, _), p in zip(specs, sums)]

  def scope(refs):
    for ref, (_, pairs) in zip(refs, specs):
      for a, b in pairs:
        plgpu.wgmma(ref, a.value if isinstance(a, Regs) else a, b)
  return list(pl.run_state(scope)(tuple(plgpu.ACC.init(acc) for acc, _ in specs)))


def swizzled(shape, dtype, swizzle: int | None = None) -> plgpu.SMEM:
  """SMEM for a WGMMA operand or a TMA tile: tiled by 8 rows and swizzled (``swizzle`` bytes,
  by default the largest its minor dimension allows: conflict-free loads). The operands of one
  wgmma share a swizzle, so a tile multiplied with a narrower one takes that one's."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = swizzle or plgpu.find_swizzle(shape[-1] * itemsize * 8)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                              plgpu.SwizzleTransform(swizzle)))
