"""The packed GLU activation as Triton kernels through Pallas (interpret mode off GPU).

One program per ``[bm, bf]`` tile of ``h``: it loads the matching gate and up tiles of
``gu [M, 2F]``, evaluates :func:`pallas_kernels.glu.reference.glu_math` in float32 and stores
``h`` (forward) or both halves of ``d gu`` (backward, with the cotangent tile of ``g``). One
read of every operand and one write of every result: XLA's fusions of the same maths ran at
about 2.2 TB/s on an H200 (the backward's concatenation a second pass of its own).

Rows and columns past the array are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend, triton_math as tm
from pallas_kernels.glu.reference import glu_math

# The fastest of benchmarks/glu.py's sweeps on an H200 at gu [524288, 1024] bf16 (2026-12-01:
# forward 0.659 ms, forward + backward 1.521 at 8 x 256; 1.517 at 16 x 128, 1.703 at 16 x 256,
# 2.015 at 32 x 256; XLA 0.773 and 2.375 ms).
BLOCK_M = 8
BLOCK_F = 256
WARPS = 4


def _interpret() -> bool:
  return default_backend() != "gpu"


def _tile(m, f, bm, bf):
  """(row slice, column slice of the gate half, mask ``[bm, bf]``) of this program's tile."""
  i, j = pl.program_id(0), pl.program_id(1)
  rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
  cols = j * bf + jnp.arange(bf, dtype=jnp.int32)
  mask = (rows < m)[:, None] & (cols < f)[None, :]
  return pl.ds(i * bm, bm), j * bf, mask


def _load(ref, r, c0, bf, mask):
  return plgpu.load(ref.at[r, pl.ds(c0, bf)], mask=mask, other=0).astype(jnp.float32)


def _fwd_kernel(gu_ref, h_ref, *, m, f, bm, bf, kind, beta, beta_lin):
  r, c0, mask = _tile(m, f, bm, bf)
  h = glu_math(kind, beta, beta_lin, _load(gu_ref, r, c0, bf, mask),
               _load(gu_ref, r, c0 + f, bf, mask), grads=False, exp=tm.exp)
  plgpu.store(h_ref.at[r, pl.ds(c0, bf)], h.astype(h_ref.dtype), mask=mask)


def _bwd_kernel(gu_ref, g_ref, d_ref, *, m, f, bm, bf, kind, beta, beta_lin):
  r, c0, mask = _tile(m, f, bm, bf)
  _, da, db = glu_math(kind, beta, beta_lin, _load(gu_ref, r, c0, bf, mask),
                       _load(gu_ref, r, c0 + f, bf, mask), exp=tm.exp)
  g = _load(g_ref, r, c0, bf, mask)
  plgpu.store(d_ref.at[r, pl.ds(c0, bf)], (g * da).astype(d_ref.dtype), mask=mask)
  plgpu.store(d_ref.at[r, pl.ds(c0 + f, bf)], (g * db).astype(d_ref.dtype), mask=mask)


def _call(kernel, halves, gu, *args, kind, beta, beta_lin, name):
  """``kernel`` over ``gu [..., 2F]`` (and ``args [..., F]``) -> ``[..., halves * F]``."""
  lead = gu.shape[:-1]
  gu = gu.reshape(-1, gu.shape[-1])
  m, f = gu.shape[0], gu.shape[1] // 2
  bm, bf = BLOCK_M, min(BLOCK_F, pl.next_power_of_2(f))
  kern = functools.partial(kernel, m=m, f=f, bm=bm, bf=bf, kind=kind, beta=float(beta),
                           beta_lin=float(beta_lin))
  out = pl.pallas_call(
      kern, out_shape=jax.ShapeDtypeStruct((m, halves * f), gu.dtype),
      grid=(pl.cdiv(m, bm), pl.cdiv(f, bf)),
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
      interpret=_interpret(), name=name,
  )(gu, *(a.reshape(m, f) for a in args))
  return out.reshape(*lead, halves * f)


def glu_fwd(gu, kind: str, beta: float, beta_lin: float):
  """``h [..., F]`` of ``gu [..., 2F]``."""
  return _call(_fwd_kernel, 1, gu, kind=kind, beta=beta, beta_lin=beta_lin, name="glu_fwd")


def glu_bwd(gu, g, kind: str, beta: float, beta_lin: float):
  """``d gu [..., 2F]`` for the cotangent ``g [..., F]``."""
  return _call(_bwd_kernel, 2, gu, g, kind=kind, beta=beta, beta_lin=beta_lin, name="glu_bwd")
