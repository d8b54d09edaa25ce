"""The VJP of the KDA kernels' fused pre-processing as one Triton kernel through Pallas
(interpret mode off GPU).

Shapes: q, k ``[B, T, H, K]``; g ``[B, T, HV, K]``; beta ``[B, T, HV]``; A_log ``[HV]``;
dt_bias ``[HV, K]``; the cotangents of the pre-processed q, k ``[B, Tc, HV, K]`` (per value
head), g ``[B, Tc, HV, K]`` and beta ``[B, Tc, HV]``, ``Tc >= T`` (rows past T, the chunk
padding, are never read). ``HV`` a multiple of ``H``: value head ``j`` reads query/key head
``j // (HV // H)``.

The pre-processing (``pallas_kernels.kda.gpu.preprocess``, float32): ``q / sqrt(|q|^2 + eps)``
and the same of k over K (``use_qk_l2norm``); the gate ``kda_gate(g, A_log, dt_bias)``;
``sigmoid(beta)`` (``beta_is_logit``). Its VJP, per program of ``rows`` tokens of one batch row
and one query/key head ``h`` (stepping through them ``block`` tokens at a time):

- dq, dk: the cotangents of the ``HV / H`` value heads of h summed, then the L2 norm's VJP
  ``r dy - r^3 x (x . dy)`` with ``r = (|x|^2 + eps)^-1/2`` recomputed from the raw row x;
- dg of each value head of h: ``dg dgate/df``, elementwise (x = f + dt_bias, a = e^A_log):
  softplus ``g = -a softplus(x)``: ``dg/dx = -a sigmoid(x)``, ``dg/dA_log = g``;
  bounded ``g = lb sigmoid(a x)``: ``dg/dx = a lb s (1 - s)``, ``dg/dA_log = x dg/dx``;
  the program's float32 sums over its tokens of ``dg dg/dx`` (-> d dt_bias) and of
  ``dg dg/dA_log`` (per channel, -> d A_log) are written as partials ``[B, NT, HV, K]`` and
  summed outside;
- dbeta: ``dbeta s (1 - s)``, ``s = sigmoid(beta)``.

Every operand is read once and every result written once, already in its input's dtype (faster
than XLA's VJP: benchmarks/RESULTS.md, the KDA backward's pre-processing VJP).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend
from pallas_kernels.kda.reference import L2_EPS


@dataclasses.dataclass(frozen=True)
class Config:
  """``rows`` tokens per program (a multiple of ``block``), ``block`` tokens per step, ``warps``
  warps. Defaults: the fastest of `benchmarks/kda_prep.py`'s sweep (benchmarks/RESULTS.md, the
  KDA backward's pre-processing VJP); Triton's pipelining stages change nothing here (the step
  loop's loads are not pipelined)."""
  rows: int = 256
  block: int = 16
  warps: int = 4


def _interpret() -> bool:
  return default_backend() != "gpu"


def _gate_vjp(gate, lower_bound, f, a, dg):
  """(d f, d A_log per element) for the gate's cotangent ``dg`` at ``x = f + dt_bias``."""
  if gate == "softplus":
    return -a * jax.nn.sigmoid(f) * dg, -a * jax.nn.softplus(f) * dg
  s = jax.nn.sigmoid(a * f)
  df = (a * lower_bound) * s * (1.0 - s) * dg
  return df, df * f


def _kernel(q_ref, k_ref, g_ref, beta_ref, alog_ref, dtb_ref, dq_ref, dk_ref, dg_ref, dbeta_ref,
            dq_o, dk_o, dg_o, dbeta_o, *part_refs, t, kd, group, rows, block, l2norm, gate,
            lower_bound, logit):
  i, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  f32 = jnp.float32
  heads = [h * group + j for j in range(group)]
  # an int32 start like the program ids': under x64 interpret mode's masked loads and stores
  # refuse a Python int (int64) beside them
  cols = pl.ds(jnp.int32(0), kd)
  if gate is not None:
    alog_o, dtb_o = part_refs
    a = [jnp.exp(alog_ref[hv].astype(f32)) for hv in heads]
    dtb = [plgpu.load(dtb_ref.at[hv, cols]).astype(f32) for hv in heads]

  def step(s, acc):
    t0 = i * rows + s * block
    ok = t0 + jnp.arange(block, dtype=jnp.int32) < t
    ok2 = jnp.broadcast_to(ok[:, None], (block, kd))
    r = pl.ds(t0, block)
    ld = lambda ref, *idx, m=ok2: plgpu.load(ref.at[b, r, *idx], mask=m, other=0).astype(f32)
    for x_ref, dx_ref, o_ref in ((q_ref, dq_ref, dq_o), (k_ref, dk_ref, dk_o)):
      dy = ld(dx_ref, heads[0], cols)
      for hv in heads[1:]:
        dy = dy + ld(dx_ref, hv, cols)
      if l2norm:
        x = ld(x_ref, h, cols)
        rn = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)
        dy = rn * dy - (rn * rn * rn * jnp.sum(x * dy, axis=1, keepdims=True)) * x
      plgpu.store(o_ref.at[b, r, h, cols], dy.astype(o_ref.dtype), mask=ok2)
    new = []
    for j, hv in enumerate(heads):
      dg = ld(dg_ref, hv, cols)
      if gate is not None:
        dg, dal = _gate_vjp(gate, lower_bound, ld(g_ref, hv, cols) + dtb[j][None, :], a[j], dg)
        new += [acc[2 * j] + jnp.sum(dal, axis=0), acc[2 * j + 1] + jnp.sum(dg, axis=0)]
      plgpu.store(dg_o.at[b, r, hv, cols], dg.astype(dg_o.dtype), mask=ok2)
      db = ld(dbeta_ref, hv, m=ok)
      if logit:
        sb = jax.nn.sigmoid(ld(beta_ref, hv, m=ok))
        db = db * sb * (1.0 - sb)
      plgpu.store(dbeta_o.at[b, r, hv], db.astype(dbeta_o.dtype), mask=ok)
    return tuple(new)

  zeros = (jnp.zeros((kd,), f32),) * (2 * group if gate is not None else 0)
  acc = jax.lax.fori_loop(0, rows // block, step, zeros)
  if gate is not None:
    for j, hv in enumerate(heads):
      plgpu.store(alog_o.at[b, i, hv, cols], acc[2 * j])
      plgpu.store(dtb_o.at[b, i, hv, cols], acc[2 * j + 1])


def preprocess_vjp(cfg, q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta,
                   config: Config = Config()):
  """Cotangents of the raw inputs of ``gpu.preprocess(cfg, q, k, g, beta, A_log, dt_bias)``
  for those ``(dq, dk, dg, dbeta)`` of its outputs (dq, dk per value head, see the module
  docstring for shapes; ``cfg`` supplies ``use_qk_l2norm, gate, lower_bound, beta_is_logit``).

  Returns ``(dq, dk, dg, dbeta)`` in the dtypes of q, k, g, beta and ``(dA_log [HV],
  d dt_bias [HV, K])`` in those of A_log, dt_bias (zeros without a gate).
  """
  bsz, t, h, kd = q.shape
  hv = g.shape[2]
  tc = dq.shape[1]
  if (k.shape != q.shape or g.shape != (bsz, t, hv, kd) or beta.shape != (bsz, t, hv)
      or hv % h or A_log.shape != (hv,) or dt_bias.shape != (hv, kd)
      or dq.shape != (bsz, tc, hv, kd) or dk.shape != dq.shape or dg.shape != dq.shape
      or dbeta.shape != (bsz, tc, hv) or tc < t):
    raise ValueError(
        f"preprocess_vjp: expected q, k [B,T,H,K], g [B,T,HV,K], beta [B,T,HV], A_log [HV], "
        f"dt_bias [HV,K], dq, dk, dg [B,Tc,HV,K], dbeta [B,Tc,HV] (Tc >= T, HV a multiple of "
        f"H); got q {q.shape}, k {k.shape}, g {g.shape}, beta {beta.shape}, A_log "
        f"{A_log.shape}, dt_bias {dt_bias.shape}, dq {dq.shape}, dk {dk.shape}, dg {dg.shape}, "
        f"dbeta {dbeta.shape}")
  if cfg.gate not in (None, "softplus", "bounded"):
    raise ValueError(f"preprocess_vjp: unknown gate kind {cfg.gate!r}")
  if config.rows % config.block:
    raise ValueError(f"preprocess_vjp: rows {config.rows} not a multiple of block "
                     f"{config.block}")
  block = config.block
  rows = block * min(config.rows // block, pl.cdiv(t, block))
  nt = pl.cdiv(t, rows)
  gated = cfg.gate is not None
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, g, beta)]
  out_shape += [jax.ShapeDtypeStruct((bsz, nt, hv, kd), jnp.float32)] * (2 * gated)
  kern = functools.partial(_kernel, t=t, kd=kd, group=hv // h, rows=rows, block=block,
                           l2norm=bool(cfg.use_qk_l2norm), gate=cfg.gate,
                           lower_bound=float(cfg.lower_bound), logit=bool(cfg.beta_is_logit))
  dq, dk, dg, dbeta, *parts = pl.pallas_call(
      kern, grid=(nt, h, bsz), out_shape=out_shape, interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=1),
      name="kda_prep_vjp")(q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta)
  if gated:
    dalog, ddtb = parts[0].sum((0, 1, 3)), parts[1].sum((0, 1))
  else:
    dalog, ddtb = jnp.zeros(A_log.shape, jnp.float32), jnp.zeros(dt_bias.shape, jnp.float32)
  return dq, dk, dg, dbeta, dalog.astype(A_log.dtype), ddtb.astype(dt_bias.dtype)
