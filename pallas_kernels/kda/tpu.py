"""Chunked Kimi Delta Attention in Pallas Mosaic TPU (SPEC section 2), forward and backward.

Layout: the wrapper moves heads before time (``[B, H, T, D]``) so that one grid step
``(b, value head, chunk)`` reads ``[C, D]`` blocks; query/key blocks are indexed by
``value head // (HV // H)`` (grouped values without copies). The state is carried transposed,
``S^T [V, K]`` float32, in VMEM scratch across the sequential chunk axis.

One function, :func:`_chunk`, is the whole per-chunk computation from the raw inputs (optional
L2 norm, gate from ``f + dt_bias`` and ``A_log``, beta sigmoid: fused, so the layer never writes
them to memory) to the chunk output and the outgoing state. The forward kernel runs it and stores
each chunk's incoming state. The backward kernel walks the chunks in reverse, recomputes the chunk
from its stored incoming state and applies ``jax.vjp`` of :func:`_chunk` inside the kernel,
carrying the state cotangent in VMEM; so the gradients of q, k, v, f, beta, ``A_log``, ``dt_bias``
and the initial state are exactly those of the forward maths.

Chunk maths (C tokens, 16-token sub-tiles, only ``exp`` of non-positive numbers except the
bounded fast path below):
  - per-tile local cumulative decay ``Gl`` and the prefix before each tile ``Gr`` (``G = Gr + Gl``),
    and the suffix ``sum_{t > j} g_t`` for the outgoing state, each as a 0/1 matrix product;
  - ``k_i . k_j exp(G_i - G_j)`` row tile by row tile through the reference point ``r_I`` (the
    decay just before tile I): ``(k e^(Gl))_i . (k e^(r_I - G))_j``. Columns before the tile give
    exponents <= 0. Bounded gate (``g >= lower_bound >= -5``): the diagonal 16x16 tile is included
    in the same dense product, its exponents ``r_I - G_j <= 16 * 5 = 80`` stay in float32 range.
    Other gates: the diagonal tile is built from per-pair exponents ``min(Gl_i - Gl_j, 0)``, one
    column offset at a time for all tiles together (16 steps);
  - ``(I + diag(beta) A)^-1`` by forward substitution on the 16x16 diagonal blocks (all tiles at
    once) and block substitution for the rest;
  - ``V' = U - W S``, ``O = scale (Q e^G) S + scale mask(QK decay) V'``,
    ``S^T <- e^(G_C) S^T + V'^T (K e^(G_C - G))``.
Segments: local segment ids per chunk (restarts counted from the chunk start); pair matrices are
masked to same-segment pairs, only local segment 0 reads the carried state, only the last local
segment writes the outgoing state. Padding: T is padded to a multiple of C; tokens past T get
``g = 0, beta = 0`` inside the kernel (k, q, v are zero-padded), so they change nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import default_backend
from pallas_kernels.kda.reference import L2_EPS, SUB_TILE, pad_time, restart_mask

HEAD_DIMS = (64, 128)
_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
_NEG = -1e30  # exponent of masked-out entries: exp gives exactly 0 (and a zero gradient)
FAST_PATH_MAX_EXPONENT = 80.0  # exp(80) ~ 5.5e34 < float32 max


class Config(NamedTuple):
  """Static kernel configuration (hashable)."""
  chunk: int
  t: int  # valid tokens per row
  groups: int  # HV // H
  scale: float
  l2: bool
  gate: str | None
  lower_bound: float
  beta_logit: bool
  fast: bool  # bounded-gate dense diagonal tiles
  interpret: bool  # TPU interpret mode (off TPU)


def _mm(a, b):
  return jnp.dot(a, b, precision=_HI, preferred_element_type=_F32)


def _mm_nt(a, b):  # a [M, D] . b [N, D]^T
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                             preferred_element_type=_F32)


def _mm_tn(a, b):  # a [D, M]^T . b [D, N]
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HI,
                             preferred_element_type=_F32)


def _softplus(x):
  return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _prepare(q, k, f, b, a_log, dtb, valid, cfg):
  """In-kernel pre-processing: [C, K] q, k, f; [C, 1] b; [1, K] a_log, dtb; [C, 1] valid."""
  if cfg.l2:
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2_EPS)
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2_EPS)
  if cfg.gate == "softplus":
    g = -jnp.exp(a_log) * _softplus(f + dtb)
  elif cfg.gate == "bounded":
    g = cfg.lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * (f + dtb))
  else:
    g = f
  beta = jax.nn.sigmoid(b) if cfg.beta_logit else b
  return q, k, jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)


def _chunk(q, k, v, f, b, a_log, dtb, st, seg_col, seg_row, valid, cfg):
  """One chunk. q, k, f: [C, K]; v: [C, V]; b: [C, 1]; a_log, dtb: [1, K]; st: S^T [V, K];
  seg_col [C, 1], seg_row [1, C] local segment ids; valid [C, 1]. All float32 except the ids.
  Returns (o [C, V], outgoing S^T [V, K])."""
  c, sub = cfg.chunk, SUB_TILE
  n_tiles = c // sub
  q, k, g, beta = _prepare(q, k, f, b, a_log, dtb, valid, cfg)
  row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  sub32 = jnp.int32(sub)  # lax.div wants equal dtypes (a Python int is int64 under x64)
  rt, ct = jax.lax.div(row, sub32), jax.lax.div(col, sub32)  # (indices >= 0: no floor-div signs)
  row_k = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0)

  gl = _mm(((rt == ct) & (col <= row)).astype(_F32), g)  # decay from the tile start, inclusive
  gr = _mm((col < rt * sub).astype(_F32), g)  # decay before the tile
  gsum = _mm((col > row).astype(_F32), g)  # decay after the token, to the chunk end
  G = gr + gl
  g_end = jnp.sum(g, axis=0, keepdims=True)  # [1, K]

  def products(lhs):
    """For each a in ``lhs``: [C, C] ``a_i . k_j exp(G_i - G_j)`` on and below the diagonal
    (garbage above). The key-side factors are shared by all of ``lhs``."""
    lefts = [a * jnp.exp(gl) for a in lhs]
    outs = [jnp.zeros((c, c), _F32) for _ in lhs]
    for i in range(n_tiles):
      limit = (i + 1) * sub if cfg.fast else i * sub
      if limit == 0:
        continue
      ref = jnp.sum(jnp.where(row_k == i * sub, gr, 0.0), axis=0, keepdims=True)  # r_I [1, K]
      right = k * jnp.exp(jnp.where(row_k < limit, ref - G, _NEG))
      outs = [o + jnp.where(rt == i, _mm_nt(left, right), 0.0) for o, left in zip(outs, lefts)]
    if not cfg.fast:
      for j in range(sub):  # diagonal tiles: column offset j of every tile at once
        sel = col == rt * sub + j
        sel_f = sel.astype(_F32)
        partner, g_partner = _mm(sel_f, k), _mm(sel_f, gl)
        decay = partner * jnp.exp(jnp.minimum(gl - g_partner, 0.0))
        outs = [o + jnp.where(sel, jnp.sum(a * decay, axis=-1, keepdims=True), 0.0)
                for o, a in zip(outs, lhs)]
    return outs

  same = seg_col == seg_row
  last_seg = jnp.max(seg_col)
  fresh = (seg_col == 0).astype(_F32)  # reads the carried state
  last = (seg_col == last_seg).astype(_F32)  # writes the outgoing state
  keep = (last_seg == 0).astype(_F32)  # the carried state survives the chunk
  p_kk, p_qk = products([k, q])
  a_kk = jnp.where((col < row) & same, p_kk, 0.0)
  a_qk = jnp.where((col <= row) & same, p_qk, 0.0)

  # (I + diag(beta) A_kk)^-1: forward substitution inside the diagonal blocks, then block rows.
  lb = beta * a_kk
  eye = (row == col).astype(_F32)
  lb_diag = jnp.where(rt == ct, lb, 0.0)
  inv = eye
  for i in range(sub):
    inv = jnp.where(row - rt * sub == i, eye - _mm(lb_diag, inv), inv)
  for i in range(1, n_tiles):
    x = _mm(jnp.where((rt == i) & (ct < i), lb, 0.0), inv)
    inv = inv - _mm(jnp.where((rt == i) & (ct == i), inv, 0.0), x)

  eg = jnp.exp(G)
  u = _mm(inv, beta * v)
  w = _mm(inv, beta * k * eg * fresh)
  vp = u - _mm_nt(w, st)
  o = cfg.scale * (_mm_nt(q * eg * fresh, st) + _mm(a_qk, vp))
  st = st * (jnp.exp(g_end) * keep) + _mm_tn(vp, k * jnp.exp(gsum) * last)
  return o, st


def _valid(n, cfg):
  pos = n * cfg.chunk + jax.lax.broadcasted_iota(jnp.int32, (cfg.chunk, 1), 0)
  return pos < cfg.t


def _fwd_kernel(q_ref, k_ref, v_ref, f_ref, b_ref, a_ref, dtb_ref, sc_ref, sr_ref, s0_ref,
                o_ref, sfin_ref, *rest, cfg, n_chunks, save):
  states_ref, st_scr = rest if save else (None, rest[0])
  n = pl.program_id(2)

  @pl.when(n == 0)
  def _():
    st_scr[...] = s0_ref[...]

  if save:
    states_ref[...] = st_scr[...]
  o, st = _chunk(q_ref[...].astype(_F32), k_ref[...].astype(_F32), v_ref[...].astype(_F32),
                 f_ref[...].astype(_F32), b_ref[...].astype(_F32), a_ref[...], dtb_ref[...],
                 st_scr[...], sc_ref[...], sr_ref[...], _valid(n, cfg), cfg)
  o_ref[...] = o.astype(o_ref.dtype)
  st_scr[...] = st

  @pl.when(n == n_chunks - 1)
  def _():
    sfin_ref[...] = st


def _bwd_kernel(q_ref, k_ref, v_ref, f_ref, b_ref, a_ref, dtb_ref, sc_ref, sr_ref, states_ref,
                do_ref, dsfin_ref, dq_ref, dk_ref, dv_ref, df_ref, db_ref, da_ref, ddtb_ref,
                ds0_ref, dst_scr, *, cfg, n_chunks):
  i = pl.program_id(2)

  @pl.when(i == 0)
  def _():
    dst_scr[...] = dsfin_ref[...]

  seg_col, seg_row, valid = sc_ref[...], sr_ref[...], _valid(n_chunks - 1 - i, cfg)

  def chunk(q, k, v, f, b, a_log, dtb, st):
    return _chunk(q, k, v, f, b, a_log, dtb, st, seg_col, seg_row, valid, cfg)

  primals = (q_ref[...].astype(_F32), k_ref[...].astype(_F32), v_ref[...].astype(_F32),
             f_ref[...].astype(_F32), b_ref[...].astype(_F32), a_ref[...], dtb_ref[...],
             states_ref[...])
  _, vjp = jax.vjp(chunk, *primals)
  dq, dk, dv, df, db, da, ddtb, dst = vjp((do_ref[...].astype(_F32), dst_scr[...]))
  for ref, val in ((dq_ref, dq), (dk_ref, dk), (dv_ref, dv), (df_ref, df), (db_ref, db),
                   (da_ref, da), (ddtb_ref, ddtb)):
    ref[...] = val.astype(ref.dtype)
  dst_scr[...] = dst

  @pl.when(i == n_chunks - 1)
  def _():
    ds0_ref[...] = dst


def _interpret(cfg):
  return pltpu.InterpretParams() if cfg.interpret else False


def _in_specs(cfg, kd, vd, n_chunks, reverse):
  """Block specs of (q, k, v, f, b, a_log, dt_bias, seg_col, seg_row) over grid (B, HV, N)."""
  c, grp = cfg.chunk, cfg.groups
  ch = (lambda n: n_chunks - 1 - n) if reverse else (lambda n: n)
  qk = pl.BlockSpec((None, None, c, kd), lambda b, h, n: (b, jax.lax.div(h, jnp.int32(grp)), ch(n), 0))
  return [qk, qk,
          pl.BlockSpec((None, None, c, vd), lambda b, h, n: (b, h, ch(n), 0)),
          pl.BlockSpec((None, None, c, kd), lambda b, h, n: (b, h, ch(n), 0)),
          pl.BlockSpec((None, None, c, 1), lambda b, h, n: (b, h, ch(n), 0)),
          pl.BlockSpec((None, 1, kd), lambda b, h, n: (h, 0, 0)),
          pl.BlockSpec((None, 1, kd), lambda b, h, n: (h, 0, 0)),
          pl.BlockSpec((None, c, 1), lambda b, h, n: (b, ch(n), 0)),
          pl.BlockSpec((None, None, 1, c), lambda b, h, n: (b, ch(n), 0, 0))]


def _params():
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _forward(cfg, q, k, v, f, b, a_log, dtb, s0t, seg_col, seg_row, save):
  bsz, hv, tp, vd = v.shape
  kd = q.shape[-1]
  n_chunks = tp // cfg.chunk
  state = pl.BlockSpec((None, None, vd, kd), lambda b, h, n: (b, h, 0, 0))
  out_specs = [pl.BlockSpec((None, None, cfg.chunk, vd), lambda b, h, n: (b, h, n, 0)), state]
  out_shape = [jax.ShapeDtypeStruct((bsz, hv, tp, vd), v.dtype),
               jax.ShapeDtypeStruct((bsz, hv, vd, kd), _F32)]
  if save:
    out_specs.append(pl.BlockSpec((None, None, None, vd, kd), lambda b, h, n: (b, h, n, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((bsz, hv, n_chunks, vd, kd), _F32))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, n_chunks=n_chunks, save=save),
      grid=(bsz, hv, n_chunks),
      in_specs=_in_specs(cfg, kd, vd, n_chunks, reverse=False) + [state],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((vd, kd), _F32)],
      compiler_params=_params(), interpret=_interpret(cfg),
  )(q, k, v, f, b, a_log, dtb, seg_col, seg_row, s0t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, f, b, a_log, dtb, s0t, seg_col, seg_row):
  """q, k: [B, H, Tp, K]; v: [B, HV, Tp, V]; f: [B, HV, Tp, K]; b: [B, HV, Tp, 1];
  a_log, dtb: [HV, 1, K] float32; s0t: [B, HV, V, K] float32; seg_col [B, Tp, 1];
  seg_row [B, N, 1, C]. Returns (o [B, HV, Tp, V], final S^T [B, HV, V, K] float32)."""
  o, sfin = _forward(cfg, q, k, v, f, b, a_log, dtb, s0t, seg_col, seg_row, save=False)
  return o, sfin


def _core_fwd(cfg, q, k, v, f, b, a_log, dtb, s0t, seg_col, seg_row):
  o, sfin, states = _forward(cfg, q, k, v, f, b, a_log, dtb, s0t, seg_col, seg_row, save=True)
  return (o, sfin), (q, k, v, f, b, a_log, dtb, seg_col, seg_row, states)


def _core_bwd(cfg, res, cts):
  q, k, v, f, b, a_log, dtb, seg_col, seg_row, states = res
  do, dsfin = cts
  bsz, hv, tp, vd = v.shape
  kd = q.shape[-1]
  c, n_chunks = cfg.chunk, tp // cfg.chunk

  def per_chunk(*block):  # blocks of chunk N-1-n at grid step n
    return pl.BlockSpec((None, None) + block,
                        lambda b, h, n: (b, h, n_chunks - 1 - n) + (0,) * (len(block) - 1))

  def f32(*shape):
    return jax.ShapeDtypeStruct(shape, _F32)

  state = pl.BlockSpec((None, None, vd, kd), lambda b, h, n: (b, h, 0, 0))
  row = per_chunk(None, 1, kd)
  dq, dk, dv, df, db, da, ddtb, ds0t = pl.pallas_call(
      functools.partial(_bwd_kernel, cfg=cfg, n_chunks=n_chunks),
      grid=(bsz, hv, n_chunks),
      in_specs=_in_specs(cfg, kd, vd, n_chunks, reverse=True) + [
          per_chunk(None, vd, kd), per_chunk(c, vd), state],
      out_specs=[per_chunk(c, kd), per_chunk(c, kd), per_chunk(c, vd), per_chunk(c, kd),
                 per_chunk(c, 1), row, row, state],
      out_shape=[f32(bsz, hv, tp, kd), f32(bsz, hv, tp, kd), f32(bsz, hv, tp, vd),
                 f32(bsz, hv, tp, kd), f32(bsz, hv, tp, 1), f32(bsz, hv, n_chunks, 1, kd),
                 f32(bsz, hv, n_chunks, 1, kd), f32(bsz, hv, vd, kd)],
      scratch_shapes=[pltpu.VMEM((vd, kd), _F32)],
      compiler_params=_params(), interpret=_interpret(cfg),
  )(q, k, v, f, b, a_log, dtb, seg_col, seg_row, states, do, dsfin)

  def group(x):  # [B, HV, Tp, K] -> [B, H, Tp, K]: sum over the value heads of a key head
    return x.reshape(bsz, hv // cfg.groups, cfg.groups, tp, kd).sum(2)

  return (group(dq).astype(q.dtype), group(dk).astype(k.dtype), dv.astype(v.dtype),
          df.astype(f.dtype), db.astype(b.dtype), da.sum((0, 2)), ddtb.sum((0, 2)), ds0t,
          None, None)


_core.defvjp(_core_fwd, _core_bwd)


def kda(q, k, v, g, beta, *, scale, initial_state, segment_ids, use_qk_l2norm, A_log, dt_bias,
        gate, lower_bound, beta_is_logit, chunk_size, interpret=None):
  """Pallas TPU KDA; arguments as :func:`pallas_kernels.kda.kda` (g is the raw gate input f when
  ``gate`` is set). Returns ``(o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] float32)``.
  ``interpret`` defaults to True off TPU (pass False to lower for TPU from another platform)."""
  bsz, t, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  if kd not in HEAD_DIMS or vd not in HEAD_DIMS:
    raise ValueError(f"kda (pallas_tpu): head dims must be in {HEAD_DIMS}, got K={kd}, V={vd}")
  if hv % h:
    raise ValueError(f"kda (pallas_tpu): value heads {hv} must be a multiple of key heads {h}")
  if chunk_size <= 0 or chunk_size % SUB_TILE:
    raise ValueError(f"kda (pallas_tpu): chunk_size {chunk_size} must be a positive multiple of "
                     f"{SUB_TILE}")
  if gate is not None and (A_log is None or dt_bias is None):
    raise ValueError(f"kda (pallas_tpu): gate={gate!r} needs A_log and dt_bias")
  if gate not in (None, "bounded", "softplus"):
    raise ValueError(f"kda (pallas_tpu): unknown gate {gate!r}")
  fast = gate == "bounded" and -lower_bound * SUB_TILE <= FAST_PATH_MAX_EXPONENT
  cfg = Config(chunk=chunk_size, t=t, groups=hv // h, scale=float(scale), l2=bool(use_qk_l2norm),
               gate=gate, lower_bound=float(lower_bound), beta_logit=bool(beta_is_logit),
               fast=fast,
               interpret=default_backend() != "tpu" if interpret is None else bool(interpret))
  c = chunk_size

  def heads_first(x):  # [B, T, H, D] -> [B, H, Tp, D]
    return jnp.swapaxes(pad_time(x, c), 1, 2)

  restart = pad_time(restart_mask(segment_ids, bsz, t), c)
  n_chunks = restart.shape[1] // c
  seg = jnp.cumsum(restart.reshape(bsz, n_chunks, c), axis=-1, dtype=jnp.int32)
  if gate is None:
    a_log = dtb = jnp.zeros((hv, 1, kd), _F32)
  else:
    a_log = jnp.broadcast_to(A_log.astype(_F32).reshape(hv, 1, 1), (hv, 1, kd))
    dtb = dt_bias.astype(_F32).reshape(hv, 1, kd)
  s0t = (jnp.zeros((bsz, hv, vd, kd), _F32) if initial_state is None
         else jnp.swapaxes(initial_state.astype(_F32), 2, 3))
  o, sfin = _core(cfg, heads_first(q), heads_first(k), heads_first(v), heads_first(g),
                  heads_first(beta[..., None]), a_log, dtb, s0t,
                  seg.reshape(bsz, n_chunks * c, 1), seg.reshape(bsz, n_chunks, 1, c))
  return jnp.swapaxes(o, 1, 2)[:, :t], jnp.swapaxes(sfin, 2, 3)
