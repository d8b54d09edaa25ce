"""The GLU activation as Triton kernels through Pallas (interpret mode off GPU), packed (``gu [M,
2F]``, the routed experts) or as a pair of arrays (gate and up ``[M, F]``, the dense GLU and the
shared experts).

One program per ``[bm, bf]`` tile of ``h``: it loads the matching gate and up tiles, evaluates
:func:`pallas_kernels.glu.reference.glu_math` in float32 and stores ``h`` (forward) or the gate's
and up's gradients (backward, with the cotangent tile of ``g``). One read of every operand and one
write of every result, where XLA's autodiff of the packed form writes the backward's halves in a
second pass of its own (benchmarks/RESULTS.md, "Step glue kernels").

Rows and columns past the array are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend, triton_math as tm
from pallas_kernels.glu.reference import glu_math

@dataclasses.dataclass(frozen=True)
class Config:
  """``[block_m, block_f]`` tiles of ``h`` (``block_f`` capped at F rounded up to a power of two),
  Triton's ``warps``. The defaults are the fastest of ``benchmarks/glu.py``'s sweeps on an H200
  (benchmarks/RESULTS.md, "Step glue kernels", packed SiTU-GLU)."""
  block_m: int = 8
  block_f: int = 256
  warps: int = 4


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


def _fwd_kernel(a_ref, b_ref, h_ref, *, m, f, bm, bf, b_off, kind, beta, beta_lin):
  r, c0, mask = _tile(m, f, bm, bf)
  h = glu_math(kind, beta, beta_lin, _load(a_ref, r, c0, bf, mask),
               _load(b_ref, r, c0 + b_off, bf, mask), grads=False, exp=tm.exp)
  plgpu.store(h_ref.at[r, pl.ds(c0, bf)], h.astype(h_ref.dtype), mask=mask)


def _bwd_kernel(a_ref, b_ref, g_ref, *d_refs, m, f, bm, bf, b_off, kind, beta, beta_lin):
  """``d a`` and ``d b`` into ``d_refs``: one array ``[M, 2F]`` (packed: d b at column F) or two
  ``[M, F]``."""
  r, c0, mask = _tile(m, f, bm, bf)
  _, da, db = glu_math(kind, beta, beta_lin, _load(a_ref, r, c0, bf, mask),
                       _load(b_ref, r, c0 + b_off, bf, mask), exp=tm.exp)
  g = _load(g_ref, r, c0, bf, mask)
  da_ref, db_ref = d_refs[0], d_refs[-1]
  db_off = f if len(d_refs) == 1 else 0
  plgpu.store(da_ref.at[r, pl.ds(c0, bf)], (g * da).astype(da_ref.dtype), mask=mask)
  plgpu.store(db_ref.at[r, pl.ds(c0 + db_off, bf)], (g * db).astype(db_ref.dtype), mask=mask)


def _call(kernel, a, b, f: int, b_off: int, args, widths, *, kind, beta, beta_lin, name, config):
  """``kernel`` over the gate columns ``[0, F)`` of ``a`` and the up columns ``[b_off, b_off +
  F)`` of ``b`` (``[..., *]``; the same array when packed), with ``args [..., F]`` -> one
  ``[..., w]`` array of a's dtype per width in ``widths``, tiled by ``config``."""
  lead = a.shape[:-1]
  a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
  m = a.shape[0]
  bm, bf = config.block_m, min(config.block_f, pl.next_power_of_2(f))
  kern = functools.partial(kernel, m=m, f=f, bm=bm, bf=bf, b_off=b_off, kind=kind,
                           beta=float(beta), beta_lin=float(beta_lin))
  outs = pl.pallas_call(
      kern, out_shape=[jax.ShapeDtypeStruct((m, w), a.dtype) for w in widths],
      grid=(pl.cdiv(m, bm), pl.cdiv(f, bf)),
      compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=1),
      interpret=_interpret(), name=name,
  )(a, b, *(x.reshape(m, f) for x in args))
  return [o.reshape(*lead, o.shape[-1]) for o in outs]


def glu_fwd(gu, f: int, kind: str, beta: float, beta_lin: float, config: Config = Config()):
  """``h [..., F]`` of the gate and up columns ``[0, 2F)`` of ``gu [..., W]``."""
  return _call(_fwd_kernel, gu, gu, f, f, (), (f,), kind=kind, beta=beta, beta_lin=beta_lin,
               name="glu_fwd", config=config)[0]


def glu_bwd(gu, g, f: int, kind: str, beta: float, beta_lin: float, config: Config = Config()):
  """``d gu [..., 2F]`` of the columns ``[0, 2F)`` of ``gu [..., W]`` for the cotangent ``g
  [..., F]``."""
  return _call(_bwd_kernel, gu, gu, f, f, (g,), (2 * f,), kind=kind, beta=beta,
               beta_lin=beta_lin, name="glu_bwd", config=config)[0]


def glu_pair_fwd(a, b, kind: str, beta: float, beta_lin: float, config: Config = Config()):
  """``h [..., F]`` of the gate ``a`` and up ``b`` ``[..., F]`` (two arrays)."""
  f = a.shape[-1]
  return _call(_fwd_kernel, a, b, f, 0, (), (f,), kind=kind, beta=beta, beta_lin=beta_lin,
               name="glu_pair_fwd", config=config)[0]


def glu_pair_bwd(a, b, g, kind: str, beta: float, beta_lin: float,
                 config: Config = Config()):
  """``(d a, d b)`` ``[..., F]`` for the cotangent ``g [..., F]``."""
  f = a.shape[-1]
  da, db = _call(_bwd_kernel, a, b, f, 0, (g,), (f, f), kind=kind, beta=beta, beta_lin=beta_lin,
                 name="glu_pair_bwd", config=config)
  return da, db
