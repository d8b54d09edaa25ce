"""The chunked KDA's WY factors as a Mosaic GPU kernel (Hopper: TMA, wgmma from registers).

Same results as ``chunk_dense._dense_wu_kernel`` (Triton): per chunk of C = 64 tokens,
``X = (I + A)^-1`` for the strictly lower ``A = diag(beta) P_kk``, then
``W = cont * X diag(beta) KG`` and ``U = X diag(beta) v``. One warpgroup per chunk inverts by
doubling the diagonal blocks (``chunk_ops.lower_inverse``: blocks of 1, 2, 4, ... 32 rows merged as
``X <- X - X (L X)``, two dependent products per level, ten in all), the left operand from
registers, the right one through SMEM. A float32 product is one float16 wgmma (the operands
rounded to 11 significant bits, as TF32 rounds them in the Triton kernel: for keys of unit norm
and beta in (0, 1), whose inverse has entries of order 1) or, with ``split``, three bf16 wgmmas
of split operands (``x ~ hi + lo``: ``hi hi + hi lo + lo hi``, about 16 bits, any range). W and
U take ``X diag(beta)`` rounded to bf16, as the Triton kernel does.

Shapes: pkk ``[B, Tp, HV, C]`` float32 (strictly lower, same segment, without beta), kg
``[B, Tp, HV, K]`` and v ``[B, Tp, HV, V]`` bf16, beta ``[B, HV, Tp]`` float32 (the gate's value,
zero on padded tokens), cont ``[B, Tp]`` float32 (1 where the token continues the state entering
its chunk); results w ``[B, Tp, HV, K]``, u ``[B, Tp, HV, V]`` (bf16) and, with ``keep``,
x ``[B, Tp, HV, C]`` float32. Grid: one CTA per (chunk, batch * value head), 58 KB of SMEM (66 KB
with ``split``; three CTAs share an SM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import kernel_output, wgmma
from pallas_kernels.kda.recurrence_mgpu import CHUNK


def supported(kg, v, chunk: int) -> bool:
  """Whether the kernel takes these operands: bf16 KG and v, 64-token chunks, K and V multiples
  of 16 up to 128 (wider products exceed the registers)."""
  bf16 = jnp.dtype(jnp.bfloat16)
  return (kg.dtype == bf16 and v.dtype == bf16 and chunk == CHUNK
          and all(d % 16 == 0 and d <= 128 for d in (kg.shape[-1], v.shape[-1])))


def _parts(x, split: bool):
  """The 16-bit operand parts of float32 ``x``: ``(hi, lo)`` bf16 with ``x ~ hi + lo`` if
  ``split``, else ``(x as float16,)``."""
  if not split:
    return (x.astype(jnp.float16),)
  hi = x.astype(jnp.bfloat16)
  return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _product(right, left, smem, interpret):
  """``left @ right`` float32 from the operands' parts (:func:`_parts`): ``right`` through the
  SMEM buffers ``smem``, ``left`` from registers; ``hi hi + hi lo + lo hi`` for split parts."""
  for buf, part in zip(smem, right):
    buf[...] = part
  plgpu.commit_smem()
  pairs = [(wgmma.Regs(left[0]), smem[0])]
  if len(right) == 2:
    pairs += [(wgmma.Regs(left[0]), smem[1]), (wgmma.Regs(left[1]), smem[0])]
  return wgmma.product(left[0].shape[:1] + right[0].shape[1:], *pairs, interpret=interpret)


def _kernel(pkk_ref, kg_ref, v_ref, beta_ref, cont_ref, w_ref, u_ref, *rest, hv, keep, split,
            interpret):
  x_ref, (a_smem, kg_smem, v_smem, beta_smem, cont_smem, landed, *op_smem) = (
      (rest[0], rest[1:]) if keep else (None, rest))
  c, f32 = CHUNK, jnp.float32
  ci, bh = lax.axis_index("c"), lax.axis_index("bh")
  b, h = lax.div(bh, jnp.int32(hv)), lax.rem(bh, jnp.int32(hv))  # equal dtypes under x64 too
  rows = pl.ds(ci * c, c)
  for src, dst in ((pkk_ref.at[b, rows, h], a_smem), (kg_ref.at[b, rows, h], kg_smem),
                   (v_ref.at[b, rows, h], v_smem), (beta_ref.at[b, h, rows], beta_smem),
                   (cont_ref.at[b, rows], cont_smem)):
    plgpu.copy_gmem_to_smem(src, dst, landed)
  plgpu.barrier_wait(landed)

  beta_rows = plgpu.load(beta_smem, layout=wgmma.ROWS)
  a = plgpu.load(a_smem, layout=plgpu.Layout.WGMMA, optimized=False) * lax.broadcast_in_dim(
      beta_rows, (c, c), [0])
  ii = plgpu.broadcasted_iota(jnp.int32, (c, c), 0, layout=plgpu.Layout.WGMMA)
  jj = plgpu.broadcasted_iota(jnp.int32, (c, c), 1, layout=plgpu.Layout.WGMMA)
  # blocks of 1 -> 2: row i = 2m + 1 takes -A[i, i - 1]
  x = (ii == jj).astype(f32) - jnp.where((ii == jj + 1) & ((ii & 1) == 1), a, 0.0)
  level = 1
  while (1 << level) < c:  # blocks of n = 2^level -> 2n: X <- X - X (L X)
    rb, cb = ii >> level, jj >> level
    low = _parts(jnp.where((rb == cb + 1) & ((rb & 1) == 1), a, 0.0), split)
    xp = _parts(x, split)
    t = _product(xp, low, op_smem, interpret)
    x = x - _product(_parts(t, split), xp, op_smem, interpret)
    level += 1
  if keep:
    a_smem[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(a_smem, x_ref.at[b, rows, h])

  xb = wgmma.Regs((x * lax.broadcast_in_dim(plgpu.load(beta_smem, layout=wgmma.COLS), (c, c), [1])
                   ).astype(jnp.bfloat16))
  w, u = wgmma.products(((c, kg_smem.shape[-1]), [(xb, kg_smem)]),
                        ((c, v_smem.shape[-1]), [(xb, v_smem)]), interpret=interpret)
  cont = lax.broadcast_in_dim(plgpu.load(cont_smem, layout=wgmma.ROWS), w.shape, [0])
  kg_smem[...] = (cont * w).astype(kg_smem.dtype)  # the products are done with KG and v
  v_smem[...] = u.astype(v_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(kg_smem, w_ref.at[b, rows, h])
  plgpu.copy_smem_to_gmem(v_smem, u_ref.at[b, rows, h])
  plgpu.wait_smem_to_gmem(0)


def chunk_wu(pkk, kg, v, beta, cont, *, keep: bool, split: bool, interpret: bool):
  """(w, u) and, with ``keep``, x; see the module docstring. ``split``: the inverse's products
  as three bf16 products of split operands (about 16 bits), else one float16 product (TF32's
  11 bits, for entries far below float16's 65504: keys of unit norm and beta in (0, 1))."""
  bsz, tp, hv, kdim = kg.shape
  vd = v.shape[-1]
  c, bf16, f32 = CHUNK, jnp.bfloat16, jnp.float32
  out_type = [jax.ShapeDtypeStruct((bsz, tp, hv, kdim), bf16),
              jax.ShapeDtypeStruct((bsz, tp, hv, vd), bf16)]
  if keep:
    out_type.append(jax.ShapeDtypeStruct((bsz, tp, hv, c), f32))
  kern = functools.partial(_kernel, hv=hv, keep=keep, split=split, interpret=interpret)
  kern.__name__ = "kda_chunk_wu_mgpu"
  scratch = (
      plgpu.SMEM((c, c), f32),  # P_kk in, X out
      wgmma.swizzled((c, kdim), bf16),  # KG in, W out
      wgmma.swizzled((c, vd), bf16),  # v in, U out
      plgpu.SMEM((c,), f32),  # beta
      plgpu.SMEM((c,), f32),  # cont
      plgpu.Barrier(num_arrivals=5),
  ) + (wgmma.swizzled((c, c), bf16 if split else jnp.float16),) * (1 + split)  # right operand
  outs = plgpu.kernel(
      kern, out_type=tuple(out_type), scratch_types=scratch, grid=(tp // c, bsz * hv),
      grid_names=("c", "bh"), **wgmma.kernel_params(interpret))(pkk, kg, v, beta, cont)
  return tuple(kernel_output(x) for x in outs)
