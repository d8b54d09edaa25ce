"""Pallas GPU (Triton lowering) chunked Kimi Delta Attention with a custom VJP.

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``;
state ``[B, HV, K, V]`` float32; ``HV`` a multiple of ``H``.

The work is split the way it parallelises (SPEC section 2, chunks of C tokens):

1. The chunk-local kernel (one program per (chunk, batch*value head), fully parallel): the
   optional fused pre-processing (L2 norm, gate from ``f, A_log, dt_bias``, beta sigmoid), the
   in-chunk cumulative decay ``G``, the gated pair products, ``(I + A_kk)^-1`` and the factors
   ``W, U, QG = scale q e^G, A_qk, KD = k e^{G_C - G}, gC = e^{G_C}``. Segment restarts are
   folded in as masks, so the sequential pass has no branches. Two versions with the same
   inputs and outputs: ``_dense_kernel`` (bounded gate, section 1b: the chunk as full [C, C] and
   [C, K-slice] tiles, every product a full matrix-unit product) and ``_prep_kernel`` (any gate,
   section 1: 16-row tiles, diagonal tiles pair by pair when the gate is unbounded).
2. ``_fwd_kernel`` (grid (B*HV, V tiles), sequential over chunks): the state tile ``S [K, BV]``
   stays in registers; per chunk ``V' = U - W S``, ``O = QG S + A_qk V'``,
   ``S = gC * S + KD^T V'``.
3. Backward: ``_fwd_kernel`` again, storing the chunk states and V'; ``_bwd_kernel`` carries
   ``dS`` backwards and writes ``dV'`` and the state gradients; ``_dense_bwd_kernel`` /
   ``_prep_bwd_kernel`` (parallel over chunks) recompute step 1 and return the gradients of the
   pre-processed inputs; the pre-processing VJP is XLA. Nothing is stored between the passes but
   the inputs.

Sub-tile gating: a pair product ``sum_d a_id b_jd exp(G_id - G_jd)`` (i >= j) is split at the
start ``r`` of the row tile: ``(a e^{G - r}) (b e^{r - G})^T``. Off-diagonal tiles have both
factors <= 1. Diagonal 16x16 tiles are dense products only for the bounded gate (``g >
lower_bound`` keeps ``e^{r - G} <= e^{-16 lower_bound}`` inside float32); otherwise they are
formed pair by pair.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.reference import L2_EPS, kda_gate, l2norm, restart_mask

SUB = 16  # sub-tile rows of the gated pair products
_MAX_EXP = 85.0  # largest exponent a dense diagonal sub-tile may need (float32 max ~ e^88)


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  chunk: int
  use_qk_l2norm: bool
  gate: str | None
  lower_bound: float
  beta_is_logit: bool
  dense_diag: bool
  dtype: str  # matrix-unit operand dtype of the kernels


def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def _pow2(n: int) -> bool:
  return n >= 16 and n & (n - 1) == 0


def _v_tile(n_rows: int, vd: int) -> int:
  """V-tile width: enough (batch, head, tile) programs to fill ~132 SMs, at least 16 wide."""
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
    """x_c * exp(r_a - G_c) (c <= a): <= 1 for c < a, <= exp(-16 lower_bound) for c == a."""
    return x * jnp.exp(self.r[a][None, :] - self.G[c])


def _pair_tile(ch, cfg, a_t, b_t, a, c, mm):
  """[16, 16] tile (a, c), c <= a, of ``P_ij = sum_d a_id b_jd exp(G_id - G_jd)`` (unmasked);
  ``mm`` is the matrix product to use."""
  if c < a or cfg.dense_diag:
    return mm(ch.pos(a_t, a), ch.neg(b_t, a, c), tb=True)
  G = ch.G[a]
  cid = jnp.arange(SUB)[None, :]

  def col(j, tile):
    e = jnp.exp(jnp.minimum(G - _row(G, j)[None, :], 0.0))
    v = jnp.sum(a_t * _row(b_t, j)[None, :] * e, axis=1)
    return jnp.where(cid == j, v[:, None], tile)

  return jax.lax.fori_loop(0, SUB, col, jnp.zeros((SUB, SUB), jnp.float32))


def _pair_grads(ch, cfg, a_side, b_side, dP, mm):
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
      if c < a or cfg.dense_diag:
        acc = acc + mm(dP[a][c], ch.neg(b_side[c], a, c))
        db[c] = db[c] + ch.neg(mm(dP[a][c], ch.pos(a_side[a], a), ta=True), a, c)
    da[a] = ch.pos(acc, a)
    if not cfg.dense_diag:  # diagonal tile pair by pair
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
  eye = (jnp.arange(SUB)[:, None] == jnp.arange(SUB)[None, :]).astype(jnp.float32)
  mm = functools.partial(_mm, precision=_HI)
  x = [[None] * n for _ in range(n)]
  for a in range(n):
    L = akk[a][a]  # nilpotent (L^16 = 0): (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)
    inv = eye - L
    p = mm(L, L)
    for _ in range(3):
      inv = mm(inv, eye + p)
      p = mm(p, p)
    x[a][a] = inv
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
      pkk[a][c] = jnp.where(ch.mask(a, c, True), _pair_tile(ch, cfg, ch.k[a], ch.k[c], a, c, mm),
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
                      cfg.scale * _pair_tile(ch, cfg, ch.q[a], ch.k[c], a, c, mm), 0.0)
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
  da, db = _pair_grads(ch, cfg, ch.k, ch.k, dpkk, mmx)
  for a in range(n):
    dk[a] = dk[a] + da[a] + db[a]
    dG[a] = dG[a] + ch.k[a] * (da[a] - db[a])
  da, db = _pair_grads(ch, cfg, ch.q, ch.k, dpqk, mmx)
  for a in range(n):
    dq[a] = dq[a] + da[a]
    dk[a] = dk[a] + db[a]
    dG[a] = dG[a] + ch.q[a] * da[a] - ch.k[a] * db[a]
  # G = cumsum(g): dg_i = sum_{t >= i} dG_t, plus dG at the chunk end for every row
  tail = dgl
  for a in range(n - 1, -1, -1):
    tot = jnp.sum(dG[a], axis=0)
    dg = tail[None, :] + tot[None, :] - jnp.cumsum(dG[a], axis=0) + dG[a]
    tail = tail + tot
    dq_ref[b, rows[a], h, :] = dq[a]
    dk_ref[b, rows[a], h, :] = dk[a]
    dv_ref[b, rows[a], h, :] = ch.beta[a][:, None] * dz[a]
    dg_ref[b, rows[a], h, :] = dg
    dbeta_ref[b, rows[a], h] = dbeta[a]


# ------------------------------------------------------------------------------------------
# 1b. chunk-local work on full [C, C] / [C, BK] tiles (bounded gate: the dense path)
# ------------------------------------------------------------------------------------------
# The whole chunk is one tile of C rows; the K axis is walked in slices of ``SLICE_K``
# channels (the decay is per channel, so every slice is independent until the [C, C] sums).
# Pair products use one reference point per 16-row block ``I`` (``r_I``: G just before the
# block): rows of block I take ``a e^{G - r_I}`` (<= 1), columns up to block I take
# ``b e^{r_I - G}`` (<= 1 before the block, <= e^{-16 lower_bound} inside it), so a [C, C]
# product is the sum of C/16 full products whose left operand is masked to one row block.

SLICE_K = 64  # K channels per slice of the dense path


class _Dense:
  """The per-token values of one chunk as [C] / [C, BK] tiles (trace-time helper)."""

  def __init__(self, cfg, refs, b, h, hq, c0, t, kd):
    q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref = refs
    f32 = jnp.float32
    c = cfg.chunk
    self.cfg, self.refs, self.b, self.h, self.hq, self.c0, self.t = cfg, refs, b, h, hq, c0, t
    self.bk = min(kd, SLICE_K)
    self.ns = kd // self.bk
    self.rows = pl.ds(c0, c)
    self.rid = jnp.arange(c)[:, None]
    cid = jnp.arange(c)[None, :]
    self.valid = (c0 + jnp.arange(c)) < t  # padded tokens leave the state alone
    beta = beta_ref[b, self.rows, h].astype(f32)
    if cfg.beta_is_logit:
      beta = jax.nn.sigmoid(beta)
    self.beta = jnp.where(self.valid, beta, 0.0)
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
    if cfg.use_qk_l2norm:
      sq = sk = jnp.zeros((c, 1), f32)
      for s in range(self.ns):
        q, k = self._qk(s)
        sq = sq + jnp.sum(q * q, axis=1, keepdims=True)
        sk = sk + jnp.sum(k * k, axis=1, keepdims=True)
      self.rq, self.rk = jax.lax.rsqrt(sq + L2_EPS), jax.lax.rsqrt(sk + L2_EPS)

  def _qk(self, s):
    q_ref, k_ref = self.refs[:2]
    cols = pl.ds(s * self.bk, self.bk)
    return (q_ref[self.b, self.rows, self.hq, cols].astype(jnp.float32),
            k_ref[self.b, self.rows, self.hq, cols].astype(jnp.float32))

  def slice(self, s):
    """q, k (normalised if fused), G (cumulative log decay from the chunk start): [C, BK]."""
    cfg, (_, _, g_ref, _, alog_ref, dtb_ref, _) = self.cfg, self.refs
    cols = pl.ds(s * self.bk, self.bk)
    q, k = self._qk(s)
    if self.rq is not None:
      q, k = q * self.rq, k * self.rk
    g = g_ref[self.b, self.rows, self.h, cols].astype(jnp.float32)
    if cfg.gate is not None:
      x = g + dtb_ref[self.h, cols][None, :]
      e = jnp.exp(alog_ref[self.h])
      g = (cfg.lower_bound * jax.nn.sigmoid(e * x) if cfg.gate == "bounded"
           else -e * jax.nn.softplus(x))
    g = jnp.where(self.valid[:, None], g, 0.0)
    return q, k, jnp.cumsum(g, axis=0)

  def row(self, x, i):
    """Row i of a [C, BK] tile as [BK] (masked reduction)."""
    return jnp.sum(jnp.where(self.rid == i, x, 0.0), axis=0)

  def blocks(self, G):
    """Per 16-row block I: (row mask [C, 1], column factor e^{r_I - G} [C, BK] zeroed after
    block I); and e^{G - r} [C, BK] with each row's own block reference."""
    out = []
    ref_rows = jnp.zeros_like(G)
    for i in range(self.cfg.chunk // SUB):
      r = jnp.zeros((G.shape[1],), G.dtype) if i == 0 else self.row(G, i * SUB - 1)
      rows = (self.rid >= i * SUB) & (self.rid < (i + 1) * SUB)
      ref_rows = jnp.where(rows, r[None, :], ref_rows)
      col = jnp.where(self.rid < (i + 1) * SUB, jnp.exp(jnp.minimum(r[None, :] - G, _MAX_EXP)),
                      0.0)
      out.append((rows, col))
    return out, jnp.exp(G - ref_rows)


def _dense_inverse(a, c):
  """``(I + a)^-1`` for a strictly lower [C, C] ``a``: the 16x16 diagonal blocks by the
  nilpotent series ``(I - D)(I + D^2)(I + D^4)(I + D^8)``, then ``(I + D^-1 E)^-1 D^-1`` with the
  block-strictly-lower rest ``E`` by the same doubling (``(D^-1 E)^{C/16} = 0``). Float32
  products (TF32 on the GPU's matrix units)."""
  mm = _mm
  ii, jj = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
  eye = (ii == jj).astype(jnp.float32)
  blk = (ii // SUB) == (jj // SUB)
  d = jnp.where(blk, a, 0.0)
  p = mm(d, d)
  inv = mm(eye - d, eye + p)
  for _ in range(2):
    p = mm(p, p)
    inv = mm(inv, eye + p)
  if c == SUB:
    return inv
  m = mm(inv, jnp.where(blk, 0.0, a))
  x, p, span = eye - m, m, 2
  while span < c // SUB:
    p = mm(p, p)
    x = mm(x, eye + p)
    span *= 2
  return mm(x, inv)


def _dense_setup(ch, with_qk):
  """Masked ``P_kk`` (and the scaled ``A_qk`` if ``with_qk``) [C, C] of one chunk (products
  in ``cfg.dtype``) and the inverse of ``I + diag(beta) P_kk``."""
  c = ch.cfg.chunk
  mm = functools.partial(_mm, dt=jnp.dtype(ch.cfg.dtype))
  pkk = jnp.zeros((c, c), jnp.float32)
  pqk = jnp.zeros((c, c), jnp.float32) if with_qk else None
  for s in range(ch.ns):
    q, k, G = ch.slice(s)
    blocks, e_row = ch.blocks(G)
    lk, lq = k * e_row, q * e_row
    for rows, col in blocks:
      rk = k * col
      pkk = pkk + mm(jnp.where(rows, lk, 0.0), rk, tb=True)
      if with_qk:
        pqk = pqk + mm(jnp.where(rows, lq, 0.0), rk, tb=True)
  pkk = jnp.where(ch.strict, pkk, 0.0)
  aqk = jnp.where(ch.incl, ch.cfg.scale * pqk, 0.0) if with_qk else None
  return pkk, aqk, _dense_inverse(ch.beta[:, None] * pkk, c)


def _dense_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref,
                  w_ref, u_ref, qg_ref, a_ref, kd_ref, gc_ref, *, cfg, hv, group, t):
  """Dense-path twin of :func:`_prep_kernel` (same outputs)."""
  ci, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  c0 = ci * cfg.chunk
  kdim, vd = q_ref.shape[-1], v_ref.shape[-1]
  dt = jnp.dtype(cfg.dtype)
  ch = _Dense(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, c0, t, kdim)
  mm = functools.partial(_mm, dt=dt)
  _, aqk, x = _dense_setup(ch, True)
  a_ref[b, ch.rows, h, :] = aqk.astype(dt)
  rows, bk = ch.rows, ch.bk
  for s in range(ch.ns):
    cols = pl.ds(s * bk, bk)
    q, k, G = ch.slice(s)
    eg = jnp.exp(G)
    gl = ch.row(G, cfg.chunk - 1)
    qg_ref[b, rows, h, cols] = (cfg.scale * ch.cont[:, None] * q * eg).astype(dt)
    kd_ref[b, rows, h, cols] = (ch.last[:, None] * k * jnp.exp(gl[None, :] - G)).astype(dt)
    gc_ref[b, ci, h, cols] = ch.cont_last * jnp.exp(gl)
    w = mm(x, ch.beta[:, None] * eg * k)
    w_ref[b, rows, h, cols] = (ch.cont[:, None] * w).astype(w_ref.dtype)
  for s in range(vd // min(vd, SLICE_K)):
    cols = pl.ds(s * min(vd, SLICE_K), min(vd, SLICE_K))
    z = ch.beta[:, None] * v_ref[b, rows, h, cols].astype(jnp.float32)
    u_ref[b, rows, h, cols] = mm(x, z).astype(u_ref.dtype)


def _dense_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref,
                      h_ref, dh_ref, vn_ref, dvn_ref, do_ref,
                      dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, cfg, hv, group, t):
  """Dense-path twin of :func:`_prep_bwd_kernel` (same inputs and outputs)."""
  ci, bh = pl.program_id(0), pl.program_id(1)
  b, h = bh // hv, bh % hv
  c0 = ci * cfg.chunk
  kdim = q_ref.shape[-1]
  f32 = jnp.float32
  mm, mmx = _mm, functools.partial(_mm, precision=_X3)  # float32 (TF32) / three bf16 passes
  ch = _Dense(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, c0, t, kdim)
  rows, bk, beta = ch.rows, ch.bk, ch.beta[:, None]
  ld = lambda ref: ref[b, rows, h, :].astype(f32)
  state = lambda ref, s: ref[b, ci, h, pl.ds(s * bk, bk), :]
  pkk, _, x = _dense_setup(ch, False)
  # WY factors W = X Y, U = X Z: dX = dW Y^T + dU Z^T, dY = X^T dW, dZ = X^T dU
  v = ld(v_ref)
  dx = mm(ld(dvn_ref), beta * v, tb=True)
  dz = mm(x, ld(dvn_ref), ta=True)
  dbeta = jnp.sum(dz * v, axis=1)
  dy = []
  for s in range(ch.ns):
    _, k, G = ch.slice(s)
    dw = -ch.cont[:, None] * mm(ld(dvn_ref), state(h_ref, s), tb=True)
    dx = dx + mm(dw, beta * jnp.exp(G) * k, tb=True)
    dy.append(mm(x, dw, ta=True))
  # dA_kk = -X^T dX X^T on the strictly lower same-segment pairs (upper parts of dX drop out)
  da = jnp.where(ch.strict, -mm(mm(x, dx, ta=True), x, tb=True), 0.0)
  dbeta = dbeta + jnp.sum(da * pkk, axis=1)
  dpkk = beta * da
  dpqk = jnp.where(ch.incl, cfg.scale * mm(ld(do_ref), ld(vn_ref), tb=True), 0.0)
  for s in range(ch.ns):
    cols = pl.ds(s * bk, bk)
    q, k, G = ch.slice(s)
    eg = jnp.exp(G)
    gl = ch.row(G, cfg.chunk - 1)
    dbeta = dbeta + jnp.sum(dy[s] * eg * k, axis=1)
    dk = beta * eg * dy[s]
    dG = dy[s] * beta * eg * k
    st, dst = state(h_ref, s), state(dh_ref, s)
    dqg = mm(ld(do_ref), st, tb=True)
    dq = cfg.scale * ch.cont[:, None] * eg * dqg
    dG = dG + q * dq
    dec = ch.last[:, None] * jnp.exp(gl[None, :] - G)
    dkd = dec * mm(ld(vn_ref), dst, tb=True)
    dk = dk + dkd
    dG = dG - k * dkd
    dgl = ch.cont_last * jnp.exp(gl) * jnp.sum(st * dst, axis=1) + jnp.sum(k * dkd, axis=0)
    # pair products P_kk (gradient dpkk) and P_qk (dpqk), both with k on the column side; the
    # gate gradient is a small difference of their large terms: three-pass products
    blocks, e_row = ch.blocks(G)
    lk, lq = k * e_row, q * e_row
    dak = daq = db = jnp.zeros_like(k)
    for rws, col in blocks:
      rk = k * col
      pk, pq = jnp.where(rws, dpkk, 0.0), jnp.where(rws, dpqk, 0.0)
      dak = dak + mmx(pk, rk)
      daq = daq + mmx(pq, rk)
      db = db + col * (mmx(pk, lk, ta=True) + mmx(pq, lq, ta=True))
    dak, daq = dak * e_row, daq * e_row
    dk = dk + dak + db
    dq = dq + daq
    dG = dG + k * (dak - db) + q * daq
    # G = cumsum(g): dg_i = sum_{t >= i} dG_t, plus dG at the chunk end for every row
    dg = dgl[None, :] + jnp.sum(dG, axis=0)[None, :] - jnp.cumsum(dG, axis=0) + dG
    dq_ref[b, rows, h, cols] = dq
    dk_ref[b, rows, h, cols] = dk
    dg_ref[b, rows, h, cols] = dg
  dv_ref[b, rows, h, :] = beta * dz
  dbeta_ref[b, rows, h] = dbeta


def _prepare(cfg, q, k, v, g, beta, A_log, dt_bias, seg, t):
  """Chunk-local factors: w, qg, kd ``[B, Tp, HV, K]``, u ``[B, Tp, HV, V]``, aqk
  ``[B, Tp, HV, C]`` (``cfg.dtype``) and gc ``[B, NC, HV, K]`` float32. Inputs padded to Tp; the
  first ``t`` tokens are real."""
  bsz, tp, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  c, nc = cfg.chunk, tp // cfg.chunk
  dt = jnp.dtype(cfg.dtype)
  kern = functools.partial(_dense_kernel if cfg.dense_diag else _prep_kernel, cfg=cfg, hv=hv,
                           group=hv // h, t=t)
  warps = (DENSE_WARPS if cfg.dense_diag else PREP_WARPS)[0]
  return pl.pallas_call(
      kern, grid=(nc, bsz * hv), compiler_params=_params(warps, 1),
      interpret=_interpret(),
      out_shape=[jax.ShapeDtypeStruct((bsz, tp, hv, kd), dt),
                 jax.ShapeDtypeStruct((bsz, tp, hv, vd), dt),
                 jax.ShapeDtypeStruct((bsz, tp, hv, kd), dt),
                 jax.ShapeDtypeStruct((bsz, tp, hv, c), dt),
                 jax.ShapeDtypeStruct((bsz, tp, hv, kd), dt),
                 jax.ShapeDtypeStruct((bsz, nc, hv, kd), jnp.float32)],
      name="kda_chunk_prep")(q, k, v, g, beta, A_log, dt_bias, seg)


def _prepare_bwd(cfg, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn, do, t):
  bsz, tp, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  nc = tp // cfg.chunk
  f32 = jnp.float32
  kern = functools.partial(_dense_bwd_kernel if cfg.dense_diag else _prep_bwd_kernel, cfg=cfg,
                           hv=hv, group=hv // h, t=t)
  warps = (DENSE_WARPS if cfg.dense_diag else PREP_WARPS)[1]
  return pl.pallas_call(
      kern, grid=(nc, bsz * hv), compiler_params=_params(warps, 1),
      interpret=_interpret(),
      out_shape=[jax.ShapeDtypeStruct((bsz, tp, hv, kd), f32),
                 jax.ShapeDtypeStruct((bsz, tp, hv, kd), f32),
                 jax.ShapeDtypeStruct((bsz, tp, hv, vd), f32),
                 jax.ShapeDtypeStruct((bsz, tp, hv, kd), f32),
                 jax.ShapeDtypeStruct((bsz, tp, hv), f32)],
      name="kda_chunk_prep_bwd")(q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn, do)


def _preprocess(cfg, q, k, g, beta, A_log, dt_bias):
  """The fused pre-processing in XLA (float32), for its VJP in the backward pass."""
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
  """Grid (B*HV, V/BV). o ``[B, Tp, HV, V]``, st ``[B, HV, K, V]``; with ``store`` also
  h ``[B, NC, HV, K, V]`` (state entering each chunk) and vn ``[B, Tp, HV, V]`` (V')."""
  bh, iv = pl.program_id(0), pl.program_id(1)
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
      rest[1][b, rows, h, vs] = vn.astype(rest[1].dtype)
    return gc_ref[b, ci, h, :][:, None] * s + _dot(kd_ref[b, rows, h, :], vnb, trans_a=True)

  s = jax.lax.fori_loop(0, nc, body, s0_ref[b, h, :, vs].astype(jnp.float32))
  st_ref[b, h, :, vs] = s


def _bwd_kernel(do_ref, qg_ref, a_ref, kd_ref, w_ref, gc_ref, dst_ref, dvn_ref, dh_ref, ds0_ref,
                *, nc, hv, c, bv):
  """Reverse pass. dvn ``[B, Tp, HV, V]`` (gradient of V'), dh ``[B, NC, HV, K, V]`` (gradient
  of the state leaving each chunk), ds0 ``[B, HV, K, V]``."""
  bh, iv = pl.program_id(0), pl.program_id(1)
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


# Warps of the chunk-local kernels (forward, backward), 16-row-tile and dense versions: their
# many live tiles make register pressure the first thing to tune (`benchmarks/kda.py --sweep`
# times the dense ones at other counts; not yet measured, so these are first guesses).
PREP_WARPS = (4, 4)
DENSE_WARPS = (4, 8)


def _recurrence_fwd(cfg, w, u, qg, aqk, kd, gc, s0, out_dtype, store):
  bsz, tp, hv, kdim = w.shape
  vd = u.shape[-1]
  c, nc = cfg.chunk, tp // cfg.chunk
  bv = _v_tile(bsz * hv, vd)
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, hv, vd), out_dtype),
               jax.ShapeDtypeStruct((bsz, hv, kdim, vd), f32)]
  if store:
    out_shape += [jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), f32),
                  jax.ShapeDtypeStruct((bsz, tp, hv, vd), f32)]
  kern = functools.partial(_fwd_kernel, nc=nc, hv=hv, c=c, bv=bv, store=store)
  return pl.pallas_call(kern, out_shape=out_shape, grid=(bsz * hv, vd // bv),
                        compiler_params=_params(), interpret=_interpret(),
                        name="kda_fwd_recurrence")(w, u, qg, aqk, kd, gc, s0)


def _recurrence_bwd(cfg, do, qg, aqk, kd, w, gc, dst):
  bsz, tp, hv, kdim = w.shape
  vd = do.shape[-1]
  c, nc = cfg.chunk, tp // cfg.chunk
  bv = _v_tile(bsz * hv, vd)
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((bsz, tp, hv, vd), f32),
               jax.ShapeDtypeStruct((bsz, nc, hv, kdim, vd), f32),
               jax.ShapeDtypeStruct((bsz, hv, kdim, vd), f32)]
  kern = functools.partial(_bwd_kernel, nc=nc, hv=hv, c=c, bv=bv)
  return pl.pallas_call(kern, out_shape=out_shape, grid=(bsz * hv, vd // bv),
                        compiler_params=_params(), interpret=_interpret(),
                        name="kda_bwd_recurrence")(do, qg, aqk, kd, w, gc, dst)


# ------------------------------------------------------------------------------------------
# 3. custom VJP
# ------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda_core(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg):
  return _kda_fwd(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg)[0]


def _pad(tp, *xs):
  t = xs[0].shape[1]
  if tp == t:
    return xs
  return tuple(jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2)) for x in xs)


def _kda_fwd(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg):
  t = q.shape[1]
  padded = _pad(seg.shape[1], q, k, v, g, beta)
  w, u, qg, aqk, kd, gc = _prepare(cfg, *padded, A_log, dt_bias, seg, t)
  o, st = _recurrence_fwd(cfg, w, u, qg, aqk, kd, gc, s0, v.dtype, store=False)
  return (o[:, :t], st), (q, k, v, g, beta, A_log, dt_bias, s0, seg)


def _kda_bwd(cfg, res, cts):
  q, k, v, g, beta, A_log, dt_bias, s0, seg = res
  do, dst = cts
  bsz, t, h, kdim = q.shape
  hv = v.shape[2]
  tp = seg.shape[1]
  padded = _pad(tp, q, k, v, g, beta)
  w, u, qg, aqk, kd, gc = _prepare(cfg, *padded, A_log, dt_bias, seg, t)
  _, _, hs, vn = _recurrence_fwd(cfg, w, u, qg, aqk, kd, gc, s0, v.dtype, store=True)
  (do,) = _pad(tp, do)
  dvn, dh, ds0 = _recurrence_bwd(cfg, do, qg, aqk, kd, w, gc, dst.astype(jnp.float32))
  dq, dk, dv, dg, dbeta = (x[:, :t] for x in _prepare_bwd(
      cfg, *padded, A_log, dt_bias, seg, hs, dh, vn, dvn, do, t))
  grp = lambda x: x.reshape(bsz, t, h, hv // h, kdim).sum(3)
  _, pre_vjp = jax.vjp(functools.partial(_preprocess, cfg), q, k, g, beta, A_log, dt_bias)
  dq, dk, dg, dbeta, dalog, ddtb = pre_vjp((grp(dq), grp(dk), dg, dbeta))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype),
          dbeta.astype(beta.dtype), dalog, ddtb, ds0, None)


_kda_core.defvjp(_kda_fwd, _kda_bwd)


# ------------------------------------------------------------------------------------------
# public entry
# ------------------------------------------------------------------------------------------

def kda(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None, use_qk_l2norm=False,
        A_log=None, dt_bias=None, gate=None, lower_bound=-5.0, beta_is_logit=False,
        chunk_size=64):
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
                dense_diag=gate == "bounded" and -SUB * float(lower_bound) <= _MAX_EXP,
                dtype=jnp.dtype(dtype).name)
  tp = -(-t // chunk_size) * chunk_size
  seg = jnp.cumsum(restart_mask(segment_ids, bsz, t).astype(jnp.int32), axis=1)
  seg = jnp.pad(seg, ((0, 0), (0, tp - t)), mode="edge")
  s0 = (jnp.zeros((bsz, hv, kd, vd), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  o, st = _kda_core(cfg, q, k, v, g, beta, A_log.reshape(hv).astype(jnp.float32),
                    dt_bias.reshape(hv, kd).astype(jnp.float32), s0, seg)
  return o, st
