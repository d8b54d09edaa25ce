"""Pallas GPU (Triton lowering) chunked Kimi Delta Attention with a custom VJP.

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``;
state ``[B, HV, K, V]`` float32; ``HV`` a multiple of ``H``.

The work is split the way it parallelises (SPEC section 2, chunks of C tokens):

1. Chunk-local work (parallel over (chunk, batch*value head)): the optional fused
   pre-processing (L2 norm, gate from ``f, A_log, dt_bias``, beta sigmoid), the in-chunk
   cumulative decay ``G``, the gated pair products, ``(I + A_kk)^-1`` and the factors
   ``W, U, QG = scale q e^G, A_qk, KD = k e^{G_C - G}, gC = e^{G_C}``. Segment restarts are
   folded in as masks, so the sequential pass has no branches. Two versions with the same
   results: the bounded gate's dense path (section 1b: the chunk as full [C, C] and
   [C, K-slice] tiles, every product a full matrix-unit product, split into the short kernels
   ``kda_chunk_a`` and ``kda_chunk_wu`` with intermediates in HBM) and ``_prep_kernel`` (any
   gate, section 1: 16-row tiles, diagonal tiles pair by pair, where the dense path does not
   apply).
2. ``_fwd_kernel`` (grid (B*HV, V tiles), sequential over chunks): the state tile ``S [K, BV]``
   stays in registers; per chunk ``V' = U - W S``, ``O = QG S + A_qk V'``,
   ``S = gC * S + KD^T V'``. On Hopper this pass and the backward's are Mosaic GPU kernels
   where they win (``recurrence_mgpu.py``, ``RECURRENCE``), and so is ``kda_chunk_wu``
   (``wu_mgpu.py``, ``CHUNK_WU``).
3. Backward: the chunk factors (the dense path also with ``P_kk``, ``k e^G`` and the inverse),
   the chunk states and V', kept by the forward (``save_residuals``, with ``_fwd_kernel``
   storing the states) or recomputed by steps 1 and 2 from the inputs; ``_bwd_kernel`` carries
   ``dS`` backwards and writes ``dV'`` and the state gradients; then, parallel over chunks, the
   gradients of the pre-processed inputs (dense path: ``kda_chunk_dwy`` for the WY factors,
   ``kda_chunk_dqkg`` per K slice for dq, dk, dg; other gates: ``_prep_bwd_kernel``); then
   the pre-processing's VJP, ``kda_prep_vjp`` (``prep_vjp.py``).

Sub-tile gating: a pair product ``sum_d a_id b_jd exp(G_id - G_jd)`` (i >= j) is split at a
reference ``r`` of the row block: ``(a e^{G - r}) (b e^{r - G})^T``. The general path takes
``r`` at the start of each 16-row tile (off-diagonal tiles have both factors <= 1) and forms the
diagonal tiles pair by pair. The bounded gate's dense path (``g > lower_bound``) takes ``r`` at
the middle row of blocks of ``diag_rows`` rows: every factor inside a block stays within
``e^{(diag_rows / 2) |lower_bound|} <= e^85`` (float32), so whole blocks are dense products
(32-row blocks for K3's lower bound -5).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend, num_sms
from pallas_kernels.kda import recurrence_mgpu, wu_mgpu
from pallas_kernels.kda.prep_vjp import preprocess_vjp
from pallas_kernels.kda.reference import L2_EPS, kda_gate, l2norm, restart_mask

SUB = 16  # sub-tile rows of the general path (its pair products and inverse blocks)
_MAX_EXP = 85.0  # largest exponent a dense diagonal block may need (float32 max ~ e^88)


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  chunk: int
  use_qk_l2norm: bool
  gate: str | None
  lower_bound: float
  beta_is_logit: bool
  diag_rows: int  # rows per reference block of the dense path (0: the general path)
  dtype: str  # matrix-unit operand dtype of the kernels
  save_residuals: bool = True  # the backward reuses the forward's intermediates


def _interpret() -> bool:
  return default_backend() != "gpu"


def _pow2(n: int) -> bool:
  return n >= 16 and n & (n - 1) == 0


def diag_rows(gate: str | None, lower_bound: float, chunk: int) -> int:
  """Rows per reference block of the bounded gate's dense path: the largest block (at most the
  chunk) whose middle-row reference keeps every exponent within ``_MAX_EXP``; 0 when even 16
  rows do not (or the gate is not bounded): then the general path."""
  if gate != "bounded":
    return 0
  return next((n for n in (64, 32, SUB) if n <= chunk and n / 2 * -lower_bound <= _MAX_EXP), 0)


def _v_tile(n_rows: int, vd: int) -> int:
  """V-tile width: enough (batch, head, tile) programs to fill ~132 SMs, at least 16 wide (twice
  the programs: 1.5x slower at B1 T16384 H32 on the H200; 8 warps instead of 4: 1.3x slower;
  2026-12-01). With 3 pipeline stages (2026-12-02, B1 T16384 H32: 32 wide) the forward takes
  0.47 ms, 0.80 at 16 wide, 0.56 at 64 wide."""
  bv = min(vd, 64)
  while bv > 16 and n_rows * (vd // bv) < 128:
    bv //= 2
  return bv


# ------------------------------------------------------------------------------------------
# 1. chunk-local work (Pallas, one program per (chunk, batch*value head))
# ------------------------------------------------------------------------------------------
# Triton cannot slice register tensors, so a chunk is handled as C/16 row tiles of 16 tokens,
# each loaded separately; [C, C] matrices are grids of 16x16 tiles (Python lists).

_HI = jax.lax.Precision.HIGHEST
# The gate gradient is a small difference of large terms: the backward's products keep ~16
# mantissa bits (three bf16 matrix-unit passes) instead of bf16's 8.
_X3 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3


def _mm(a, b, *, ta=False, tb=False, dt=None, precision=None):
  """``a @ b`` (optionally transposed operands) with float32 accumulation; ``dt`` casts the
  operands (bf16 for the matrix units)."""
  if dt is not None:
    a, b = a.astype(dt), b.astype(dt)
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def _row(t, j):
  """Row j ([K]) of a [16, K] tile (masked reduction: Triton has no register slicing)."""
  rid = jnp.arange(SUB)[:, None]
  return jnp.sum(jnp.where(rid == j, t, 0.0), axis=0)


class _Chunk:
  """The pre-processed row tiles of one chunk and its masks (trace-time helper).

  Per tile a: q, k [16, K] (L2-normalised if fused), G [16, K] (cumulative log decay from the
  chunk start), beta [16], seg [16]; r[a] [K] = G before tile a; gl [K] = G at the chunk end.
  """

  def __init__(self, cfg, refs, b, h, hq, c0, n, t):
    q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref = refs
    f32 = jnp.float32
    self.n = n
    self.q, self.k, self.G, self.beta, self.seg, self.r = [], [], [], [], [], []
    off = None
    for a in range(n):
      rows = pl.ds(c0 + a * SUB, SUB)
      q = q_ref[b, rows, hq, :].astype(f32)
      k = k_ref[b, rows, hq, :].astype(f32)
      if cfg.use_qk_l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2_EPS)
      g = g_ref[b, rows, h, :].astype(f32)
      if cfg.gate is not None:
        x = g + dtb_ref[h, :][None, :]
        e = jnp.exp(alog_ref[h])
        g = (cfg.lower_bound * jax.nn.sigmoid(e * x) if cfg.gate == "bounded"
             else -e * jax.nn.softplus(x))
      beta = beta_ref[b, rows, h].astype(f32)
      if cfg.beta_is_logit:
        beta = jax.nn.sigmoid(beta)
      valid = (c0 + a * SUB + jnp.arange(SUB)) < t  # padded tokens leave the state alone
      g = jnp.where(valid[:, None], g, 0.0)
      beta = jnp.where(valid, beta, 0.0)
      r = jnp.zeros((g.shape[1],), f32) if off is None else off
      G = jnp.cumsum(g, axis=0) + r[None, :]
      off = r + jnp.sum(g, axis=0)
      self.r.append(r)
      self.q.append(q)
      self.k.append(k)
      self.G.append(G)
      self.beta.append(beta)
      self.seg.append(seg_ref[b, rows])
    self.gl = off
    prev = seg_ref[b, jnp.maximum(c0 - 1, 0)]
    last = seg_ref[b, c0 + n * SUB - 1]
    self.cont = [(s == prev).astype(f32) for s in self.seg]  # continues the incoming state
    self.last = [(s == last).astype(f32) for s in self.seg]  # in the chunk's last segment
    self.cont_last = (last == prev).astype(f32)

  def mask(self, a, c, strict):
    """[16, 16] bool: same segment, and row >= col (row > col if strict) on diagonal tiles."""
    m = self.seg[a][:, None] == self.seg[c][None, :]
    if a == c:
      ii, jj = jnp.arange(SUB)[:, None], jnp.arange(SUB)[None, :]
      m = m & ((ii > jj) if strict else (ii >= jj))
    return m

  def pos(self, x, a):
    """x_a * exp(G_a - r_a): factors <= 1."""
    return x * jnp.exp(self.G[a] - self.r[a][None, :])

  def neg(self, x, a, c):
    """x_c * exp(r_a - G_c) (c < a): <= 1."""
    return x * jnp.exp(self.r[a][None, :] - self.G[c])


def _pair_tile(ch, a_t, b_t, a, c, mm):
  """[16, 16] tile (a, c), c <= a, of ``P_ij = sum_d a_id b_jd exp(G_id - G_jd)`` (unmasked);
  ``mm`` is the matrix product to use."""
  if c < a:
    return mm(ch.pos(a_t, a), ch.neg(b_t, a, c), tb=True)
  G = ch.G[a]
  cid = jnp.arange(SUB)[None, :]

  def col(j, tile):
    e = jnp.exp(jnp.minimum(G - _row(G, j)[None, :], 0.0))
    v = jnp.sum(a_t * _row(b_t, j)[None, :] * e, axis=1)
    return jnp.where(cid == j, v[:, None], tile)

  return jax.lax.fori_loop(0, SUB, col, jnp.zeros((SUB, SUB), jnp.float32))


def _pair_grads(ch, a_side, b_side, dP, mm):
  """Gradients of ``P = pairs(a_side, b_side)`` given the tile grid dP[a][c] (c <= a).

  ``mm`` is the matrix product to use. Returns (da, db) lists of [16, K] tiles:
  da_i = sum_j dP_ij b_j e^{G_i - G_j}, db_j = sum_i dP_ij a_i e^{G_i - G_j}.
  """
  n = ch.n
  da = [None] * n
  db = [jnp.zeros_like(ch.k[0]) for _ in range(n)]
  for a in range(n):
    acc = jnp.zeros_like(ch.k[0])
    for c in range(a + 1):
      if c < a:
        acc = acc + mm(dP[a][c], ch.neg(b_side[c], a, c))
        db[c] = db[c] + ch.neg(mm(dP[a][c], ch.pos(a_side[a], a), ta=True), a, c)
    da[a] = ch.pos(acc, a)
    # the diagonal tile pair by pair
    G, A, B, D = ch.G[a], a_side[a], b_side[a], dP[a][a]
    cid = jnp.arange(SUB)[None, :]
    rid = jnp.arange(SUB)[:, None]

    def col(j, carry):
      da_t, db_t = carry
      e = jnp.exp(jnp.minimum(G - _row(G, j)[None, :], 0.0))
      dcol = jnp.sum(jnp.where(cid == j, D, 0.0), axis=1)[:, None]  # dP[:, j]
      da_t = da_t + dcol * _row(B, j)[None, :] * e
      dbj = jnp.sum(dcol * A * e, axis=0)
      return da_t, db_t + jnp.where(rid == j, dbj[None, :], 0.0)

    dad, dbd = jax.lax.fori_loop(0, SUB, col, (jnp.zeros_like(A), jnp.zeros_like(A)))
    da[a] = da[a] + dad
    db[a] = db[a] + dbd
  return da, db


def _inverse(akk, n):
  """Tiles of ``(I + A)^-1`` for strictly lower-triangular A given as tiles akk[a][c]."""
  mm = functools.partial(_mm, precision=_HI)
  x = [[None] * n for _ in range(n)]
  for a in range(n):
    inv = x[a][a] = _lower_inverse(akk[a][a], SUB, precision=_HI)
    for c in range(a - 1, -1, -1):
      s = mm(akk[a][c], x[c][c])
      for e in range(c + 1, a):
        s = s + mm(akk[a][e], x[e][c])
      x[a][c] = -mm(inv, s)
  return x


def _chunk_setup(cfg, ch, mm):
  """Masked A_kk / P_kk tiles and the inverse tiles of (I + A_kk)."""
  n = ch.n
  pkk = [[None] * n for _ in range(n)]
  akk = [[None] * n for _ in range(n)]
  for a in range(n):
    for c in range(a + 1):
      pkk[a][c] = jnp.where(ch.mask(a, c, True), _pair_tile(ch, ch.k[a], ch.k[c], a, c, mm),
                            0.0)
      akk[a][c] = ch.beta[a][:, None] * pkk[a][c]
  return pkk, _inverse(akk, n)


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref,
                 w_ref, u_ref, qg_ref, a_ref, kd_ref, gc_ref, *, cfg, hv, group, t):
  ci, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  n = cfg.chunk // SUB
  c0 = ci * cfg.chunk
  dt = jnp.dtype(cfg.dtype)
  ch = _Chunk(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, c0, n, t)
  mm = functools.partial(_mm, dt=dt)
  _, x = _chunk_setup(cfg, ch, mm)
  y = [ch.beta[c][:, None] * jnp.exp(ch.G[c]) * ch.k[c] for c in range(n)]
  z = [ch.beta[c][:, None] * v_ref[b, pl.ds(c0 + c * SUB, SUB), h, :].astype(jnp.float32)
       for c in range(n)]
  for a in range(n):
    rows = pl.ds(c0 + a * SUB, SUB)
    w = sum(mm(x[a][c], y[c]) for c in range(a + 1))
    u = sum(mm(x[a][c], z[c]) for c in range(a + 1))
    w_ref[b, rows, h, :] = (ch.cont[a][:, None] * w).astype(w_ref.dtype)
    u_ref[b, rows, h, :] = u.astype(u_ref.dtype)
    eg = jnp.exp(ch.G[a])
    qg_ref[b, rows, h, :] = (cfg.scale * ch.cont[a][:, None] * ch.q[a] * eg).astype(dt)
    kd_ref[b, rows, h, :] = (ch.last[a][:, None] * ch.k[a]
                             * jnp.exp(ch.gl[None, :] - ch.G[a])).astype(dt)
    for c in range(n):
      cols = pl.ds(c * SUB, SUB)
      if c <= a:
        t = jnp.where(ch.mask(a, c, False),
                      cfg.scale * _pair_tile(ch, ch.q[a], ch.k[c], a, c, mm), 0.0)
      else:
        t = jnp.zeros((SUB, SUB), jnp.float32)
      a_ref[b, rows, h, cols] = t.astype(dt)
  gc_ref[b, ci, h, :] = ch.cont_last * jnp.exp(ch.gl)


def _prep_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref,
                     h_ref, dh_ref, vn_ref, dvn_ref, do_ref,
                     dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, cfg, hv, group, t):
  """Gradients wrt the pre-processed q, k (per value head), v, g, beta of one chunk, from the
  state entering the chunk (h), the gradient of the state leaving it (dh), V' and its gradient
  (vn, dvn) and dO."""
  ci, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  n = cfg.chunk // SUB
  c0 = ci * cfg.chunk
  f32 = jnp.float32
  mmx = functools.partial(_mm, precision=_X3)
  ch = _Chunk(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, c0, n, t)
  pkk, x = _chunk_setup(cfg, ch, mmx)
  rows = [pl.ds(c0 + a * SUB, SUB) for a in range(n)]
  st = h_ref[b, ci, h, :, :]
  dst = dh_ref[b, ci, h, :, :]
  ld = lambda ref, a: ref[b, rows[a], h, :].astype(f32)
  do = [ld(do_ref, a) for a in range(n)]
  vn = [ld(vn_ref, a) for a in range(n)]
  du = [ld(dvn_ref, a) for a in range(n)]
  v = [ld(v_ref, a) for a in range(n)]
  eg = [jnp.exp(ch.G[a]) for a in range(n)]
  y = [ch.beta[a][:, None] * eg[a] * ch.k[a] for a in range(n)]
  z = [ch.beta[a][:, None] * v[a] for a in range(n)]
  dw = [-ch.cont[a][:, None] * mmx(du[a], st, tb=True) for a in range(n)]
  # WY factors: dX (lower tiles), dY = X^T dW, dZ = X^T dU
  dx = [[None] * n for _ in range(n)]
  for a in range(n):
    for c in range(a + 1):
      t = mmx(dw[a], y[c], tb=True) + mmx(du[a], z[c], tb=True)
      if c == a:
        t = jnp.where(jnp.arange(SUB)[:, None] >= jnp.arange(SUB)[None, :], t, 0.0)
      dx[a][c] = t
  dy = [sum(mmx(x[a][c], dw[a], ta=True) for a in range(c, n)) for c in range(n)]
  dz = [sum(mmx(x[a][c], du[a], ta=True) for a in range(c, n)) for c in range(n)]
  # dA_kk = -X^T dX X^T on the strictly lower tiles
  mm = functools.partial(_mm, precision=_HI)
  m1 = [[sum(mm(x[e][a], dx[e][c], ta=True) for e in range(max(a, c), n)) for c in range(n)]
        for a in range(n)]
  dpkk = [[None] * n for _ in range(n)]
  dbeta = [None] * n
  for a in range(n):
    acc = jnp.zeros((SUB,), f32)
    for c in range(a + 1):
      dakk = -sum(mm(m1[a][e], x[c][e], tb=True) for e in range(c + 1))
      dakk = jnp.where(ch.mask(a, c, True), dakk, 0.0)
      acc = acc + jnp.sum(dakk * pkk[a][c], axis=1)
      dpkk[a][c] = ch.beta[a][:, None] * dakk
    dbeta[a] = acc + jnp.sum(dy[a] * eg[a] * ch.k[a], axis=1) + jnp.sum(dz[a] * v[a], axis=1)
  # intra-chunk attention A_qk
  dpqk = [[jnp.where(ch.mask(a, c, False), cfg.scale * mmx(do[a], vn[c], tb=True), 0.0)
           for c in range(a + 1)] for a in range(n)]
  dk = [ch.beta[a][:, None] * eg[a] * dy[a] for a in range(n)]
  dG = [dy[a] * y[a] for a in range(n)]
  dq = [None] * n
  dgl = ch.cont_last * jnp.exp(ch.gl) * jnp.sum(st * dst, axis=1)
  for a in range(n):
    dqg = mmx(do[a], st, tb=True)
    qg = cfg.scale * ch.cont[a][:, None] * ch.q[a] * eg[a]
    dq[a] = cfg.scale * ch.cont[a][:, None] * eg[a] * dqg
    dG[a] = dG[a] + qg * dqg
    dkd = mmx(vn[a], dst, tb=True)
    dec = ch.last[a][:, None] * jnp.exp(ch.gl[None, :] - ch.G[a])
    dk[a] = dk[a] + dec * dkd
    t = dec * ch.k[a] * dkd
    dG[a] = dG[a] - t
    dgl = dgl + jnp.sum(t, axis=0)
  da, db = _pair_grads(ch, ch.k, ch.k, dpkk, mmx)
  for a in range(n):
    dk[a] = dk[a] + da[a] + db[a]
    dG[a] = dG[a] + ch.k[a] * (da[a] - db[a])
  da, db = _pair_grads(ch, ch.q, ch.k, dpqk, mmx)
  for a in range(n):
    dq[a] = dq[a] + da[a]
    dk[a] = dk[a] + db[a]
    dG[a] = dG[a] + ch.q[a] * da[a] - ch.k[a] * db[a]
  dg = _tile_dg(dG, dgl)
  for a in range(n):
    dq_ref[b, rows[a], h, :] = dq[a]
    dk_ref[b, rows[a], h, :] = dk[a]
    dv_ref[b, rows[a], h, :] = (ch.beta[a][:, None] * dz[a]).astype(dv_ref.dtype)
    dg_ref[b, rows[a], h, :] = dg[a]
    dbeta_ref[b, rows[a], h] = dbeta[a]


def _tile_dg(dG, tail):
  """The gate gradient tiles [16, K] from those of G = cumsum(g) within the chunk (dG) and the
  gradient of G at the chunk end (tail [K]): dg_i = tail + sum_{t >= i} dG_t."""
  dg = [None] * len(dG)
  for a in range(len(dG) - 1, -1, -1):
    tot = jnp.sum(dG[a], axis=0)
    dg[a] = tail[None, :] + tot[None, :] - jnp.cumsum(dG[a], axis=0) + dG[a]
    tail = tail + tot
  return dg


# ------------------------------------------------------------------------------------------
# 1b. chunk-local work on full [C, C] / [C, BK] tiles (bounded gate: the dense path)
# ------------------------------------------------------------------------------------------
# The whole chunk is one tile of C rows; the K axis is walked in slices of ``SLICE_K``
# channels (the decay is per channel, so every slice is independent until the [C, C] sums).
# Pair products use one reference point per block ``I`` of ``diag_rows`` rows (``r_I``: G at
# the block's middle row): rows of block I take ``a e^{G - r_I}``, columns up to block I take
# ``b e^{r_I - G}`` (<= 1 before the block); inside the block both stay within
# e^{(diag_rows / 2) |lower_bound|}. So a [C, C] product is the sum of C / diag_rows full
# products whose left operand is masked to one row block.
#
# The work is split into short kernels with their intermediates in HBM, so that no program
# holds more than a few [C, C] / [C, BK] float32 tiles and many programs are in flight:
#   forward  ``kda_chunk_a``    gate, cumsum, P_kk [C, C] (strict, float32), A_qk, KD,
#                               KG = k e^G, QG, gC;
#            ``kda_chunk_wu``   X = (I + diag(beta) P_kk)^-1 (float32, kept for the backward),
#                               W = X diag(beta) KG, U = X diag(beta) v;
#   backward ``kda_chunk_dwy``  the WY part: dP_kk [C, C], dY = X^T dW [C, K], dv, dbeta;
#            ``kda_chunk_dqkg`` one program per ``DQKG_SLICE_K``-wide K slice: dq, dk, dg from
#                               the pair products (dP_qk = scale dO V'^T formed in place from
#                               the dO and V' tiles it loads anyway), the states and dY.
# Nsight Compute on the H200 (B1 T16384 H32 K128, 2026-12-01): every chunk kernel runs one
# program per SM (registers: 232-255), kda_chunk_a without spills; kda_chunk_dqkg and
# kda_chunk_dwy spill (35M / 16M local-memory requests before dP was loaded per block and dwy
# worked per V slice). chunk_dqkg as two programs per K slice (q side; k side and states):
# 4.64 instead of 4.14 ms.

# K channels per slice of the dense path (H200, B1 T16384 H32 K128, 2026-12-02: 32-wide slices
# chunk_a 1.414 instead of 1.122 ms, chunk_wu 0.639 / 0.548, chunk_dwy 1.368 / 1.314).
SLICE_K = 64


class _Dense:
  """The per-token values of one chunk as [C] / [C, BK] tiles (trace-time helper). ``refs``
  are (q, k, g, beta, A_log, dt_bias, seg); q, k, g, A_log, dt_bias may be None for kernels
  that only need beta and the segment masks. ``norms`` (refs ``[B, Tp, HV]``), if given, hold
  the rows' inverse L2 norms of q and k (from ``kda_chunk_a``), else they are computed."""

  def __init__(self, cfg, refs, b, h, hq, c0, t, kd, slice_k=SLICE_K, norms=None,
               dot_cumsum=False):
    q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref = refs
    f32 = jnp.float32
    c = cfg.chunk
    self.cfg, self.refs, self.b, self.h, self.hq, self.c0, self.t = cfg, refs, b, h, hq, c0, t
    self.dot_cumsum = dot_cumsum
    self.bk = min(kd, slice_k)
    self.ns = kd // self.bk
    self.rows = pl.ds(c0, c)
    self.rid = jnp.arange(c)[:, None]
    cid = jnp.arange(c)[None, :]
    # padded tokens leave the state alone (None: t a multiple of the chunk, none padded)
    self.valid = None if t % c == 0 else (c0 + jnp.arange(c)) < t
    beta = beta_ref[b, self.rows, h].astype(f32)
    if cfg.beta_is_logit:
      beta = jax.nn.sigmoid(beta)
    self.beta = beta if self.valid is None else jnp.where(self.valid, beta, 0.0)
    seg = seg_ref[b, self.rows]
    prev = seg_ref[b, jnp.maximum(c0 - 1, 0)]
    last = seg_ref[b, c0 + c - 1]
    self.cont = (seg == prev).astype(f32)  # continues the incoming state
    self.last = (seg == last).astype(f32)  # in the chunk's last segment
    self.cont_last = (last == prev).astype(f32)
    same = seg[:, None] == seg[None, :]
    self.incl = same & (self.rid >= cid)
    self.strict = same & (self.rid > cid)
    self.rq = self.rk = None
    if norms is not None:
      self.rq, self.rk = (ref[b, self.rows, h][:, None] for ref in norms)
    elif cfg.use_qk_l2norm and q_ref is not None:
      norm = lambda ref: jax.lax.rsqrt(sum(
          jnp.sum(jnp.square(self._load(ref, s)), axis=1, keepdims=True)
          for s in range(self.ns)) + L2_EPS)
      self.rq, self.rk = norm(q_ref), norm(k_ref)

  def cols(self, s):
    """K channels of slice s (static or traced)."""
    return pl.ds(s * self.bk, self.bk)

  def _load(self, ref, s):
    return ref[self.b, self.rows, self.hq, self.cols(s)].astype(jnp.float32)

  def slice(self, s):
    """q, k (normalised if fused), G (cumulative log decay from the chunk start): [C, BK]."""
    cfg, (q_ref, k_ref, g_ref, _, alog_ref, dtb_ref, _) = self.cfg, self.refs
    q, k = self._load(q_ref, s), self._load(k_ref, s)
    if self.rq is not None:
      q, k = q * self.rq, k * self.rk
    g = g_ref[self.b, self.rows, self.h, self.cols(s)].astype(jnp.float32)
    if cfg.gate is not None:
      x = g + dtb_ref[self.h, self.cols(s)][None, :]
      e = jnp.exp(alog_ref[self.h])
      g = (cfg.lower_bound * jax.nn.sigmoid(e * x) if cfg.gate == "bounded"
           else -e * jax.nn.softplus(x))
    if self.valid is not None:
      g = jnp.where(self.valid[:, None], g, 0.0)
    return q, k, _dot_cumsum(g) if self.dot_cumsum else jnp.cumsum(g, axis=0)

  def row(self, x, i):
    """Row i of a [C, BK] tile as [BK] (masked reduction)."""
    return jnp.sum(jnp.where(self.rid == i, x, 0.0), axis=0)

  def blocks(self, G):
    """e^{G - r} [C, BK] with each row's own block reference (G at the middle row of its block
    of ``diag_rows`` rows), per block I a function returning (row mask [C, 1], column
    factor e^{r_I - G} [C, BK] zeroed after block I), and the references r_I [BK]; the column
    factors are formed one at a time, where they are used. No exponent of a row in or before
    its block exceeds ``diag_rows / 2`` gates (G falls with the row; see ``diag_rows``), so
    none overflows (those after it are zeroed)."""
    n = self.cfg.diag_rows
    refs = [self.row(G, i * n + n // 2 - 1) for i in range(self.cfg.chunk // n)]
    ref_rows = jnp.broadcast_to(refs[0][None, :], G.shape)
    for i in range(1, len(refs)):
      ref_rows = jnp.where(self.rid >= i * n, refs[i][None, :], ref_rows)

    def block(i):
      rows = (self.rid >= i * n) & (self.rid < (i + 1) * n)
      return rows, jnp.where(self.rid < (i + 1) * n, jnp.exp(refs[i][None, :] - G), 0.0)

    return [functools.partial(block, i) for i in range(len(refs))], jnp.exp(G - ref_rows), refs


def _dot_cumsum(g):
  """``cumsum(g, axis=0)`` of a [C, BK] float32 tile as matrix-unit products with the
  lower-triangular ones, on three bf16 parts of g (``g = a + b + c`` exactly to float32): the
  sum in float32 without the scan across the rows' threads and warps."""
  rows = g.shape[0]
  tril = (jnp.arange(rows)[:, None] >= jnp.arange(rows)[None, :]).astype(jnp.bfloat16)
  total = None
  for _ in range(3):
    part = g.astype(jnp.bfloat16)
    g = g - part.astype(jnp.float32)
    total = _mm(tril, part) if total is None else total + _mm(tril, part)
  return total


def _lower_inverse(a, c, precision=None):
  """``(I + a)^-1`` for a strictly lower [C, C] ``a`` by doubling its diagonal blocks: with X the
  inverse of the block diagonal of 1-row blocks (I), each level merges pairs of n-row blocks,
  ``[[P, 0], [L, Q]]^-1 = [[P^-1, 0], [-Q^-1 L P^-1, Q^-1]]``, for all pairs at once as
  ``X <- X - X (L X)`` with L the lower-left blocks of the pairs. Every intermediate is a block of
  the inverse, so the rounding errors stay at the size of the inverse's entries; the former
  nilpotent series ``(I - D)(I + D^2)(I + D^4)(I + D^8)`` went through powers of ``a`` that reach
  ~1e3 for keys with cosine similarity 0.9 and lost every digit in TF32 (2026-12-03). Float32
  products at ``precision`` (by default TF32 on the GPU's matrix units): 2 log2(C) - 2 of them
  (ten at C = 64)."""
  ii, jj = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
  x = (ii == jj).astype(jnp.float32) - jnp.where((ii == jj + 1) & (ii % 2 == 1), a, 0.0)
  n = 2
  while n < c:
    rb, cb = ii // n, jj // n
    low = jnp.where((rb == cb + 1) & (rb % 2 == 1), a, 0.0)
    x = x - _mm(x, _mm(low, x, precision=precision), precision=precision)
    n *= 2
  return x


def _ids(hv, pid, axis=0):
  """(chunk, batch, value head) of a chunk whose grid indices ``pid`` (from ``_call``) have the
  chunk, B*HV at ``axis``, ``axis + 1``."""
  ci, bh = pid[axis], pid[axis + 1]
  return ci, bh // hv, bh % hv


def _dense_a_kernel(q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref,
                    pkk_ref, a_ref, qg_ref, kd_ref, kg_ref, gc_ref, rq_ref, rk_ref, *, cfg, hv,
                    group, t, pid):
  """Grid (NC, B*HV): writes pkk ``[B, Tp, HV, C]`` float32 (strict, same segment, no beta),
  A_qk ``[B, Tp, HV, C]``, QG, KD, KG ``[B, Tp, HV, K]`` (``cfg.dtype``), gC
  ``[B, NC, HV, K]`` float32 and the rows' inverse L2 norms of q and k ``[B, Tp, HV]`` (1 if
  not fused), which ``kda_chunk_dqkg`` reads instead of computing them again. Both pair
  products in one program share the gate, its cumulative sum and the column factors (1.09 ms at
  B1 T16384 H32 on the H200, against 1.71 ms for one program per product, 2026-12-01)."""
  ci, b, h = _ids(hv, pid)
  c = cfg.chunk
  dt = jnp.dtype(cfg.dtype)
  ch = _Dense(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, ci * c, t, q_ref.shape[-1])
  mm = functools.partial(_mm, dt=dt)
  rows = ch.rows
  akk = aqk = jnp.zeros((c, c), jnp.float32)
  for s in range(ch.ns):
    cols = ch.cols(s)
    q, k, G = ch.slice(s)
    blocks, e_row, _ = ch.blocks(G)
    lk, lq = k * e_row, q * e_row
    for block in blocks:
      rws, col = block()
      kc = k * col
      akk = akk + mm(jnp.where(rws, lk, 0.0), kc, tb=True)
      aqk = aqk + mm(jnp.where(rws, lq, 0.0), kc, tb=True)
    eg = jnp.exp(G)
    gl = ch.row(G, c - 1)
    qg_ref[b, rows, h, cols] = (cfg.scale * ch.cont[:, None] * q * eg).astype(dt)
    kd_ref[b, rows, h, cols] = (ch.last[:, None] * k * jnp.exp(gl[None, :] - G)).astype(dt)
    kg_ref[b, rows, h, cols] = (eg * k).astype(dt)
    gc_ref[b, ci, h, cols] = ch.cont_last * jnp.exp(gl)
  pkk_ref[b, rows, h, :] = jnp.where(ch.strict, akk, 0.0)
  a_ref[b, rows, h, :] = jnp.where(ch.incl, cfg.scale * aqk, 0.0).astype(dt)
  one = jnp.ones((cfg.chunk, 1), jnp.float32)
  for ref, norm in ((rq_ref, ch.rq), (rk_ref, ch.rk)):
    ref[b, rows, h] = (one if norm is None else norm)[:, 0]


def _dense_wu_kernel(pkk_ref, kg_ref, v_ref, beta_ref, seg_ref, w_ref, u_ref, *x_ref, cfg, hv,
                     t, pid):
  """X = (I + diag(beta) pkk)^-1 (written to ``x_ref`` [B, Tp, HV, C] float32 if given),
  W = cont * X diag(beta) KG ``[B, Tp, HV, K]``, U = X diag(beta) v ``[B, Tp, HV, V]``."""
  ci, b, h = _ids(hv, pid)
  c = cfg.chunk
  dt = jnp.dtype(cfg.dtype)
  kdim, vd = kg_ref.shape[-1], v_ref.shape[-1]
  ch = _Dense(cfg, (None, None, None, beta_ref, None, None, seg_ref), b, h, h, ci * c, t, kdim)
  rows = ch.rows
  x = _lower_inverse(ch.beta[:, None] * pkk_ref[b, rows, h, :], c)
  if x_ref:
    x_ref[0][b, rows, h, :] = x
  xb = x * ch.beta[None, :]
  mm = functools.partial(_mm, dt=dt)
  for s in range(ch.ns):
    cols = ch.cols(s)
    w = mm(xb, kg_ref[b, rows, h, cols].astype(jnp.float32))
    w_ref[b, rows, h, cols] = (ch.cont[:, None] * w).astype(w_ref.dtype)
  bv = min(vd, SLICE_K)
  for s in range(vd // bv):
    cols = pl.ds(s * bv, bv)
    u_ref[b, rows, h, cols] = mm(xb, v_ref[b, rows, h, cols].astype(jnp.float32)).astype(
        u_ref.dtype)


def _dense_dwy_kernel(v_ref, beta_ref, seg_ref, x_ref, pkk_ref, kg_ref, h_ref, dvn_ref,
                      dpkk_ref, dy_ref, dv_ref, dbeta_ref, *, cfg, hv, t, pid):
  """The WY part of the backward: with W = X Y, U = X Z (Y = diag(beta) KG, Z = diag(beta) v),
  dW = -cont dV' S^T and dU = dV': dX = dW Y^T + dU Z^T, dY = X^T dW, dZ = X^T dU and
  dA_kk = -X^T dX X^T (strictly lower same-segment pairs). Writes dpkk = beta dA_kk
  ``[B, Tp, HV, C]``, dY ``[B, Tp, HV, K]``, dv and the whole dbeta."""
  ci, b, h = _ids(hv, pid)
  c = cfg.chunk
  f32 = jnp.float32
  mm = _mm  # float32 (TF32 on the matrix units)
  ch = _Dense(cfg, (None, None, None, beta_ref, None, None, seg_ref), b, h, h, ci * c, t,
              kg_ref.shape[-1])
  rows, beta = ch.rows, ch.beta[:, None]
  ld = lambda ref: ref[b, rows, h, :].astype(f32)
  # Fewer live tiles than whole [C, V] float32 ones (1.60 instead of 1.82 ms at B1 T16384 H32
  # on the H200, 2026-12-01): dZ = X^T dV', dv, dZ's part of dbeta and dX's dU Z^T part per
  # 64-wide V slice, dV' loaded again for dW, and the products with the states in the kernels'
  # dtype (like the forward's).
  sdt = jnp.dtype(cfg.dtype)
  x = ld(x_ref)
  vd = v_ref.shape[-1]
  bv = min(vd, SLICE_K)
  dbeta, dx = jnp.zeros((c,), f32), jnp.zeros((c, c), f32)
  for sv in range(vd // bv):
    vc = pl.ds(sv * bv, bv)
    dvn = dvn_ref[b, rows, h, vc].astype(f32)
    dz = mm(x, dvn, ta=True)
    v = v_ref[b, rows, h, vc].astype(f32)
    dbeta = dbeta + jnp.sum(dz * v, axis=1)
    dv_ref[b, rows, h, vc] = (beta * dz).astype(dv_ref.dtype)
    dx = dx + mm(dvn, beta * v, tb=True)
  for s in range(ch.ns):
    cols = ch.cols(s)
    kg = kg_ref[b, rows, h, cols].astype(f32)
    dw = -ch.cont[:, None] * mm(dvn_ref[b, rows, h, :], h_ref[b, ci, h, cols, :], tb=True, dt=sdt)
    dx = dx + mm(dw, beta * kg, tb=True)
    dy = mm(x, dw, ta=True)
    dbeta = dbeta + jnp.sum(dy * kg, axis=1)
    dy_ref[b, rows, h, cols] = dy.astype(dy_ref.dtype)
  da = jnp.where(ch.strict, -mm(mm(x, dx, ta=True), x, tb=True), 0.0)
  dbeta_ref[b, rows, h] = dbeta + jnp.sum(da * ld(pkk_ref), axis=1)
  dpkk_ref[b, rows, h, :] = (beta * da).astype(dpkk_ref.dtype)


# Matrix-unit algorithms of the pair-product gradients in ``kda_chunk_dqkg``, ((P_qk: d q, d k),
# (P_kk: d k_row, d k_col)). The gate gradient takes small differences of their large terms;
# for P_qk's both need ~16 mantissa bits (three bf16 passes), P_kk's do not: CPU emulation of
# the GPU roundings (B1 T256 H2 K128, 3 segments, bf16 inputs vs the float32 recurrence): all
# three-pass df / dA_log / ddt_bias 2.8e-3 / 2.2e-3 / 1.8e-3, this default 2.8e-3 / 2.7e-3 /
# 2.8e-3, P_qk single-pass TF32 6.6e-3 / 8.1e-3 / 3.3e-2, P_qk single-pass bf16 4.6e-2 / 5.6e-2 /
# 0.25. ``benchmarks/kda.py --sweep`` measures accuracy and time of others on the card.
GATE_DOT = ((_X3, _X3), (jax.lax.DotAlgorithmPreset.BF16_BF16_F32,) * 2)
# K channels per program of ``kda_chunk_dqkg``: 32 (H200, B1 T16384 H32 K128, 2026-12-02: 2.86 ms;
# 16 wide 3.46; 64 wide 7.71 at 4 warps, 3.58 at 8).
DQKG_SLICE_K = 32


def _dense_dqkg_kernel(q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref, h_ref, dh_ref,
                       vn_ref, do_ref, dy_ref, dpkk_ref, rq_ref, rk_ref, dq_ref, dk_ref, dg_ref, *,
                       cfg, hv, group, t, gate_dot, slice_k, dot_cumsum, pid):
  """Grid (K slices, NC, B*HV): gradients wrt the pre-processed q, k (per value head) and g of
  one K slice of one chunk, from the state entering the chunk (h), the gradient of the state
  leaving it (dh), V', dO, dY, the pair-product gradient dpkk and the inverse norms.
  dP_qk = mask(scale dO V'^T) is formed here, in each reference block's step, from the dO and
  V' tiles (float32 sums of the bf16 tiles), not stored by ``kda_chunk_dwy`` and loaded as
  float32: chunk_dwy 0.91-0.95 -> 0.76 ms, chunk_dqkg 2.55 -> 2.64-2.69 ms at B1 T16384 H32 on
  the H200, the whole op unchanged within the spread; formed once per program and kept across
  the blocks, chunk_dqkg took 2.68 ms (2026-12-03, RESULTS.md KDA runs 23-26).
  The K slices are the fastest grid axis (Triton launches the first axis fastest), so the
  programs of one chunk run side by side and the tiles they all read (V', dO, dP_kk) come from
  L2 after the first."""
  s = pid[0]
  ci, b, h = _ids(hv, pid, 1)
  c = cfg.chunk
  f32 = jnp.float32
  mm = _mm
  ch = _Dense(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, ci * c, t, q_ref.shape[-1], slice_k, norms=(rq_ref, rk_ref),
              dot_cumsum=dot_cumsum)
  rows, cols, beta = ch.rows, ch.cols(s), ch.beta[:, None]
  ld = lambda ref: ref[b, rows, h, :].astype(f32)
  q, k, G = ch.slice(s)
  state = lambda ref: ref[b, ci, h, cols, :]  # [BK, V], loaded where used
  blocks, e_row, refs = ch.blocks(G)

  def pairs(a_side, dp, dots):
    """Gradients of the pair product P_ij = sum_d a_id k_jd e^{G_id - G_jd} (i >= j) given
    dP (``dp()``: [C, C] float32), products by the algorithms ``dots`` (for d a, for d k):
    (d a, d k) [C, BK] and the last block's column factor."""
    mma, mmb = (functools.partial(_mm, precision=d) for d in dots)
    la = a_side * e_row
    da = db = jnp.zeros_like(k)
    for block in blocks:  # dP loaded / formed per block, not kept live across them (fewer spills)
      rws, col = block()
      p = jnp.where(rws, dp(), 0.0)
      da = da + mma(p, k * col)
      db = db + col * mmb(p, la, ta=True)
    return da * e_row, db, col

  # The products with the states (dO S^T, V' dS^T) take operands of the kernels' dtype, like
  # the forward's QG S: bf16 halves their registers (chunk_dqkg 4.87 instead of 6.76 ms on the
  # H200 at B1 T16384 H32, dq / dk / df errors unchanged at 3.2e-3, 2026-12-01).
  sdt = jnp.dtype(cfg.dtype)

  def q_side():
    """dq (from the state and from P_qk) and P_qk's part of dk and dG."""
    do = do_ref[b, rows, h, :]
    dq = cfg.scale * ch.cont[:, None] * jnp.exp(G) * mm(do, state(h_ref), tb=True, dt=sdt)
    dpqk = lambda: jnp.where(ch.incl, cfg.scale * mm(do_ref[b, rows, h, :], vn_ref[b, rows, h, :],
                                                     tb=True, dt=sdt), 0.0)
    daq, dk, _ = pairs(q, dpqk, gate_dot[0])
    dq = dq + daq
    dq_ref[b, rows, h, cols] = dq.astype(dq_ref.dtype)
    return dk, q * dq - k * dk

  def k_side(dk, dG):
    """P_kk's part, W's factor k e^G (gradient dY) and KD = k e^{G_C - G} (from the state
    gradient), added to dk, dG; and the gradient of G at the chunk end."""
    dak, dbk, col = pairs(k, lambda: ld(dpkk_ref), gate_dot[1])
    dk = dk + dak + dbk
    dG = dG + k * (dak - dbk)
    gl = ch.row(G, c - 1)
    dky = beta * jnp.exp(G) * dy_ref[b, rows, h, cols].astype(f32)
    dst = state(dh_ref)
    # KD's decay e^{G_C - G} = e^{G_C - r} e^{r - G} with r the last block's reference: its
    # column factor (every row: none lies after the last block) times one factor per channel,
    # an exponential per element fewer (where e^{r - G} underflows, e^{G_C - G} <= e^{r - G}
    # does too). H200, B4 T4096 H32 (KDA runs 43-44, 2026-12-04): kda_chunk_dqkg 2.354 / 2.321
    # ms against 2.372 / 2.336 with its own exponential; the same in kda_chunk_a was slower,
    # 0.997 / 0.980 against 0.987 / 0.962 (on the CPU its SASS 5,856 instructions against
    # 5,960; kda_chunk_dqkg's 5,448 against 5,464, spilling 216 bytes against 152).
    decay = col * jnp.exp(gl - refs[-1])[None, :]
    dkd = ch.last[:, None] * decay * mm(vn_ref[b, rows, h, :], dst, tb=True, dt=sdt)
    dk = dk + dky + dkd
    dG = dG + k * (dky - dkd)
    hdh = state(h_ref).astype(f32) * dst.astype(f32)  # float32 sums of the stored values
    dgl = (ch.cont_last * jnp.exp(gl) * jnp.sum(hdh, axis=1)
           + jnp.sum(k * dkd, axis=0))
    return dk, dG, dgl

  dk, dG, dgl = k_side(*q_side())
  # G = cumsum(g): dg_i = sum_{t >= i} dG_t, plus dG at the chunk end for every row
  dk_ref[b, rows, h, cols] = dk.astype(dk_ref.dtype)
  dg_ref[b, rows, h, cols] = (dgl[None, :] + jnp.sum(dG, axis=0)[None, :]
                              - jnp.cumsum(dG, axis=0) + dG).astype(dg_ref.dtype)


# Whether kda_chunk_dqkg forms the gate's cumulative sum as products (``_dot_cumsum``) instead
# of a scan. H200, B4 T4096 H32 K128 (KDA run 39, 2026-12-03): 2.324 ms against the scan's
# 2.615, same errors. Compiled for the H200 on the CPU (``tools/triton_report.py``, B1 T16384
# H32 K128) its products spill 152 instead of 440 bytes per thread, 5480 instead of 5760
# instructions. kda_chunk_a scans: with the products it took 9688 instead of 6000 instructions
# with 900 bytes of spills (the products' layout against the tiles' around them) and on the
# card 4.97 ms instead of 1.00 (KDA run 43, 2026-12-04).
DQKG_DOT_CUMSUM = True

# Warps per chunk-local kernel (by pallas_call name; `benchmarks/kda.py --sweep` times others).
# H200, B1 T16384 H32 K128, 2026-12-02: kda_chunk_dqkg 4 warps 2.86 ms, 8 4.54; kda_chunk_dwy
# 4 warps 1.40 ms, 16 3.96 (8: 2.05 on 2026-12-01); kda_chunk_wu 2 1.32, 4 0.55, 8 1.06;
# kda_chunk_a (one program per chunk) 4 warps 2.19 ms, 8 1.13, 16 1.77.
WARPS = {"kda_chunk_prep": 4, "kda_chunk_prep_bwd": 4, "kda_chunk_a": 8, "kda_chunk_wu": 4,
         "kda_chunk_dwy": 4, "kda_chunk_dqkg": 4}


# Chunks per program and software-pipeline stages of the dense path's chunk kernels (by
# pallas_call name; default (1, 1)): a program walks ``per`` consecutive chunks in a loop, so
# with more than one stage Triton loads the next chunk's tiles while the current chunk's
# products run. H200, B1 T16384 H32 K128, 2026-12-02 (`benchmarks/kda.py --sweep`):
# kda_chunk_a 4 x 3 0.986 ms, 2 x 3 0.995, 4 x 2 1.040, one chunk 1.121; kda_chunk_wu no faster
# (4 x 2 0.549 against 0.551); kda_chunk_dqkg 2 x 2 4.97 against 2.66 (3 stages exceed shared
# memory); kda_chunk_dwy exceeds shared memory at every setting. B4 T4096 H32 (KDA run 43,
# 2026-12-04): kda_chunk_a 8 x 3 0.968 ms, 4 x 3 0.998 (run 36: 0.978 / 0.989), 4 x 2 0.999,
# 1 x 1 1.183; run 44: 8 x 3 0.953, 16 x 3 0.959, 32 x 3 0.954, 4 x 3 0.968, 16 x 2 0.999;
# kda_chunk_dwy and kda_chunk_dqkg slower at every setting (run 44: 0.84-0.86 against 0.76-0.79,
# 3.10-3.17 against 2.34-2.39).
CHUNK_LOOP = {"kda_chunk_a": (8, 3)}


def _call(kern, name, grid, out_shape, *args, chunk_axis=None):
  """One chunk kernel. With ``chunk_axis`` (the grid axis of the chunks) the kernel takes
  ``pid``, its grid indices with the chunk's at ``chunk_axis``, and walks ``CHUNK_LOOP``'s
  chunks per program (the program ids are read outside the loop, as interpret mode needs)."""
  per, stages = CHUNK_LOOP.get(name, (1, 1))
  if chunk_axis is not None:
    nc = grid[chunk_axis]
    per = math.gcd(per, nc)
    # what one chunk's program reads of each chunk-indexed input ([B, Tp, ...] / [B, NC, ...])
    stages = _stages(stages, sum(x.dtype.itemsize * (x.shape[1] // nc) * math.prod(x.shape[3:])
                                 for x in args if x.ndim >= 3 and x.shape[1] % nc == 0))
    grid = grid[:chunk_axis] + (nc // per,) + grid[chunk_axis + 1:]
    one = kern

    def kern(*refs):
      ids = tuple(pl.program_id(i) for i in range(len(grid)))
      at = lambda ci: ids[:chunk_axis] + (ci,) + ids[chunk_axis + 1:]

      def step(j, carry):
        one(*refs, pid=at(ids[chunk_axis] * per + j))
        return carry

      if per == 1:
        one(*refs, pid=ids)
      else:
        jax.lax.fori_loop(0, per, step, 0)

  return pl.pallas_call(kern, grid=grid, out_shape=out_shape, interpret=_interpret(),
                        compiler_params=_params(WARPS[name], stages), name=name)(*args)


def _tok(x, d, dtype):
  """[B, Tp, HV, d] of ``dtype`` shaped like the value-side input x [B, Tp, HV, *]."""
  return jax.ShapeDtypeStruct(x.shape[:3] + (d,), dtype)


def _cont(seg, c):
  """``[B, Tp]`` float32: 1 where a token continues the state entering its chunk."""
  start = jnp.arange(seg.shape[1]) // c * c
  return (seg == seg[:, jnp.maximum(start - 1, 0)]).astype(jnp.float32)


def _chunk_a(cfg, q, k, v, g, beta, A_log, dt_bias, seg, t):
  """``kda_chunk_a``: (pkk, aqk, qg, kd, kg, gc, rq, rk), see :func:`_dense_a_kernel`."""
  bsz, tp, h, kd = q.shape
  hv, c = v.shape[2], cfg.chunk
  dt, f32 = jnp.dtype(cfg.dtype), jnp.float32
  kern = functools.partial(_dense_a_kernel, cfg=cfg, hv=hv, group=hv // h, t=t)
  return _call(kern, "kda_chunk_a", (tp // c, bsz * hv),
               [_tok(v, c, f32), _tok(v, c, dt), _tok(v, kd, dt), _tok(v, kd, dt),
                _tok(v, kd, dt), jax.ShapeDtypeStruct((bsz, tp // c, hv, kd), f32)]
               + [jax.ShapeDtypeStruct((bsz, tp, hv), f32)] * 2,
               q, k, g, beta, A_log, dt_bias, seg, chunk_axis=0)


# The WY factors: "mosaic" (``wu_mgpu`` where it applies: Hopper or interpret mode, bf16, 64-token
# chunks, K and V up to 128) or "triton" (``_dense_wu_kernel``). WU_SPLIT: the Mosaic inverse's
# products as three bf16 products of split operands (True), one float16 product (False), or
# "auto": float16 where the keys are L2-normalised and beta a sigmoid (entries of order 1).
CHUNK_WU = "mosaic"
WU_SPLIT = "auto"


def _chunk_wu(cfg, pkk, kg, v, beta, seg, t, keep):
  """``kda_chunk_wu``: (w, u) and, if ``keep``, the inverse x; see :func:`_dense_wu_kernel`."""
  bsz, tp, hv, vd = v.shape
  c, dt = cfg.chunk, jnp.dtype(cfg.dtype)
  if CHUNK_WU == "mosaic" and _mosaic_gpu() and wu_mgpu.supported(kg, v, cfg.chunk):
    beta = beta.astype(jnp.float32)
    if cfg.beta_is_logit:
      beta = jax.nn.sigmoid(beta)
    beta = jnp.where((jnp.arange(tp) < t)[None, :, None], beta, 0.0)  # padded tokens
    split = (not (cfg.use_qk_l2norm and cfg.beta_is_logit) if WU_SPLIT == "auto"
             else bool(WU_SPLIT))
    return wu_mgpu.chunk_wu(pkk, kg, v, jnp.swapaxes(beta, 1, 2), _cont(seg, c),
                            keep=keep, split=split, interpret=_interpret())
  kern = functools.partial(_dense_wu_kernel, cfg=cfg, hv=hv, t=t)
  return _call(kern, "kda_chunk_wu", (tp // c, bsz * hv),
               [_tok(v, kg.shape[-1], dt), _tok(v, vd, dt)] + [_tok(v, c, jnp.float32)] * keep,
               pkk, kg, v, beta, seg, chunk_axis=0)


def _pair_grad_dtype(cfg, dots):
  """Storage dtype of a pair-product gradient whose products use the algorithms ``dots``: the
  kernels' bf16 when every product rounds its operands to bf16 anyway (half the bytes, the same
  results), else float32."""
  single = all(d == jax.lax.DotAlgorithmPreset.BF16_BF16_F32 for d in dots)
  return jnp.dtype(cfg.dtype) if single and cfg.dtype == "bfloat16" else jnp.float32


def _chunk_dwy(cfg, v, beta, seg, x, pkk, kg, hs, dvn, t):
  """``kda_chunk_dwy``: (dpkk, dy, dv, dbeta), see :func:`_dense_dwy_kernel`."""
  bsz, tp, hv, vd = v.shape
  c, f32 = cfg.chunk, jnp.float32
  kern = functools.partial(_dense_dwy_kernel, cfg=cfg, hv=hv, t=t)
  return _call(kern, "kda_chunk_dwy", (tp // c, bsz * hv),
               [_tok(v, c, _pair_grad_dtype(cfg, GATE_DOT[1])),
                _tok(v, kg.shape[-1], _store_dtype(cfg, "dy")), _tok(v, vd, v.dtype),
                jax.ShapeDtypeStruct((bsz, tp, hv), f32)],
               v, beta, seg, x, pkk, kg, hs, dvn, chunk_axis=0)


def _chunk_dqkg(cfg, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, do, dy, dpkk, rq, rk, t):
  """``kda_chunk_dqkg``: (dq, dk, dg), see :func:`_dense_dqkg_kernel`."""
  bsz, tp, h, kd = q.shape
  hv = v.shape[2]
  bk = min(kd, DQKG_SLICE_K)
  kern = functools.partial(_dense_dqkg_kernel, cfg=cfg, hv=hv, group=hv // h, t=t,
                           gate_dot=GATE_DOT, slice_k=bk,
                           dot_cumsum=DQKG_DOT_CUMSUM)
  return _call(kern, "kda_chunk_dqkg", (kd // bk, tp // cfg.chunk, bsz * hv),
               [_tok(v, kd, _store_dtype(cfg, n)) for n in ("dqk", "dqk", "dg")],
               q, k, g, beta, A_log, dt_bias, seg, hs, dh, vn, do, dy, dpkk, rq, rk,
               chunk_axis=1)


def _prepare(cfg, q, k, v, g, beta, A_log, dt_bias, seg, t, keep=False):
  """Chunk-local factors ``(w, u, qg, aqk, kd, gc)``: w, qg, kd ``[B, Tp, HV, K]``, u
  ``[B, Tp, HV, V]``, aqk ``[B, Tp, HV, C]`` (``cfg.dtype``) and gc ``[B, NC, HV, K]`` float32;
  and what the dense backward reuses (``(pkk, kg, x, rq, rk)`` if ``keep``, else None). Inputs
  padded to Tp; the first ``t`` tokens are real."""
  bsz, tp, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  c = cfg.chunk
  dt = jnp.dtype(cfg.dtype)
  if not cfg.diag_rows:
    kern = functools.partial(_prep_kernel, cfg=cfg, hv=hv, group=hv // h, t=t)
    return _call(kern, "kda_chunk_prep", (tp // c, bsz * hv),
                 [_tok(v, kd, dt), _tok(v, vd, dt), _tok(v, kd, dt), _tok(v, c, dt),
                  _tok(v, kd, dt), jax.ShapeDtypeStruct((bsz, tp // c, hv, kd), jnp.float32)],
                 q, k, v, g, beta, A_log, dt_bias, seg), None
  pkk, aqk, qg, kdec, kg, gc, rq, rk = _chunk_a(cfg, q, k, v, g, beta, A_log, dt_bias, seg, t)
  wu = _chunk_wu(cfg, pkk, kg, v, beta, seg, t, keep)
  return (wu[0], wu[1], qg, aqk, kdec, gc), ((pkk, kg, wu[2], rq, rk) if keep else None)


def _prepare_bwd(cfg, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn, do, t, kept):
  """Gradients wrt the pre-processed q, k (per value head), g ``[B, Tp, HV, K]`` (float32 or,
  per ``BF16_STORES``, the kernels' dtype), v ``[B, Tp, HV, V]`` (in v's dtype: the rounding
  the cotangent gets anyway, written once) and beta ``[B, Tp, HV]`` (float32); ``kept`` is what
  ``_prepare(..., keep=True)`` returned."""
  bsz, tp, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  f32 = jnp.float32
  if not cfg.diag_rows:
    kern = functools.partial(_prep_bwd_kernel, cfg=cfg, hv=hv, group=hv // h, t=t)
    return _call(kern, "kda_chunk_prep_bwd", (tp // cfg.chunk, bsz * hv),
                 [_tok(v, kd, f32), _tok(v, kd, f32), _tok(v, vd, v.dtype), _tok(v, kd, f32),
                  jax.ShapeDtypeStruct((bsz, tp, hv), f32)],
                 q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn, do)
  pkk, kg, x, rq, rk = kept
  dpkk, dy, dv, dbeta = _chunk_dwy(cfg, v, beta, seg, x, pkk, kg, hs, dvn, t)
  dq, dk, dg = _chunk_dqkg(cfg, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, do, dy, dpkk,
                           rq, rk, t)
  return dq, dk, dv, dg, dbeta


def _preprocess(cfg, q, k, g, beta, A_log, dt_bias):
  """The fused pre-processing in XLA (float32): the reference of ``prep_vjp`` (its tests and
  benchmarks take this function's ``jax.vjp``)."""
  f32 = jnp.float32
  q, k, g, beta = (x.astype(f32) for x in (q, k, g, beta))
  if cfg.use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  if cfg.gate is not None:
    g = kda_gate(g, A_log, dt_bias.reshape(-1), cfg.gate, cfg.lower_bound)
  if cfg.beta_is_logit:
    beta = jax.nn.sigmoid(beta)
  return q, k, g, beta


# ------------------------------------------------------------------------------------------
# 2. sequential passes over chunks (Pallas)
# ------------------------------------------------------------------------------------------

def _dot(a, b, trans_a=False):
  dims = (((0,), (0,)), ((), ())) if trans_a else (((1,), (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _fwd_kernel(w_ref, u_ref, qg_ref, a_ref, kd_ref, gc_ref, s0_ref, o_ref, st_ref, *rest,
                nc, hv, c, bv, store):
  """Grid (V/BV, B*HV): the V tiles of one head side by side (the first grid axis is launched
  fastest), so when the programs take several waves each chunk's factors, which all V tiles of
  the head read, still come from L2 after the first. o ``[B, Tp, HV, V]``, st
  ``[B, HV, K, V]``; with ``store`` also h ``[B, NC, HV, K, V]`` (state entering each chunk)
  and vn ``[B, Tp, HV, V]`` (V' as the products take it, in the kernels' dtype)."""
  iv, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  vs = pl.ds(iv * bv, bv)
  dt = w_ref.dtype

  def body(ci, s):
    rows = pl.ds(ci * c, c)
    if store:
      rest[0][b, ci, h, :, vs] = s.astype(rest[0].dtype)
    sb = s.astype(dt)
    vn = u_ref[b, rows, h, vs].astype(jnp.float32) - _dot(w_ref[b, rows, h, :], sb)
    vnb = vn.astype(dt)
    o_ref[b, rows, h, vs] = (_dot(qg_ref[b, rows, h, :], sb)
                             + _dot(a_ref[b, rows, h, :], vnb)).astype(o_ref.dtype)
    if store:
      rest[1][b, rows, h, vs] = vnb
    return gc_ref[b, ci, h, :][:, None] * s + _dot(kd_ref[b, rows, h, :], vnb, trans_a=True)

  s = jax.lax.fori_loop(0, nc, body, s0_ref[b, h, :, vs].astype(jnp.float32))
  st_ref[b, h, :, vs] = s


def _bwd_kernel(do_ref, qg_ref, a_ref, kd_ref, w_ref, gc_ref, dst_ref, dvn_ref, dh_ref, ds0_ref,
                *, nc, hv, c, bv):
  """Reverse pass, grid (V/BV, B*HV) as the forward's. dvn ``[B, Tp, HV, V]`` (gradient of V'),
  dh ``[B, NC, HV, K, V]`` (gradient of the state leaving each chunk), ds0 ``[B, HV, K, V]``."""
  iv, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  vs = pl.ds(iv * bv, bv)
  dt = w_ref.dtype

  def body(i, ds):
    ci = nc - 1 - i
    rows = pl.ds(ci * c, c)
    dh_ref[b, ci, h, :, vs] = ds.astype(dh_ref.dtype)
    do = do_ref[b, rows, h, vs].astype(dt)
    dvn = _dot(a_ref[b, rows, h, :], do, trans_a=True) + _dot(kd_ref[b, rows, h, :], ds.astype(dt))
    dvn_ref[b, rows, h, vs] = dvn.astype(dvn_ref.dtype)
    return (gc_ref[b, ci, h, :][:, None] * ds + _dot(qg_ref[b, rows, h, :], do, trans_a=True)
            - _dot(w_ref[b, rows, h, :], dvn.astype(dt), trans_a=True))

  ds = jax.lax.fori_loop(0, nc, body, dst_ref[b, h, :, vs].astype(jnp.float32))
  ds0_ref[b, h, :, vs] = ds


def _params(num_warps=4, num_stages=2):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# Shared memory one program may use on the H200 (232,448 bytes, as Triton reports it) and what a
# pipelined kernel takes besides its stages' buffers: the forward recurrence at 4 stages of
# 61,440 bytes asked for 253,952 (2026-12-02).
_SMEM, _SMEM_OWN = 232448, 8192


def _stages(want, stage_bytes):
  """Software-pipeline stages: ``want``, or as many buffers of ``stage_bytes`` (one loop step's
  loads) as fit beside the kernel's own shared memory (fewer for float32 inputs, K = 256)."""
  return max(1, min(want, (_SMEM - _SMEM_OWN) // max(stage_bytes, 1)))


# Software-pipeline stages of the sequential passes' loads: Triton prefetches the next chunks'
# factors while the current chunk's chain of products runs (H200, B1 T16384 H32 K128,
# 2026-12-02: forward 0.662 ms at 2 stages, 0.472 at 3, 1.260 at 1; storing the states 0.769 /
# 0.592; backward 0.789 / 0.622).
RECUR_STAGES = 3


def _recur_stages(c, kdim, bv, factor, tile):
  """Stages of a sequential pass whose chunk step loads three [C, K] factors and A_qk [C, C] of
  ``factor``'s dtype and one [C, BV] tile of ``tile``'s."""
  return _stages(RECUR_STAGES, factor.dtype.itemsize * c * (3 * kdim + c)
                 + tile.dtype.itemsize * c * bv)

# Backward intermediates stored in the kernels' dtype on the dense path (bf16 inputs), by name:
# the chunk states h (written by the forward's recurrence), their gradients dh and dV' ("dvn",
# by the backward's), dY (by kda_chunk_dwy) and kda_chunk_dqkg's dq, dk ("dqk", read by the
# pre-processing VJP). The chunk kernels take h and dh only into single-pass bf16 products,
# except the gate gradient's sum_v h dh at the chunk end (float32 sums of the bf16 values:
# unchanged errors). The card's check against the float32 recurrence (`benchmarks/kda.py`, H200,
# 2026-12-02): dV' rounded to bf16 before kda_chunk_dwy's TF32 products moves dv 3.6e-3 -> 3.9e-3
# and dbeta 3.7e-3 -> 4.0e-3, dq, dk 3.2e-3 -> 3.6e-3, dY nothing; dg ("dg", not stored so) would
# move dA_log 2.8e-3 -> 7.9e-3. Times at B1 T16384 H32 K128: all float32 -> h, dh, dV' in bf16:
# chunk_dwy 1.433 -> 1.100 ms, chunk_dqkg 2.884 -> 2.667, backward recurrence 0.820 -> 0.706,
# storing recurrence 0.812 -> 0.757; then dY chunk_dwy 0.986 -> 0.904, dq, dk chunk_dqkg 2.650
# -> 2.529. The general path's three-pass products read float32.
BF16_STORES = frozenset({"h", "dh", "dvn", "dy", "dqk"})


def _store_dtype(cfg, name):
  """Storage dtype of the backward residual ``name`` (see ``BF16_STORES``)."""
  bf16 = cfg.diag_rows and cfg.dtype == "bfloat16" and name in BF16_STORES
  return jnp.dtype(cfg.dtype) if bf16 else jnp.float32


# The sequential passes (``recurrence_mgpu`` where it applies: Hopper or interpret mode, bf16
# factors and stores, 64-token chunks; else Triton's ``_fwd_kernel``, ``_bwd_kernel``): "mosaic"
# (both passes), "triton" (neither), or "auto": the backward's always (its products issued in
# pairs), the forward's (its output products on a second warpgroup, off the state's chain) where
# its CTAs fit one wave on the GPU. H200, 2026-12-03 (RESULTS.md KDA runs 27-28): at B1 T16384 H32
# K128 (64 CTAs) the forward 0.343-0.358 ms against Triton's 0.471-0.485, storing the states
# 0.431-0.460 against 0.580-0.590, the backward 0.375-0.383 against 0.555-0.563; in the k3_1b
# step (B16 T4096 HV8: 256 CTAs) the storing forward 5.13 ms per step against Triton's 4.81, the
# backward 4.56 against 4.75. The Mosaic V tile and ring slots (B1 T16384 H32): the forward
# 0.358 ms at 64 wide, 0.476 at 32, 1.22 at 16; storing 0.431 / 0.652 / 1.41. At B4 T4096 H32
# (128 heads, 256 CTAs of 64 chunks) 0.344-0.367 against Triton's 0.334-0.340 (runs 35-36).
# MGPU_V_TILE: the V tile's width, or "auto": 64 where its CTAs fit one wave on the GPU, else 128
# (one CTA per (batch, head), its S / V' / O buffers single: jla's layout, whose pass takes
# 0.202 ms at B4 T4096 H32). At 128 wide (KDA run 39, B4 T4096 H32) the forward 0.233-0.238 ms,
# storing 0.371-0.386, the backward 0.318-0.340; the k3_1b step's KDA kernels 64.1 ms per step
# against 66.0 at 64 wide (Training run 35, same run).
# MGPU_STAGES: the ring slots asked for; the 128-wide tile's SMEM holds two whatever is asked
# (``recurrence_mgpu.ring_slots``), so sweeps of 2 against 3 there time one kernel twice: 3-8%
# apart in KDA runs 43-44, the spread of these timings (the later of two runs the slower).
RECURRENCE = "auto"
MGPU_V_TILE = "auto"
MGPU_STAGES = 3


def _mgpu_v_tile(heads: int, vd: int) -> int:
  """The Mosaic passes' V tile (``MGPU_V_TILE``) for ``heads`` (batch x value heads)."""
  if MGPU_V_TILE != "auto":
    return min(MGPU_V_TILE, vd)
  bv = min(64, vd)
  return 128 if heads * (vd // bv) > num_sms() and vd % 128 == 0 else bv


def _mosaic(cfg, w, tile, *stored, forward=False) -> int:
  """The V tile of the Mosaic GPU pass for these operands, or 0 for Triton's."""
  bv = _mgpu_v_tile(w.shape[0] * w.shape[2], tile.shape[-1])
  ctas = w.shape[0] * w.shape[2] * (tile.shape[-1] // bv)
  wanted = (RECURRENCE == "mosaic" or RECURRENCE == "auto" and (
      not forward or _interpret() or ctas <= num_sms()))
  ok = (wanted and _mosaic_gpu() and tile.shape[-1] % bv == 0
        and recurrence_mgpu.supported(w, tile, cfg.chunk, *stored))
  return bv if ok else 0


def _hopper() -> bool:
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def _mosaic_gpu() -> bool:
  """Whether our Mosaic GPU kernels run here: on Hopper, or in GPU interpret mode on the CPU."""
  return _interpret() or _hopper()


def _recurrence_fwd(cfg, w, u, qg, aqk, kd, gc, s0, out_dtype, store):
  bsz, tp, hv, kdim = w.shape
  vd = u.shape[-1]
  c, nc = cfg.chunk, tp // cfg.chunk
  bv = _mosaic(cfg, w, u, *([_store_dtype(cfg, "h")] if store else []), forward=True)
  if bv:
    return recurrence_mgpu.recurrence_fwd(w, u, qg, aqk, kd, gc, s0, out_dtype=out_dtype,
                                          store=store, block_v=bv, stages=MGPU_STAGES,
                                          interpret=_interpret())
  bv = _v_tile(bsz * hv, vd)
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, hv, vd), out_dtype),
               jax.ShapeDtypeStruct((bsz, hv, kdim, vd), f32)]
  if store:  # the states (``BF16_STORES``) and V' in the kernels' dtype, as this kernel's
    # products take it (bf16: half the bytes). The dense backward rounds V' to bf16 anyway (the
    # same results); the general path's three-pass products see the value the forward used
    out_shape += [jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), _store_dtype(cfg, "h")),
                  jax.ShapeDtypeStruct((bsz, tp, hv, vd), w.dtype)]
  kern = functools.partial(_fwd_kernel, nc=nc, hv=hv, c=c, bv=bv, store=store)
  return pl.pallas_call(kern, out_shape=out_shape, grid=(vd // bv, bsz * hv),
                        compiler_params=_params(num_stages=_recur_stages(c, kdim, bv, w, u)),
                        interpret=_interpret(),
                        name="kda_fwd_recurrence")(w, u, qg, aqk, kd, gc, s0)


def _recurrence_bwd(cfg, do, qg, aqk, kd, w, gc, dst):
  bsz, tp, hv, kdim = w.shape
  vd = do.shape[-1]
  c, nc = cfg.chunk, tp // cfg.chunk
  bv = _mosaic(cfg, w, do, _store_dtype(cfg, "dvn"), _store_dtype(cfg, "dh"))
  if bv:
    return recurrence_mgpu.recurrence_bwd(do, qg, aqk, kd, w, gc, dst, block_v=bv,
                                          stages=MGPU_STAGES, interpret=_interpret())
  bv = _v_tile(bsz * hv, vd)
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, hv, vd), _store_dtype(cfg, "dvn")),
               jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), _store_dtype(cfg, "dh")),
               jax.ShapeDtypeStruct((bsz, hv, kdim, vd), f32)]
  kern = functools.partial(_bwd_kernel, nc=nc, hv=hv, c=c, bv=bv)
  return pl.pallas_call(kern, out_shape=out_shape, grid=(vd // bv, bsz * hv),
                        compiler_params=_params(num_stages=_recur_stages(c, kdim, bv, w, do)),
                        interpret=_interpret(),
                        name="kda_bwd_recurrence")(do, qg, aqk, kd, w, gc, dst)


# ------------------------------------------------------------------------------------------
# 3. custom VJP
# ------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda_core(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg):
  return _forward(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg, save=False)[0]


def _pad(tp, *xs):
  t = xs[0].shape[1]
  if tp == t:
    return xs
  return tuple(jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2)) for x in xs)


def _forward(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg, save):
  """((o, final state), what the backward reuses: None, or with ``save`` the chunk factors,
  the inverse's factors, the chunk states and V')."""
  t = q.shape[1]
  padded = _pad(seg.shape[1], q, k, v, g, beta)
  factors, kept = _prepare(cfg, *padded, A_log, dt_bias, seg, t, keep=save)
  o, st, *states = _recurrence_fwd(cfg, *factors, s0, v.dtype, store=save)
  return (o[:, :t], st), ((factors, kept, *states) if save else None)


def _kda_fwd(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg):
  # ``cfg.save_residuals``: keep the forward's chunk factors, chunk states and V' for the
  # backward instead of recomputing them there (the backward's kda_chunk_a, kda_chunk_wu and
  # storing recurrence): fwd+bwd 9.92 instead of 12.01 ms at B1 T16384 H32 on the H200
  # (2026-12-01; 6.64 against 8.47 on 2026-12-02). Per token and value head at K = V = 128,
  # C = 64, bf16: ~2.6 KB (the bf16 states 0.5 KB, V' 0.25 KB), i.e. 1.4 GB at B1 T16384 H32
  # (1.7 GB with float32 states). Under a remat policy they are kept only where it keeps Pallas
  # outputs (``dots_kernels``); elsewhere the layer's recomputed forward produces them again,
  # held while that layer's backward runs.
  out, saved = _forward(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg, save=cfg.save_residuals)
  return out, (q, k, v, g, beta, A_log, dt_bias, s0, seg, saved)


def _kda_bwd(cfg, res, cts):
  q, k, v, g, beta, A_log, dt_bias, s0, seg, saved = res
  do, dst = cts
  t, tp = q.shape[1], seg.shape[1]
  padded = _pad(tp, q, k, v, g, beta)
  if saved is None:  # recompute the chunk factors, the chunk states and V'
    factors, kept = _prepare(cfg, *padded, A_log, dt_bias, seg, t, keep=True)
    _, _, hs, vn = _recurrence_fwd(cfg, *factors, s0, v.dtype, store=True)
  else:
    factors, kept, hs, vn = saved
  w, u, qg, aqk, kd, gc = factors
  (do,) = _pad(tp, do)
  dvn, dh, ds0 = _recurrence_bwd(cfg, do, qg, aqk, kd, w, gc, dst.astype(jnp.float32))
  dq, dk, dv, dg, dbeta = _prepare_bwd(cfg, *padded, A_log, dt_bias, seg, hs, dh, vn, dvn, do,
                                       t, kept)
  dq, dk, dg, dbeta, dalog, ddtb = preprocess_vjp(cfg, q, k, g, beta, A_log, dt_bias, dq, dk, dg,
                                                  dbeta)
  return dq, dk, dv[:, :t], dg, dbeta, dalog, ddtb, ds0, None


_kda_core.defvjp(_kda_fwd, _kda_bwd)


# ------------------------------------------------------------------------------------------
# public entry
# ------------------------------------------------------------------------------------------

def kda(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None, use_qk_l2norm=False,
        A_log=None, dt_bias=None, gate=None, lower_bound=-5.0, beta_is_logit=False,
        chunk_size=64, save_residuals=True):
  """Chunked KDA on GPU (interpret mode elsewhere). See :func:`pallas_kernels.kda.kda`.

  Returns ``(o [B, T, HV, V] in v.dtype, final_state [B, HV, K, V] float32)``.
  """
  bsz, t, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  if k.shape != q.shape:
    raise ValueError(f"kda: k {k.shape} must match q {q.shape}")
  if v.shape[:2] != (bsz, t) or hv % h:
    raise ValueError(f"kda: v {v.shape} must be [B, T, HV, V] with HV a multiple of H={h}")
  if g.shape != (bsz, t, hv, kd) or beta.shape != (bsz, t, hv):
    raise ValueError(f"kda: g {g.shape} / beta {beta.shape} must be [B,T,HV,K] / [B,T,HV]")
  if not (_pow2(kd) and _pow2(vd)):
    raise ValueError(f"kda(pallas_gpu): head dims K={kd}, V={vd} must be powers of two >= 16")
  if chunk_size not in (16, 32, 64):
    raise ValueError(f"kda(pallas_gpu): chunk_size {chunk_size} must be 16, 32 or 64")
  if gate is not None and (A_log is None or dt_bias is None):
    raise ValueError("kda: gate set but A_log / dt_bias missing")
  if gate is None:
    A_log, dt_bias = jnp.zeros((hv,), jnp.float32), jnp.zeros((hv * kd,), jnp.float32)
  dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
  cfg = _Config(scale=float(scale), chunk=chunk_size, use_qk_l2norm=bool(use_qk_l2norm),
                gate=gate, lower_bound=float(lower_bound), beta_is_logit=bool(beta_is_logit),
                diag_rows=diag_rows(gate, float(lower_bound), chunk_size),
                dtype=jnp.dtype(dtype).name, save_residuals=bool(save_residuals))
  tp = -(-t // chunk_size) * chunk_size
  seg = jnp.cumsum(restart_mask(segment_ids, bsz, t).astype(jnp.int32), axis=1)
  seg = jnp.pad(seg, ((0, 0), (0, tp - t)), mode="edge")
  s0 = (jnp.zeros((bsz, hv, kd, vd), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  o, st = _kda_core(cfg, q, k, v, g, beta, A_log.reshape(hv).astype(jnp.float32),
                    dt_bias.reshape(hv, kd).astype(jnp.float32), s0, seg)
  return o, st
