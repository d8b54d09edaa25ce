"""The general path's chunk-local kernels (any gate), Pallas GPU: one program per (chunk,
batch * value head) forms the chunk's factors (``kda_chunk_prep``) and, in the backward, the
gradients of its pre-processed inputs (``kda_chunk_prep_bwd``).

Triton cannot slice register tensors, so a chunk is handled as C/16 row tiles of 16 tokens,
each loaded separately; [C, C] matrices are grids of 16x16 tiles (Python lists). A pair product
``sum_d a_id b_jd exp(G_id - G_jd)`` (i >= j) takes its reference at the start of each 16-row
tile (off-diagonal tiles have both factors <= 1) and forms the diagonal tiles pair by pair.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import chunk_ops
from pallas_kernels.kda.chunk_ops import HI, call, lower_inverse, tok
from pallas_kernels.kda.config import SUB, X3, KdaOptions
from pallas_kernels.kda.reference import L2_EPS


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
  mm = functools.partial(chunk_ops.mm, precision=HI)
  x = [[None] * n for _ in range(n)]
  for a in range(n):
    inv = x[a][a] = lower_inverse(akk[a][a], SUB, precision=HI)
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
  mm = functools.partial(chunk_ops.mm, dt=dt)
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
  # the gate gradient is a small difference of large terms: ~16 mantissa bits, not bf16's 8
  mmx = functools.partial(chunk_ops.mm, precision=X3)
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
  mm = functools.partial(chunk_ops.mm, precision=HI)
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



def prepare(cfg: KdaOptions, q, k, v, g, beta, A_log, dt_bias, seg, t):
  """``kda_chunk_prep``: the chunk factors ``(w, u, qg, aqk, kd, gc)`` (see ``gpu.prepare``)."""
  bsz, tp, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  c = cfg.chunk
  dt = jnp.dtype(cfg.dtype)
  kern = functools.partial(_prep_kernel, cfg=cfg, hv=hv, group=hv // h, t=t)
  return call(cfg, kern, "kda_chunk_prep", (tp // c, bsz * hv),
              [tok(v, kd, dt), tok(v, vd, dt), tok(v, kd, dt), tok(v, c, dt), tok(v, kd, dt),
               jax.ShapeDtypeStruct((bsz, tp // c, hv, kd), jnp.float32)],
              q, k, v, g, beta, A_log, dt_bias, seg)


def prepare_bwd(cfg: KdaOptions, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn, do, t):
  """``kda_chunk_prep_bwd``: (dq, dk, dv, dg, dbeta) (see ``gpu.prepare_bwd``)."""
  bsz, tp, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  f32 = jnp.float32
  kern = functools.partial(_prep_bwd_kernel, cfg=cfg, hv=hv, group=hv // h, t=t)
  return call(cfg, kern, "kda_chunk_prep_bwd", (tp // cfg.chunk, bsz * hv),
              [tok(v, kd, f32), tok(v, kd, f32), tok(v, vd, v.dtype), tok(v, kd, f32),
               jax.ShapeDtypeStruct((bsz, tp, hv), f32)],
              q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn, do)
