"""Pallas GPU (Triton lowering) chunked Kimi Delta Attention with a custom VJP.

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``;
state ``[B, HV, K, V]`` float32; ``HV`` a multiple of ``H``.

The work is split the way it parallelises (SPEC section 2, chunks of C tokens):

1. Chunk-local work (parallel over (chunk, batch*value head)): the optional fused
   pre-processing (L2 norm, gate from ``f, A_log, dt_bias``, beta sigmoid), the in-chunk
   cumulative decay ``G``, the gated pair products, ``(I + A_kk)^-1`` and the factors
   ``W, U, QG = scale q e^G, A_qk, KD = k e^{G_C - G}, gC = e^{G_C}``. Segment restarts are
   folded in as masks, so the sequential pass has no branches. Two versions with the same
   results: the dense path (``chunk_dense.py``: the chunk as full [C, C] and [C, K-slice]
   tiles, the pair products as full matrix-unit products, split into the short kernels
   ``kda_chunk_a`` and ``kda_chunk_wu`` with intermediates in HBM), every gate's by default,
   and the general path (``chunk_general.py``, any gate: 16-row tiles, diagonal tiles pair by
   pair, one program per chunk; ``KdaGpuConfig.unbounded="general"``).
2. The sequential pass over chunks (``recurrence.py``: Triton, or the Mosaic GPU kernels of
   ``recurrence_mgpu.py`` on Hopper), per chunk ``V' = U - W S``, ``O = QG S + A_qk V'``,
   ``S = gC * S + KD^T V'``; the WY factors of ``kda_chunk_wu`` likewise from ``wu_mgpu.py``.
3. Backward: the chunk factors (the dense path also with ``P_kk``, ``k e^G`` and the inverse),
   the chunk states and V', kept by the forward (``save_residuals``) or recomputed by steps 1 and
   2 from the inputs; the reverse sequential pass carries ``dS`` backwards and writes ``dV'`` and
   the state gradients; then, parallel over chunks, the gradients of the pre-processed inputs
   (dense path: ``kda_chunk_dwy`` for the WY factors, ``kda_chunk_dqkg`` per K slice for dq, dk,
   dg; other gates: ``kda_chunk_prep_bwd``); then the pre-processing's VJP, ``kda_prep_vjp``
   (``prep_vjp.py``).

Sub-tile gating: a pair product ``sum_d a_id b_jd exp(G_id - G_jd)`` (i >= j) is split at a
reference ``r`` of the row block: ``(a e^{G - r}) (b e^{r - G})^T``.

- Any gate (Kimi Linear's softplus, a precomputed g: no bound on the decay): the bounded
  gate's middle-row blocks (below) where they fit, secondary chunking, as fla's ``chunk_kda``,
  where they do not. Every chunk first runs the bounded gate's kernels on blocks of
  ``KdaGpuConfig.speculative_rows`` rows with exponents clamped at ``e^85``, and
  ``kda_chunk_a`` flags each chunk whose gates exceed that bound somewhere (checked at run
  time). The flagged chunks are redone in place (``kda_chunk_a_sub`` forward,
  ``kda_chunk_dqkg_sub`` backward; the other programs read the flag and stop) on 16-token
  sub-chunks with ``r`` just before each (``KdaOptions.sub_chunks``): for a row in sub-chunk I
  and a column in an earlier one, ``e^{G_i - r_I} <= 1`` and ``e^{r_I - G_j} <= 1`` since G
  falls with the token, so those blocks are matrix-unit products that cannot overflow whatever
  the gate; the diagonal 16x16 sub-blocks are formed pair by pair, ``e^{min(G_i - G_j, 0)}`` per
  channel. The inter-chunk factors (``e^G``, ``e^{G_C - G}``, ``e^{G_C}``) have exponents <= 0
  anyway. No clamp reaches a result: a chunk's outputs come from the blocks only if none bit.
- The bounded gate (``g > lower_bound``, K3): ``r`` at the middle row of blocks of ``diag_rows``
  rows, every factor inside a block within ``e^{(diag_rows / 2) |lower_bound|} <= e^85``
  (float32), so whole blocks, diagonal included, are dense products (32-row blocks for K3's
  lower bound -5); a bound below -10.6 takes the sub-chunks.

The gate is fused from the raw ``f`` (``A_log``, ``dt_bias``) in the chunk kernels for both gate
kinds; the gradients of ``f``, ``A_log`` and ``dt_bias`` come from the gate's cotangent in
``kda_prep_vjp``.

Tuning (warps, tiles, which kernels) is a :class:`~pallas_kernels.kda.config.KdaGpuConfig`,
by default :func:`~pallas_kernels.kda.config.default_config` of the shapes and device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import chunk_dense, chunk_general
from pallas_kernels.kda.config import KdaGpuConfig, KdaOptions, chunk_path, default_config
from pallas_kernels.kda.prep_vjp import preprocess_vjp
from pallas_kernels.kda.recurrence import recurrence_bwd, recurrence_fwd
from pallas_kernels.kda.reference import kda_gate, l2norm, pad_time, restart_mask


def _pow2(n: int) -> bool:
  return n >= 16 and n & (n - 1) == 0


def prepare(cfg: KdaOptions, q, k, v, g, beta, A_log, dt_bias, seg, t, keep=False):
  """Chunk-local factors ``(w, u, qg, aqk, kd, gc)``: w, qg, kd ``[B, Tp, HV, K]``, u
  ``[B, Tp, HV, V]``, aqk ``[B, Tp, HV, C]`` (``cfg.dtype``) and gc ``[B, NC, HV, K]`` float32;
  and what the dense backward reuses (``(pkk, kg, x, rq, rk)`` if ``keep``, else None). Inputs
  padded to Tp; the first ``t`` tokens are real."""
  if not cfg.diag_rows:
    return chunk_general.prepare(cfg, q, k, v, g, beta, A_log, dt_bias, seg, t), None
  pkk, aqk, qg, kdec, kg, gc, rq, rk, redo = chunk_dense.chunk_a(cfg, q, k, v, g, beta, A_log,
                                                                 dt_bias, seg, t)
  wu = chunk_dense.chunk_wu(cfg, pkk, kg, v, beta, seg, t, keep)
  return (wu[0], wu[1], qg, aqk, kdec, gc), ((pkk, kg, wu[2], rq, rk, redo) if keep else None)


def prepare_bwd(cfg: KdaOptions, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn, do, t,
                kept):
  """Gradients wrt the pre-processed q, k (per value head), g ``[B, Tp, HV, K]`` (float32 or,
  per the tuning's ``bf16_stores``, the kernels' dtype), v ``[B, Tp, HV, V]`` (in v's dtype: the
  rounding the cotangent gets anyway, written once) and beta ``[B, Tp, HV]`` (float32); ``kept``
  is what ``prepare(..., keep=True)`` returned."""
  if not cfg.diag_rows:
    return chunk_general.prepare_bwd(cfg, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, dvn,
                                     do, t)
  pkk, kg, x, rq, rk, redo = kept
  dpkk, dy, dv, dbeta = chunk_dense.chunk_dwy(cfg, v, beta, seg, x, pkk, kg, hs, dvn, t)
  dq, dk, dg = chunk_dense.chunk_dqkg(cfg, q, k, v, g, beta, A_log, dt_bias, seg, hs, dh, vn, do,
                                      dy, dpkk, rq, rk, redo, t)
  return dq, dk, dv, dg, dbeta


def preprocess(cfg: KdaOptions, q, k, g, beta, A_log, dt_bias):
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



@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda_core(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg):
  return _forward(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg, save=False)[0]


def _forward(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg, save, every=0):
  """((o, final state) and with ``every`` the states after every ``every`` chunks
  ``[B, T // (every C), HV, K, V]``, what the backward reuses: None, or with ``save`` the chunk
  factors, the inverse's factors, the chunk states and V')."""
  t = q.shape[1]
  padded = [pad_time(x, cfg.chunk) for x in (q, k, v, g, beta)]  # to seg's whole chunks
  factors, kept = prepare(cfg, *padded, A_log, dt_bias, seg, t, keep=save)
  o, st, *states = recurrence_fwd(cfg, *factors, s0, v.dtype, store=save, every=every)
  out = (o[:, :t], st) + ((states.pop()[:, :t // (every * cfg.chunk)],) if every else ())
  return out, ((factors, kept, *states) if save else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kda_states(cfg, every, q, k, v, g, beta, A_log, dt_bias, s0, seg):
  """(o, final state, the states after every ``every`` chunks) in one forward pass, for
  serving's prefix cache: no gradient."""
  return _forward(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg, save=False, every=every)[0]


def _kda_states_fwd(cfg, every, *args):
  return _kda_states(cfg, every, *args), None


def _kda_states_bwd(cfg, every, res, cts):
  raise ValueError("kda(pallas_gpu): output_states_every is forward only (no gradient); "
                   "differentiate a call without it")


_kda_states.defvjp(_kda_states_fwd, _kda_states_bwd)


def _kda_fwd(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg):
  # ``cfg.save_residuals``: keep the forward's chunk factors, chunk states and V' for the
  # backward instead of recomputing them there (the backward's kda_chunk_a, kda_chunk_wu and
  # storing recurrence): ~2.6 KB per token and value head at K = V = 128, C = 64, bf16
  # (benchmarks/RESULTS.md, KDA run 13). Under a remat policy they are kept only where it keeps
  # Pallas outputs (``dots_kernels``); elsewhere the layer's recomputed forward produces them
  # again, held while that layer's backward runs.
  out, saved = _forward(cfg, q, k, v, g, beta, A_log, dt_bias, s0, seg, save=cfg.save_residuals)
  return out, (q, k, v, g, beta, A_log, dt_bias, s0, seg, saved)


def _kda_bwd(cfg, res, cts):
  q, k, v, g, beta, A_log, dt_bias, s0, seg, saved = res
  do, dst = cts
  t = q.shape[1]
  padded = [pad_time(x, cfg.chunk) for x in (q, k, v, g, beta)]
  if saved is None:  # recompute the chunk factors, the chunk states and V'
    factors, kept = prepare(cfg, *padded, A_log, dt_bias, seg, t, keep=True)
    _, _, hs, vn = recurrence_fwd(cfg, *factors, s0, v.dtype, store=True)
  else:
    factors, kept, hs, vn = saved
  w, u, qg, aqk, kd, gc = factors
  do = pad_time(do, cfg.chunk)
  dvn, dh, ds0 = recurrence_bwd(cfg, do, qg, aqk, kd, w, gc, dst.astype(jnp.float32))
  dq, dk, dv, dg, dbeta = prepare_bwd(cfg, *padded, A_log, dt_bias, seg, hs, dh, vn, dvn, do,
                                       t, kept)
  dq, dk, dg, dbeta, dalog, ddtb = preprocess_vjp(cfg, q, k, g, beta, A_log, dt_bias, dq, dk, dg,
                                                  dbeta, config=cfg.tuning.prep_vjp)
  return dq, dk, dv[:, :t], dg, dbeta, dalog, ddtb, ds0, None


_kda_core.defvjp(_kda_fwd, _kda_bwd)


# ------------------------------------------------------------------------------------------
# public entry
# ------------------------------------------------------------------------------------------

def kda(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None, use_qk_l2norm=False,
        A_log=None, dt_bias=None, gate=None, lower_bound=-5.0, beta_is_logit=False,
        chunk_size=64, save_residuals=True, config: KdaGpuConfig | None = None,
        states_every=None):
  """Chunked KDA on GPU (interpret mode elsewhere). See :func:`pallas_kernels.kda.kda`.
  ``config``: the kernels' tuning (default :func:`default_config` of these shapes and the first
  device). ``states_every = M``: also the states after every M chunks (forward only; the
  Triton forward pass writes them).

  Returns ``(o [B, T, HV, V] in v.dtype, final_state [B, HV, K, V] float32)`` and with
  ``states_every`` the states ``[B, T // (M chunk_size), HV, K, V]`` float32.
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
  if config is None:
    config = default_config(v.shape, use_qk_l2norm=bool(use_qk_l2norm),
                            beta_is_logit=bool(beta_is_logit))
  rows, sub = chunk_path(gate, float(lower_bound), chunk_size, config)
  cfg = KdaOptions(scale=float(scale), chunk=chunk_size, use_qk_l2norm=bool(use_qk_l2norm),
                   gate=gate, lower_bound=float(lower_bound), beta_is_logit=bool(beta_is_logit),
                   diag_rows=rows, sub_chunks=sub,
                   dtype=jnp.dtype(dtype).name, save_residuals=bool(save_residuals),
                   tuning=config)
  tp = -(-t // chunk_size) * chunk_size
  seg = jnp.cumsum(restart_mask(segment_ids, bsz, t).astype(jnp.int32), axis=1)
  seg = jnp.pad(seg, ((0, 0), (0, tp - t)), mode="edge")
  s0 = (jnp.zeros((bsz, hv, kd, vd), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  args = (q, k, v, g, beta, A_log.reshape(hv).astype(jnp.float32),
          dt_bias.reshape(hv, kd).astype(jnp.float32), s0, seg)
  if states_every:
    return _kda_states(cfg, int(states_every), *args)
  return _kda_core(cfg, *args)