"""Causal depthwise short conv + SiLU as Triton kernels through Pallas (interpret mode off GPU).

Both kernels walk rows: a program takes ``rows`` rows of one batch row and ``bc`` channels and
steps through the rows one at a time, carrying the W-1 previous rows of x (and their document
ids) in registers, so every row of x, dy, y and dx is loaded or stored once per program (plus
W-1 halo rows at each end) and each row's ``z`` is formed once. Loads of ``unroll`` rows are
issued together ahead of their use.

Forward: ``y[u] = silu(z[u])``, ``z[u] = sum_j w[j] x[u-(W-1-j)]`` (taps reading rows before 0 or
in another document read zeros). Nothing is saved but x.

Backward, one pass: walking rows ``u = r0 .. r0+rows+W-2`` it forms ``dz[u] = dy[u] silu'(z[u])``
and, W-1 rows behind, ``dx[v] = sum_e w[W-1-e] dz[v+e]`` for ``v = u-(W-1)`` from the carried dz;
``dw[j] = sum_u x[u-(W-1-j)] dz[u]`` over the program's own rows is kept in float32 registers
and written as partials ``[num_programs_T * B, W, C]`` summed outside the kernel.

Row indices are clamped into ``[0, T)`` and the loads masked (interpret mode shifts dynamic
slices that start before 0, and a negative start would break 64-bit offsets).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend, triton_math as tm


@dataclasses.dataclass(frozen=True)
class Config:
  """Rows ``rows`` x channels ``bc`` per program, ``warps`` warps, loads issued ``unroll`` rows
  at a time; ``bwd_*`` the same for the backward. Defaults: the fastest of
  ``benchmarks/conv.py``'s sweep on an H200 (benchmarks/RESULTS.md, "Short convolutions", run 2)."""
  rows: int = 64
  bc: int = 256
  warps: int = 2
  unroll: int = 4
  bwd_rows: int = 64
  bwd_bc: int = 256
  bwd_warps: int = 2
  bwd_unroll: int = 4


def _interpret() -> bool:
  return default_backend() != "gpu"


def _block(n: int, cap: int) -> int:
  """A power-of-two tile size covering ``n`` up to ``cap`` (at least 16)."""
  return max(16, min(cap, pl.next_power_of_2(n)))


def _taps(w_ref, cols, col_ok, width):
  """The W rows of w at ``cols [bc]`` as float32 ``[bc]`` (zeros past C)."""
  masked = {} if col_ok is None else {"mask": col_ok, "other": 0}
  return [plgpu.load(w_ref.at[jnp.int32(k), cols], **masked).astype(jnp.float32)
          for k in range(width)]


class _Row:
  """Loads and stores of single rows ``[bc]`` of batch row b (trace-time helper)."""

  def __init__(self, seg_ref, b, c0, t, c, bc):
    self.seg_ref, self.b, self.t, self.c0, self.bc = seg_ref, b, t, c0, bc
    self.cols = c0 + jnp.arange(bc, dtype=jnp.int32)
    self.col_ok = self.cols < c if c % bc else None  # None: C is a multiple of the tile

  def _mask(self, ok):
    return jnp.broadcast_to(ok, self.cols.shape) if self.col_ok is None else ok & self.col_ok

  def load(self, ref, u):
    """``ref[b, u, cols]`` as float32 ``[bc]``, zeros where u < 0 or u >= T."""
    ok = (u >= 0) & (u < self.t)
    row = plgpu.load(ref.at[self.b, jnp.clip(u, 0, self.t - 1), self.cols], mask=self._mask(ok),
                     other=0)
    return row.astype(jnp.float32)

  def seg(self, u):
    """The document of row u (clamped into [0, T): rows outside read zeros anyway), or None."""
    return None if self.seg_ref is None else self.seg_ref[self.b, jnp.clip(u, 0, self.t - 1)]

  def store(self, ref, u, val):
    ok = u < self.t
    plgpu.store(ref.at[self.b, jnp.minimum(u, self.t - 1), pl.ds(self.c0, self.bc)],
                val.astype(ref.dtype), mask=self._mask(ok))


def _same(val, s_a, s_b):
  """``val`` where rows a and b are in one document (always without segment ids), else 0."""
  return val if s_a is None else jnp.where(s_a == s_b, val, 0.0)


def _z(taps, xw, sw):
  """z at the last row of the window: x rows ``xw`` (W of them, oldest first), ids ``sw``."""
  width = len(taps)
  z = taps[width - 1] * xw[-1]
  for s in range(1, width):
    z = z + taps[width - 1 - s] * _same(xw[-1 - s], sw[-1 - s], sw[-1])
  return z


def _fwd_kernel(x_ref, w_ref, *refs, t, c, width, rows, bc, unroll, segmented):
  seg_ref, y_ref = refs if segmented else (None, *refs)
  i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  io = _Row(seg_ref, b, j * bc, t, c, bc)
  taps = _taps(w_ref, io.cols, io.col_ok, width)
  r0 = i * rows
  halo = [r0 - (width - 1) + k for k in range(width - 1)]

  def group(g, carry):
    xw, sw = list(carry[0]), list(carry[1])
    u0 = r0 + g * unroll
    xs = [io.load(x_ref, u0 + q) for q in range(unroll)]
    ss = [io.seg(u0 + q) for q in range(unroll)]
    for q in range(unroll):
      xw, sw = xw + [xs[q]], sw + [ss[q]]
      io.store(y_ref, u0 + q, tm.silu(_z(taps, xw, sw)))
      xw, sw = xw[1:], sw[1:]
    return tuple(xw), tuple(sw)

  jax.lax.fori_loop(0, rows // unroll, group,
                    (tuple(io.load(x_ref, u) for u in halo), tuple(io.seg(u) for u in halo)))


def _bwd_kernel(x_ref, w_ref, dy_ref, *refs, t, c, width, rows, bc, unroll, nb, segmented):
  seg_ref, dx_ref, dw_ref = refs if segmented else (None, *refs)
  i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  io = _Row(seg_ref, b, j * bc, t, c, bc)
  taps = _taps(w_ref, io.cols, io.col_ok, width)
  r0 = i * rows
  own_end = jnp.minimum(r0 + rows, t)

  def dz_row(u, xw, sw, dws):
    """dz at row u (the x window ``xw`` ends at row u) and the dw terms with row u's."""
    z = _z(taps, xw, sw)
    sg = tm.sigmoid(z)
    dz = io.load(dy_ref, u) * (sg * (1.0 + z * (1.0 - sg)))
    own = jnp.where(u < own_end, dz, 0.0)  # dw counts the program's own rows only
    return dz, [dws[k] + _same(xw[k], sw[k], sw[-1]) * own for k in range(width)]

  xw = [io.load(x_ref, r0 - (width - 1) + k) for k in range(2 * width - 2)]
  sw = [io.seg(r0 - (width - 1) + k) for k in range(2 * width - 2)]
  dws, dzw = [jnp.zeros((bc,), jnp.float32)] * width, []
  for k in range(width - 1):  # dz of rows r0 .. r0+W-2: no dx row is complete yet
    dz, dws = dz_row(r0 + k, xw[k:k + width], sw[k:k + width], dws)
    dzw.append(dz)

  def group(g, carry):
    xw, sw, dzw, dws = (list(v) for v in carry)
    u0 = r0 + width - 1 + g * unroll
    xs = [io.load(x_ref, u0 + q) for q in range(unroll)]
    ss = [io.seg(u0 + q) for q in range(unroll)]
    for q in range(unroll):
      xw, sw = xw + [xs[q]], sw + [ss[q]]
      dz, dws = dz_row(u0 + q, xw, sw, dws)
      dzw = dzw + [dz]  # rows v .. v+W-1, v = u0+q-(W-1)
      dx = taps[width - 1] * dzw[0]
      for e in range(1, width):
        dx = dx + taps[width - 1 - e] * _same(dzw[e], sw[e], sw[0])
      io.store(dx_ref, u0 + q - (width - 1), dx)
      xw, sw, dzw = xw[1:], sw[1:], dzw[1:]
    return tuple(xw), tuple(sw), tuple(dzw), tuple(dws)

  carry = (tuple(xw[width - 1:]), tuple(sw[width - 1:]), tuple(dzw), tuple(dws))
  dws = jax.lax.fori_loop(0, rows // unroll, group, carry)[3]
  for k in range(width):
    plgpu.store(dw_ref.at[i * nb + b, jnp.int32(k), pl.ds(j * bc, bc)], dws[k], mask=io.col_ok)


def _grid(n, blk):
  return -(-n // blk)


def _tiling(t, c, rows, bc, unroll):
  """(rows per program: a multiple of ``unroll``, channels per program)."""
  rows = _grid(_block(t, rows), unroll) * unroll
  return rows, _block(c, bc)


def _forward(cfg: Config, x, w, seg):
  bsz, t, c = x.shape
  width = w.shape[0]
  rows, bc = _tiling(t, c, cfg.rows, cfg.bc, cfg.unroll)
  kern = functools.partial(_fwd_kernel, t=t, c=c, width=width, rows=rows, bc=bc,
                           unroll=cfg.unroll, segmented=seg is not None)
  return pl.pallas_call(
      kern, grid=(_grid(t, rows), _grid(c, bc), bsz),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=1),
      name="conv_silu_fwd")(x, w, *(() if seg is None else (seg,)))


def _backward(cfg: Config, x, w, seg, dy):
  """(dx in x.dtype, dw float32 ``[W, C]``)."""
  bsz, t, c = x.shape
  width = w.shape[0]
  rows, bc = _tiling(t, c, cfg.bwd_rows, cfg.bwd_bc, cfg.bwd_unroll)
  nt = _grid(t, rows)
  kern = functools.partial(_bwd_kernel, t=t, c=c, width=width, rows=rows, bc=bc,
                           unroll=cfg.bwd_unroll, nb=bsz, segmented=seg is not None)
  dx, dw = pl.pallas_call(
      kern, grid=(nt, _grid(c, bc), bsz),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((nt * bsz, width, c), jnp.float32)),
      interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.bwd_warps, num_stages=1),
      name="conv_silu_bwd")(x, w, dy, *(() if seg is None else (seg,)))
  return dx, jnp.sum(dw, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(cfg, x, w, seg):
  return _forward(cfg, x, w, seg)


def _conv_fwd(cfg, x, w, seg):
  return _forward(cfg, x, w, seg), (x, w, seg)


def _conv_bwd(cfg, res, dy):
  x, w, seg = res
  dx, dw = _backward(cfg, x, w, seg, dy)
  return dx, dw.astype(w.dtype), None


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv_silu(x, w, segment_ids=None, config: Config = Config()):
  """See :func:`pallas_kernels.conv.causal_conv_silu` (shapes checked there).

  x: ``[B, T, C]``, w: ``[W, C]``, segment_ids: ``[B, T]`` or None. Returns y ``[B, T, C]``."""
  seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
  return _conv(config, x, w, seg)
