"""The dense path: chunk-local kernels on full [C, C] / [C, BK] tiles, Pallas GPU.

The whole chunk is one tile of C rows; the K axis is walked in slices of ``slice_k`` channels
(the decay is per channel, so every slice is independent until the [C, C] sums). Pair products
use one reference point per block ``I`` of ``diag_rows`` rows, rows of block I taking
``a e^{G - r_I}`` and earlier columns ``b e^{r_I - G}`` (see ``_Dense.blocks``), so a [C, C]
product is a sum of full products whose left operand is masked to one row block:
  - the bounded gate: ``r_I`` G at the block's middle row; inside the block both factors stay
    within e^{(diag_rows / 2) |lower_bound|}, so the products cover the diagonal blocks too;
  - any gate (``sub_chunks``): every chunk first takes middle-row blocks of ``diag_rows`` rows
    (``KdaGpuConfig.speculative_rows``) as the bounded gate does, exponents clamped to
    ``MAX_EXP`` so that nothing overflows; ``kda_chunk_a`` flags the chunks whose gates do not
    keep every exponent within it (``_Dense.middle_fits``, at run time), and those are redone in
    place on 16-row sub-chunks (``kda_chunk_a_sub``, ``kda_chunk_dqkg_sub``): ``r_I`` G just
    before the sub-chunk, the products covering only earlier ones (factors <= 1), the diagonal
    16x16 blocks formed pair by pair with per-pair exponents ``min(G_i - G_j, 0)``
    (:func:`diag_pairs`, :func:`diag_pair_grads`). A chunk that fits runs the bounded gate's
    kernels; one that does not costs a second pass of its programs.

The work is split into short kernels with their intermediates in HBM, so that no program holds
more than a few [C, C] / [C, BK] float32 tiles and many programs are in flight:
  forward  ``kda_chunk_a``    gate, cumsum, P_kk [C, C] (strict, float32), A_qk, KD,
                              KG = k e^G, QG, gC (or ``a_mgpu``, Mosaic GPU);
           ``kda_chunk_a_sub`` (sub-chunks) P_kk, A_qk again where kda_chunk_a flagged;
           ``kda_chunk_wu``   X = (I + diag(beta) P_kk)^-1 (float32, kept for the backward),
                              W = X diag(beta) KG, U = X diag(beta) v (or ``wu_mgpu``);
  backward ``kda_chunk_dwy``  the WY part: dP_kk [C, C], dY = X^T dW [C, K], dv, dbeta (or
                              ``dwy_mgpu``, Mosaic GPU);
           ``kda_chunk_dqkg`` one program per ``dqkg_slice_k``-wide K slice: dq, dk, dg from
                              the pair products (dP_qk = scale dO V'^T formed in place from
                              the dO and V' tiles it loads anyway), the states and dY (or
                              ``dqkg_mgpu``, Mosaic GPU);
           ``kda_chunk_dqkg_sub`` (sub-chunks) the same again where kda_chunk_a flagged.
Every chunk kernel runs one program per SM (registers: 232-255); kda_chunk_dqkg and
kda_chunk_dwy spill (benchmarks/RESULTS.md, KDA runs 13-26).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import a_mgpu, chunk_ops, dqkg_mgpu, dwy_mgpu, wu_mgpu
from pallas_kernels.kda.chunk_ops import call, lower_inverse, tok
from pallas_kernels.kda.config import BF16, MAX_EXP, SUB, KdaOptions, interpret, store_dtype
from pallas_kernels.kda.reference import L2_EPS


class _Dense:
  """The per-token values of one chunk as [C] / [C, BK] tiles (trace-time helper). ``refs``
  are (q, k, g, beta, A_log, dt_bias, seg); q, k, g, A_log, dt_bias may be None for kernels
  that only need beta and the segment masks. ``norms`` (refs ``[B, Tp, HV]``), if given, hold
  the rows' inverse L2 norms of q and k (from ``kda_chunk_a``), else they are computed."""

  def __init__(self, cfg, refs, b, h, hq, c0, t, kd, slice_k=None, norms=None,
               dot_cumsum=False):
    q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref = refs
    f32 = jnp.float32
    c = cfg.chunk
    self.cfg, self.refs, self.b, self.h, self.hq, self.c0, self.t = cfg, refs, b, h, hq, c0, t
    self.dot_cumsum = dot_cumsum
    self.bk = min(kd, slice_k or cfg.tuning.slice_k)
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
    return q, k, dot_cumsum(g) if self.dot_cumsum else jnp.cumsum(g, axis=0)

  def middle_fits(self, G):
    """Scalar bool: whether this slice's gates let the middle-row references of ``diag_rows``-row
    blocks keep every exponent within ``MAX_EXP`` (else the chunk is redone on sub-chunks)."""
    _, _, _, ref_rows = self.blocks(G, sub=False)
    # one axis at a time: a whole-tile reduction fails to lower under an explicit mesh
    return jnp.max(jnp.max(jnp.abs(G - ref_rows), axis=0), axis=0) <= MAX_EXP

  def row(self, x, i):
    """Row i of a [C, BK] tile as [BK] (masked reduction)."""
    return jnp.sum(jnp.where(self.rid == i, x, 0.0), axis=0)

  def blocks(self, G, sub=False):
    """e^{G - r} [C, BK] with each row's own block reference, per block I a function returning
    (row mask [C, 1], column factor e^{r_I - G} [C, BK] zeroed from the column where the block's
    pairs stop being products), and the references r_I [BK].

    Middle-row references (the bounded gate): r_I is G at the middle row of block I of
    ``diag_rows`` rows and the products cover the block itself; no exponent of a row in or
    before its block exceeds ``diag_rows / 2`` gates (G falls with the row; see ``diag_rows``),
    so none overflows (those after it are zeroed). Sub-chunks (``sub``, any gate): r_I is G
    just before 16-row block I and the products cover only the columns before it (the first
    block has none), so every exponent is <= 0; the diagonal blocks are :func:`diag_pairs`'. The
    column factors are formed one at a time, where they are used."""
    n = SUB if sub else self.cfg.diag_rows
    at = (lambda i: i * n - 1) if sub else (lambda i: i * n + n // 2 - 1)  # row -1: r = 0
    refs = [self.row(G, at(i)) for i in range(self.cfg.chunk // n)]
    ref_rows = jnp.broadcast_to(refs[0][None, :], G.shape)
    for i in range(1, len(refs)):
      ref_rows = jnp.where(self.rid >= i * n, refs[i][None, :], ref_rows)
    # middle rows for a gate without a bound: exponents clamped (no inf; where the clamp bites,
    # ``middle_fits`` is False and the sub-chunks' products replace these)
    exp = ((lambda x: jnp.exp(jnp.minimum(x, MAX_EXP))) if self.cfg.sub_chunks and not sub
           else jnp.exp)

    def block(i):
      rows = (self.rid >= i * n) & (self.rid < (i + 1) * n)
      end = i * n if sub else (i + 1) * n
      return rows, jnp.where(self.rid < end, exp(refs[i][None, :] - G), 0.0)

    return ([functools.partial(block, i) for i in range(int(sub), len(refs))],
            exp(G - ref_rows), refs, ref_rows)


def _partner(x, j):
  """[C, BK]: row i is row ``j`` of the 16-row sub-chunk of row i of ``x [C, BK]`` (a masked
  reduction over each sub-chunk: Triton has no register gather)."""
  c, bk = x.shape
  x3 = x.reshape(c // SUB, SUB, bk)
  r = jnp.arange(SUB)[None, :, None]
  row = jnp.sum(jnp.where(r == j, x3, 0.0), axis=1, keepdims=True)
  return jnp.broadcast_to(row, x3.shape).reshape(c, bk)


def _blocks_of(x):
  """[C, C] -> [C, SUB]: row i's entries in the columns of its own sub-chunk, ``x[i, base_i + j]``
  (base_i the sub-chunk's first row)."""
  c = x.shape[0]
  n = c // SUB
  blk = jnp.arange(n)
  same = blk[:, None, None, None] == blk[None, None, :, None]
  return jnp.sum(jnp.where(same, x.reshape(n, SUB, n, SUB), 0.0), axis=2).reshape(c, SUB)


def _blocks_to(d):
  """The inverse of :func:`_blocks_of`, zero off the diagonal sub-blocks: [C, SUB] -> [C, C]."""
  c = d.shape[0]
  n = c // SUB
  blk = jnp.arange(n)
  same = blk[:, None, None, None] == blk[None, None, :, None]
  d4 = jnp.broadcast_to(d.reshape(n, SUB, 1, SUB), (n, SUB, n, SUB))
  return jnp.where(same, d4, 0.0).reshape(c, c)


def diag_pairs(lhs, k, G):
  """For each a in ``lhs`` ([C, BK] tiles): the diagonal 16x16 sub-blocks of the pair products
  ``a_i . k_j e^{G_i - G_j}`` as a [C, C] tile (zero off them; j > i unmasked), one column
  offset j of every sub-block at a time (unrolled: a loop inside the chunk loop of ``call``
  would keep Triton from pipelining that one), each exponent ``min(G_i - G_j, 0)`` formed per
  pair."""
  c = k.shape[0]
  cols = jnp.arange(SUB)[None, :]
  outs = [jnp.zeros((c, SUB), jnp.float32) for _ in lhs]
  for j in range(SUB):
    e = _partner(k, j) * jnp.exp(jnp.minimum(G - _partner(G, j), 0.0))
    outs = [jnp.where(cols == j, jnp.sum(a * e, axis=1, keepdims=True), o)
            for a, o in zip(lhs, outs)]
  return [_blocks_to(o) for o in outs]


def diag_pair_grads(a, k, G, dp):
  """The gradients (d a, d k) [C, BK] of :func:`diag_pairs`' products given their cotangent
  ``dp [C, C]`` (masked to the pairs that count)."""
  c, bk = k.shape
  cols = jnp.arange(SUB)[None, :]
  r = jnp.arange(SUB)[None, :, None]
  dpd = _blocks_of(dp)  # [C, SUB]: fewer registers than dp across the loop

  def step(j, carry):
    da, dk = carry
    dcol = jnp.sum(jnp.where(cols == j, dpd, 0.0), axis=1, keepdims=True)  # dP[i, base_i + j]
    e = dcol * jnp.exp(jnp.minimum(G - _partner(G, j), 0.0))
    da = da + e * _partner(k, j)
    part = jnp.sum((e * a).reshape(c // SUB, SUB, bk), axis=1, keepdims=True)
    return da, dk + jnp.where(r == j, part, 0.0).reshape(c, bk)

  zero = jnp.zeros((c, bk), jnp.float32)
  return jax.lax.fori_loop(0, SUB, step, (zero, zero))


def dot_cumsum(g):
  """``cumsum(g, axis=0)`` of a [C, BK] float32 tile as matrix-unit products with the
  lower-triangular ones, on three bf16 parts of g (``g = a + b + c`` exactly to float32): the
  sum in float32 without the scan across the rows' threads and warps."""
  rows = g.shape[0]
  tril = (jnp.arange(rows)[:, None] >= jnp.arange(rows)[None, :]).astype(jnp.bfloat16)
  total = None
  for _ in range(3):
    part = g.astype(jnp.bfloat16)
    g = g - part.astype(jnp.float32)
    total = chunk_ops.mm(tril, part) if total is None else total + chunk_ops.mm(tril, part)
  return total


def _ids(hv, pid, axis=0):
  """(chunk, batch, value head) of a chunk whose grid indices ``pid`` (from ``call``) have the
  chunk, B*HV at ``axis``, ``axis + 1``."""
  ci, bh = pid[axis], pid[axis + 1]
  return ci, bh // hv, bh % hv


def _slice_products(ch, mm, pkk, pqk, q, k, G, sub):
  """The pair products (P_kk, P_qk) [C, C] (unmasked) ``pkk, pqk`` with one K slice's parts
  added, from its q, k, G [C, BK]: ``sub`` on sub-chunks, else on the reference blocks of
  ``diag_rows`` rows."""
  blocks, e_row, _, _ = ch.blocks(G, sub)
  lk, lq = k * e_row, q * e_row
  for block in blocks:
    rws, col = block()
    kc = k * col
    pkk = pkk + mm(jnp.where(rws, lk, 0.0), kc, tb=True)
    pqk = pqk + mm(jnp.where(rws, lq, 0.0), kc, tb=True)
  if sub:
    dkk, dqk = diag_pairs((k, q), k, G)
    pkk, pqk = pkk + dkk, pqk + dqk
  return pkk, pqk


def _store_pairs(ch, akk, aqk, pkk_ref, a_ref):
  """P_kk (strict, same segment, float32) and A_qk (``scale``, inclusive) of one chunk."""
  cfg, b, h, rows = ch.cfg, ch.b, ch.h, ch.rows
  pkk_ref[b, rows, h, :] = jnp.where(ch.strict, akk, 0.0)
  a_ref[b, rows, h, :] = jnp.where(ch.incl, cfg.scale * aqk, 0.0).astype(a_ref.dtype)


def _dense_a_kernel(q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref,
                    pkk_ref, a_ref, qg_ref, kd_ref, kg_ref, gc_ref, rq_ref, rk_ref, *redo_ref, cfg,
                    hv, group, t, pid):
  """Grid (NC, B*HV): writes pkk ``[B, Tp, HV, C]`` float32 (strict, same segment, no beta),
  A_qk ``[B, Tp, HV, C]``, QG, KD, KG ``[B, Tp, HV, K]`` (``cfg.dtype``), gC
  ``[B, NC, HV, K]`` float32 and the rows' inverse L2 norms of q and k ``[B, Tp, HV]`` (1 if
  not fused), which ``kda_chunk_dqkg`` reads instead of computing them again. Both pair
  products in one program share the gate, its cumulative sum and the column factors (faster
  than one program per product: benchmarks/RESULTS.md, KDA run 13). On sub-chunks the pair
  products take the 16-row middle-row references all the same and ``redo_ref``
  ``[B, Tp, HV]`` flags (1 on its rows) a chunk whose gates do not let them
  (``middle_fits``), for ``kda_chunk_a_sub``."""
  ci, b, h = _ids(hv, pid)
  c = cfg.chunk
  dt = jnp.dtype(cfg.dtype)
  ch = _Dense(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, ci * c, t, q_ref.shape[-1])
  mm = functools.partial(chunk_ops.mm, dt=dt)
  rows = ch.rows
  akk = aqk = jnp.zeros((c, c), jnp.float32)
  fits = True
  for s in range(ch.ns):
    cols = ch.cols(s)
    q, k, G = ch.slice(s)
    akk, aqk = _slice_products(ch, mm, akk, aqk, q, k, G, False)
    if cfg.sub_chunks:
      fits = fits & ch.middle_fits(G)
    eg = jnp.exp(G)
    gl = ch.row(G, c - 1)
    qg_ref[b, rows, h, cols] = (cfg.scale * ch.cont[:, None] * q * eg).astype(dt)
    kd_ref[b, rows, h, cols] = (ch.last[:, None] * k * jnp.exp(gl[None, :] - G)).astype(dt)
    kg_ref[b, rows, h, cols] = (eg * k).astype(dt)
    gc_ref[b, ci, h, cols] = ch.cont_last * jnp.exp(gl)
  _store_pairs(ch, akk, aqk, pkk_ref, a_ref)
  one = jnp.ones((cfg.chunk, 1), jnp.float32)
  for ref, norm in ((rq_ref, ch.rq), (rk_ref, ch.rk)):
    ref[b, rows, h] = (one if norm is None else norm)[:, 0]
  if redo_ref:
    redo_ref[0][b, rows, h] = jnp.where(fits, 0.0, one[:, 0])


def _dense_a_sub_kernel(q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref, redo_ref,
                        _pkk_in, _a_in, pkk_ref, a_ref, *, cfg, hv, group, t, pid):
  """Grid (NC, B*HV): P_kk and A_qk of the chunks ``kda_chunk_a`` flagged (``redo_ref``) again,
  on sub-chunks; pkk_ref and a_ref alias their inputs, so the other chunks keep
  ``kda_chunk_a``'s. Most programs read the flag and stop."""
  ci, b, h = _ids(hv, pid)
  c = cfg.chunk

  @pl.when(redo_ref[b, ci * c, h] > 0)
  def _():
    ch = _Dense(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
                h // group, ci * c, t, q_ref.shape[-1])
    mm = functools.partial(chunk_ops.mm, dt=jnp.dtype(cfg.dtype))
    akk = aqk = jnp.zeros((c, c), jnp.float32)
    for s in range(ch.ns):
      akk, aqk = _slice_products(ch, mm, akk, aqk, *ch.slice(s), True)
    _store_pairs(ch, akk, aqk, pkk_ref, a_ref)


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
  x = lower_inverse(ch.beta[:, None] * pkk_ref[b, rows, h, :], c)
  if x_ref:
    x_ref[0][b, rows, h, :] = x
  xb = x * ch.beta[None, :]
  mm = functools.partial(chunk_ops.mm, dt=dt)
  for s in range(ch.ns):
    cols = ch.cols(s)
    w = mm(xb, kg_ref[b, rows, h, cols].astype(jnp.float32))
    w_ref[b, rows, h, cols] = (ch.cont[:, None] * w).astype(w_ref.dtype)
  bv = min(vd, cfg.tuning.slice_k)
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
  mm = chunk_ops.mm  # float32 (TF32 on the matrix units)
  ch = _Dense(cfg, (None, None, None, beta_ref, None, None, seg_ref), b, h, h, ci * c, t,
              kg_ref.shape[-1])
  rows, beta = ch.rows, ch.beta[:, None]
  ld = lambda ref: ref[b, rows, h, :].astype(f32)
  # Fewer live tiles than whole [C, V] float32 ones (benchmarks/RESULTS.md, KDA run 13): dZ =
  # X^T dV', dv, dZ's part of dbeta and dX's dU Z^T part per V slice, dV' loaded again for dW,
  # and the products with the states in the kernels' dtype (like the forward's).
  sdt = jnp.dtype(cfg.dtype)
  x = ld(x_ref)
  vd = v_ref.shape[-1]
  bv = min(vd, cfg.tuning.slice_k)
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


def _dense_dqkg_kernel(q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref, h_ref, dh_ref,
                       vn_ref, do_ref, dy_ref, dpkk_ref, rq_ref, rk_ref, dq_ref, dk_ref, dg_ref, *,
                       cfg, hv, group, t, gate_dot, slice_k, dot_cumsum, pid, sub=False):
  """Grid (K slices, NC, B*HV): gradients wrt the pre-processed q, k (per value head) and g of
  one K slice of one chunk, from the state entering the chunk (h), the gradient of the state
  leaving it (dh), V', dO, dY, the pair-product gradient dpkk and the inverse norms; the pair
  products on the middle-row blocks, or with ``sub`` on sub-chunks.
  dP_qk = mask(scale dO V'^T) is formed here, in each reference block's step, from the dO and
  V' tiles (float32 sums of the bf16 tiles), not stored by ``kda_chunk_dwy`` and loaded as
  float32 (benchmarks/RESULTS.md, KDA runs 23-26).
  The K slices are the fastest grid axis (Triton launches the first axis fastest), so the
  programs of one chunk run side by side and the tiles they all read (V', dO, dP_kk) come from
  L2 after the first."""
  s = pid[0]
  ci, b, h = _ids(hv, pid, 1)
  c = cfg.chunk
  f32 = jnp.float32
  mm = chunk_ops.mm
  ch = _Dense(cfg, (q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, seg_ref), b, h,
              h // group, ci * c, t, q_ref.shape[-1], slice_k, norms=(rq_ref, rk_ref),
              dot_cumsum=dot_cumsum)
  rows, cols, beta = ch.rows, ch.cols(s), ch.beta[:, None]
  ld = lambda ref: ref[b, rows, h, :].astype(f32)
  q, k, G = ch.slice(s)
  state = lambda ref: ref[b, ci, h, cols, :]  # [BK, V], loaded where used
  blocks, e_row, refs, _ = ch.blocks(G, sub)

  def pairs(a_side, dp, dots):
    """Gradients of the pair product P_ij = sum_d a_id k_jd e^{G_id - G_jd} (i >= j) given
    dP (``dp()``: [C, C] float32), products by the algorithms ``dots`` (for d a, for d k):
    (d a, d k) [C, BK] and the last block's column factor (None on sub-chunks)."""
    mma, mmb = (functools.partial(chunk_ops.mm, precision=d) for d in dots)
    la = a_side * e_row
    da = db = jnp.zeros_like(k)
    col = None
    for block in blocks:  # dP loaded / formed per block, not kept live across them (fewer spills)
      rws, col = block()
      p = jnp.where(rws, dp(), 0.0)
      da = da + mma(p, k * col)
      db = db + col * mmb(p, la, ta=True)
    da = da * e_row
    if sub:
      dad, dbd = diag_pair_grads(a_side, k, G, dp())
      return da + dad, db + dbd, None
    return da, db, col

  # The products with the states (dO S^T, V' dS^T) take operands of the kernels' dtype, like
  # the forward's QG S: bf16 halves their registers, the errors unchanged.
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
    # does too). Faster here, not in kda_chunk_a (benchmarks/RESULTS.md, KDA runs 43-44).
    # Sub-chunks have no such factor for the last block's rows: e^{G_C - G} there.
    decay = (jnp.exp(gl[None, :] - G) if col is None
             else col * jnp.exp(gl - refs[-1])[None, :])
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


def _dense_dqkg_sub_kernel(*refs, pid, **kw):
  """Grid (K slices, NC, B*HV): :func:`_dense_dqkg_kernel` on sub-chunks for the chunks
  ``kda_chunk_a`` flagged (``redo_ref`` [B, Tp, HV]); the outputs alias kda_chunk_dqkg's, so
  the other chunks keep its gradients. Most programs read the flag and stop."""
  *ins, redo_ref, _dq, _dk, _dg, dq_ref, dk_ref, dg_ref = refs
  ci, b, h = _ids(kw["hv"], pid, 1)

  @pl.when(redo_ref[b, ci * kw["cfg"].chunk, h] > 0)
  def _():
    _dense_dqkg_kernel(*ins, dq_ref, dk_ref, dg_ref, pid=pid, sub=True, **kw)


def _cont(seg, c):
  """``[B, Tp]`` float32: 1 where a token continues the state entering its chunk."""
  start = jnp.arange(seg.shape[1]) // c * c
  return (seg == seg[:, jnp.maximum(start - 1, 0)]).astype(jnp.float32)


def _beta(cfg: KdaOptions, beta, t):
  """beta ``[B, Tp, HV]`` float32 as the kernels take it: the gate's value (a sigmoid of a logit
  if asked), zero on the padded tokens after ``t``."""
  beta = beta.astype(jnp.float32)
  if cfg.beta_is_logit:
    beta = jax.nn.sigmoid(beta)
  return jnp.where((jnp.arange(beta.shape[1]) < t)[None, :, None], beta, 0.0)


def _mosaic(choice: str, cfg: KdaOptions) -> bool:
  """Whether a chunk kernel's tuning ``choice`` asks for its Mosaic GPU version for this call:
  "mosaic", or "bounded" on the bounded gate's blocks (not on sub-chunks)."""
  return choice == "mosaic" or (choice == "bounded" and not cfg.sub_chunks)


def chunk_a(cfg: KdaOptions, q, k, v, g, beta, A_log, dt_bias, seg, t):
  """``kda_chunk_a``: (pkk, aqk, qg, kd, kg, gc, rq, rk, redo), see :func:`_dense_a_kernel` (or
  ``a_mgpu``'s kernel where the tuning asks for it and it takes the operands); on sub-chunks
  then ``kda_chunk_a_sub`` for the chunks it flags in ``redo`` [B, Tp, HV]
  (:func:`_dense_a_sub_kernel`; None on the bounded gate's blocks), which the backward's
  ``kda_chunk_dqkg_sub`` reads."""
  bsz, tp, h, kd = q.shape
  hv, c = v.shape[2], cfg.chunk
  dt, f32 = jnp.dtype(cfg.dtype), jnp.float32
  ins = (q, k, g, beta, A_log, dt_bias, seg)
  if _mosaic(cfg.tuning.chunk_a, cfg) and a_mgpu.supported(cfg, q, k, g):
    out = list(a_mgpu.chunk_a(cfg, q, k, g, A_log, dt_bias, seg, _cont(seg, c), t, hv=hv,
                              interpret=interpret()))
  else:
    rows = jax.ShapeDtypeStruct((bsz, tp, hv), f32)
    kern = functools.partial(_dense_a_kernel, cfg=cfg, hv=hv, group=hv // h, t=t)
    out = call(cfg, kern, "kda_chunk_a", (tp // c, bsz * hv),
               [tok(v, c, f32), tok(v, c, dt), tok(v, kd, dt), tok(v, kd, dt), tok(v, kd, dt),
                jax.ShapeDtypeStruct((bsz, tp // c, hv, kd), f32)]
               + [rows] * (3 if cfg.sub_chunks else 2), *ins, chunk_axis=0)
  if not cfg.sub_chunks:
    return (*out, None)
  *out, redo = out
  kern = functools.partial(_dense_a_sub_kernel, cfg=cfg, hv=hv, group=hv // h, t=t)
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in out[:2]]
  out[:2] = call(cfg, kern, "kda_chunk_a_sub", (tp // c, bsz * hv), shapes, *ins, redo,
                 *out[:2], chunk_axis=0, aliases={len(ins) + 1: 0, len(ins) + 2: 1})
  return (*out, redo)


def chunk_wu(cfg: KdaOptions, pkk, kg, v, beta, seg, t, keep):
  """``kda_chunk_wu``: (w, u) and, if ``keep``, the inverse x; see :func:`_dense_wu_kernel`.
  ``wu_mgpu``'s kernel where the tuning asks for it (``chunk_wu``) and it takes the operands."""
  bsz, tp, hv, vd = v.shape
  c, dt = cfg.chunk, jnp.dtype(cfg.dtype)
  if cfg.tuning.chunk_wu == "mosaic" and wu_mgpu.supported(kg, v, cfg.chunk):
    return wu_mgpu.chunk_wu(pkk, kg, v, jnp.swapaxes(_beta(cfg, beta, t), 1, 2), _cont(seg, c),
                            keep=keep, split=cfg.tuning.wu_split, interpret=interpret())
  kern = functools.partial(_dense_wu_kernel, cfg=cfg, hv=hv, t=t)
  return call(cfg, kern, "kda_chunk_wu", (tp // c, bsz * hv),
              [tok(v, kg.shape[-1], dt), tok(v, vd, dt)] + [tok(v, c, jnp.float32)] * keep,
              pkk, kg, v, beta, seg, chunk_axis=0)


def _pair_grad_dtype(cfg, dots):
  """Storage dtype of a pair-product gradient whose products use the algorithms ``dots``: the
  kernels' bf16 when every product rounds its operands to bf16 anyway (half the bytes, the same
  results), else float32."""
  single = all(d == BF16 for d in dots)
  return jnp.dtype(cfg.dtype) if single and cfg.dtype == "bfloat16" else jnp.float32


def chunk_dwy(cfg: KdaOptions, v, beta, seg, x, pkk, kg, hs, dvn, t):
  """``kda_chunk_dwy``: (dpkk, dy, dv, dbeta), see :func:`_dense_dwy_kernel` (or ``dwy_mgpu``'s
  kernel where the tuning's ``chunk_dwy`` asks for it and it takes the operands)."""
  bsz, tp, hv, vd = v.shape
  c, f32 = cfg.chunk, jnp.float32
  dtypes = (_pair_grad_dtype(cfg, cfg.tuning.gate_dot[1]), store_dtype(cfg, "dy"), v.dtype)
  if cfg.tuning.chunk_dwy == "mosaic" and dwy_mgpu.supported(cfg, v, kg, hs, dvn, x):
    return dwy_mgpu.chunk_dwy(v, _beta(cfg, beta, t), seg, _cont(seg, c), x, pkk, kg, hs, dvn,
                              out_dtypes=dtypes, interpret=interpret())
  kern = functools.partial(_dense_dwy_kernel, cfg=cfg, hv=hv, t=t)
  return call(cfg, kern, "kda_chunk_dwy", (tp // c, bsz * hv),
              [tok(v, d, dt) for d, dt in zip((c, kg.shape[-1], vd), dtypes)]
              + [jax.ShapeDtypeStruct((bsz, tp, hv), f32)],
              v, beta, seg, x, pkk, kg, hs, dvn, chunk_axis=0)


def chunk_dqkg(cfg: KdaOptions, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, do, dy, dpkk,
               rq, rk, redo, t):
  """``kda_chunk_dqkg``: (dq, dk, dg), see :func:`_dense_dqkg_kernel` (or ``dqkg_mgpu``'s kernel
  where the tuning's ``chunk_dqkg`` asks for it and it takes the operands); then, with ``redo``
  (the chunks ``kda_chunk_a`` flagged), ``kda_chunk_dqkg_sub`` in place for those
  (:func:`_dense_dqkg_sub_kernel`)."""
  bsz, tp, h, kd = q.shape
  hv = v.shape[2]
  ins = (q, k, g, beta, A_log, dt_bias, seg, hs, dh, vn, do, dy, dpkk, rq, rk)
  shapes = [tok(v, kd, store_dtype(cfg, n)) for n in ("dqk", "dqk", "dg")]

  def launch(name, kernel, bk, *extra, aliases=None):
    bk = min(kd, bk)
    kern = functools.partial(kernel, cfg=cfg, hv=hv, group=hv // h, t=t,
                             gate_dot=cfg.tuning.gate_dot, slice_k=bk,
                             dot_cumsum=cfg.tuning.dqkg_dot_cumsum)
    return call(cfg, kern, name, (kd // bk, tp // cfg.chunk, bsz * hv), shapes, *ins, *extra,
                chunk_axis=1, aliases=aliases)

  if (_mosaic(cfg.tuning.chunk_dqkg, cfg)
      and dqkg_mgpu.supported(cfg, q, k, g, hs, dh, vn, do)):
    out = dqkg_mgpu.chunk_dqkg(cfg, q, k, g, _beta(cfg, beta, t), A_log, dt_bias, seg,
                               _cont(seg, cfg.chunk), hs, dh, vn, do, dy, dpkk, rq, rk, t, hv=hv,
                               out_dtypes=[x.dtype for x in shapes], interpret=interpret())
  else:
    out = launch("kda_chunk_dqkg", _dense_dqkg_kernel, cfg.tuning.dqkg_slice_k)
  if redo is None:
    return out
  n = len(ins) + 1  # the outputs alias the inputs after redo
  return launch("kda_chunk_dqkg_sub", _dense_dqkg_sub_kernel, cfg.tuning.dqkg_slice_k_sub, redo,
                *out, aliases={n: 0, n + 1: 1, n + 2: 2})
