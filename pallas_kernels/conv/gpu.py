"""Causal depthwise short conv + SiLU as Triton kernels through Pallas (interpret mode off GPU).

Forward: one program per (T block, C block, batch row) loads its ``[BT, BC]`` tile of x at the W
row offsets ``0, -1, .., -(W-1)`` (masked loads: rows before 0, past T, or in another document
read zeros), accumulates ``z`` in float32 and stores ``silu(z)``. Nothing is saved but x.

Backward, one pass: a program walks ``steps`` row blocks of ``BT`` rows. For each block it
recomputes ``z`` at rows ``t .. t+W-1`` from x at offsets ``-(W-1) .. W-1``, forms
``dz = dy * silu'(z)``, and writes ``dx[t] = sum_e w[W-1-e] dz[t+e]`` (masked like the forward's
taps); the per-program ``dw[j] = sum_t x[t-(W-1-j)] dz[t]`` is kept in float32 registers and
written as partials ``[num_programs_T * B, W, C]`` summed outside the kernel.

Row offsets are gathers with indices clamped into ``[0, T)`` and the loads masked (interpret
mode shifts dynamic slices that start before 0, and a negative start would break 64-bit offsets).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles and warps. Forward: ``bt`` x ``bc`` tile per program, ``warps`` warps. Backward:
  ``bwd_bt`` x ``bwd_bc`` tiles, ``bwd_steps`` of them per program (fewer dw partials),
  ``bwd_warps`` warps. The backward holds x at 2W-1 row offsets, dy at W and their pointers.
  Defaults: the fastest of `benchmarks/conv.py`'s sweep on an H200 at x [16, 4096, 1024] bf16
  (2026-12-01: forward 32 x 128 0.129 ms against 0.151 at 64 x 128; backward 16 x 64 at 4 warps
  0.709 ms forward+backward against 0.857 at 16 x 128 and 8 warps)."""
  bt: int = 32
  bc: int = 128
  warps: int = 4
  bwd_bt: int = 16
  bwd_bc: int = 64
  bwd_steps: int = 8
  bwd_warps: int = 4
  stages: int = 1


def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def _block(n: int, cap: int) -> int:
  """A power-of-two tile size covering ``n`` up to ``cap`` (at least 16)."""
  return max(16, min(cap, pl.next_power_of_2(n)))


def _col_ok(cols, c, bc):
  """``[1, bc]``: channel < C, or None where C is a multiple of the tile."""
  return (cols < c)[None, :] if c % bc else None


def _taps(w_ref, cols, col_ok, width):
  """The W rows of w at ``cols [bc]`` as float32 ``[1, bc]`` (zeros past C)."""
  masked = {} if col_ok is None else {"mask": col_ok[0], "other": 0}
  return [plgpu.load(w_ref.at[jnp.int32(k), cols], **masked).astype(jnp.float32)[None, :]
          for k in range(width)]


class _Rows:
  """Masked loads of one ``[bt, bc]`` tile of batch row b at row offsets (trace-time helper).

  rows: ``[bt]`` token indices of the tile; cols: ``[bc]`` channel indices."""

  def __init__(self, seg_ref, b, rows, cols, t, c, bc):
    self.seg_ref, self.b, self.rows, self.cols, self.t = seg_ref, b, rows, cols, t
    self.col_ok = _col_ok(cols, c, bc)
    self._seg = {}

  def idx(self, d):
    return jnp.clip(self.rows + d, 0, self.t - 1)

  def in_range(self, d):
    """``[bt]``: 0 <= row + d < T."""
    u = self.rows + d
    return (u >= 0) & (u < self.t)

  def seg(self, d):
    if d not in self._seg:
      self._seg[d] = self.seg_ref[self.b, self.idx(d)]
    return self._seg[d]

  def tap_ok(self, e, s):
    """``[bt]``: output row ``row + e`` (< T) reads row ``row + e - s`` (>= 0, same document)."""
    ok = (self.rows + e < self.t) & (self.rows + e - s >= 0)
    if self.seg_ref is not None and s:
      ok = ok & (self.seg(e - s) == self.seg(e))
    return ok

  def load(self, ref, d, ok):
    """``ref[b, row + d, cols]`` as float32 ``[bt, bc]``, zeros where ``ok [bt]`` is False."""
    mask = ok[:, None] if self.col_ok is None else ok[:, None] & self.col_ok
    tile = plgpu.load(ref.at[self.b, self.idx(d)[:, None], self.cols[None, :]], mask=mask,
                      other=0)
    return tile.astype(jnp.float32)

  def store(self, ref, r0, c0, val, bt, bc):
    ok = (self.rows < self.t)[:, None]
    mask = ok if self.col_ok is None else ok & self.col_ok
    plgpu.store(ref.at[self.b, pl.ds(r0, bt), pl.ds(c0, bc)], val.astype(ref.dtype), mask=mask)


def _z(tile: _Rows, x, taps, e, width):
  """z at rows ``row + e`` (float32 ``[bt, bc]``); ``x(d)`` is x at row offset d, in range."""
  z = jnp.zeros((tile.rows.shape[0], tile.cols.shape[0]), jnp.float32)
  for j in range(width):
    s = width - 1 - j
    z = z + jnp.where(tile.tap_ok(e, s)[:, None], x(e - s), 0.0) * taps[j]
  return z


def _fwd_kernel(x_ref, w_ref, *refs, t, c, width, bt, bc, segmented):
  seg_ref, y_ref = refs if segmented else (None, *refs)
  i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = i * bt + jnp.arange(bt, dtype=jnp.int32)
  cols = j * bc + jnp.arange(bc, dtype=jnp.int32)
  tile = _Rows(seg_ref, b, rows, cols, t, c, bc)
  taps = _taps(w_ref, cols, tile.col_ok, width)
  z = _z(tile, lambda d: tile.load(x_ref, d, tile.in_range(d)), taps, 0, width)
  tile.store(y_ref, i * bt, j * bc, jax.nn.silu(z), bt, bc)


def _bwd_kernel(x_ref, w_ref, dy_ref, *refs, t, c, width, bt, bc, steps, nb, segmented):
  seg_ref, dx_ref, dw_ref = refs if segmented else (None, *refs)
  i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = j * bc + jnp.arange(bc, dtype=jnp.int32)
  col_ok = _col_ok(cols, c, bc)
  taps = _taps(w_ref, cols, col_ok, width)

  def step(k, dws):  # dws: W tiles [bt, bc] of dw terms, summed over rows after the loop
    r0 = (i * steps + k) * bt
    tile = _Rows(seg_ref, b, r0 + jnp.arange(bt, dtype=jnp.int32), cols, t, c, bc)
    xs = {}

    def x(d):
      if d not in xs:
        xs[d] = tile.load(x_ref, d, tile.in_range(d))
      return xs[d]

    dx = jnp.zeros((bt, bc), jnp.float32)
    dws = list(dws)
    for e in range(width):  # dz at rows row + e
      z = _z(tile, x, taps, e, width)
      sg = jax.nn.sigmoid(z)
      dz = tile.load(dy_ref, e, tile.in_range(e)) * (sg * (1.0 + z * (1.0 - sg)))
      if e == 0:
        for jj in range(width):
          s = width - 1 - jj
          dws[jj] = dws[jj] + jnp.where(tile.tap_ok(0, s)[:, None], x(-s), 0.0) * dz
      dx = dx + jnp.where(tile.tap_ok(e, e)[:, None], dz, 0.0) * taps[width - 1 - e]
    tile.store(dx_ref, r0, j * bc, dx, bt, bc)
    return tuple(dws)

  dws = jax.lax.fori_loop(0, steps, step, (jnp.zeros((bt, bc), jnp.float32),) * width)
  mask = None if col_ok is None else col_ok[0]
  for k in range(width):
    plgpu.store(dw_ref.at[i * nb + b, jnp.int32(k), pl.ds(j * bc, bc)], jnp.sum(dws[k], axis=0),
                mask=mask)


def _grid(n, blk):
  return -(-n // blk)


def _forward(cfg: Config, x, w, seg):
  bsz, t, c = x.shape
  width = w.shape[0]
  bt, bc = _block(t, cfg.bt), _block(c, cfg.bc)
  kern = functools.partial(_fwd_kernel, t=t, c=c, width=width, bt=bt, bc=bc,
                           segmented=seg is not None)
  return pl.pallas_call(
      kern, grid=(_grid(t, bt), _grid(c, bc), bsz),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
      name="conv_silu_fwd")(x, w, *(() if seg is None else (seg,)))


def _backward(cfg: Config, x, w, seg, dy):
  """(dx in x.dtype, dw float32 ``[W, C]``)."""
  bsz, t, c = x.shape
  width = w.shape[0]
  bt, bc = _block(t, cfg.bwd_bt), _block(c, cfg.bwd_bc)
  steps = min(cfg.bwd_steps, _grid(t, bt))
  nt = _grid(t, bt * steps)
  kern = functools.partial(_bwd_kernel, t=t, c=c, width=width, bt=bt, bc=bc, steps=steps,
                           nb=bsz, segmented=seg is not None)
  dx, dw = pl.pallas_call(
      kern, grid=(nt, _grid(c, bc), bsz),
      out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct((nt * bsz, width, c), jnp.float32)),
      interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.bwd_warps, num_stages=cfg.stages),
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
