"""KDA decode: a few new tokens for N requests against a pool of float32 states.

Shapes: q, k ``[N, Tn, H, K]``; v ``[N, Tn, HV, V]``; g ``[N, Tn, HV, K]``; beta ``[N, Tn, HV]``;
state pool ``[S, HV, V, K]`` float32, K-last (the transpose of the chunked op's ``[B, HV, K, V]``
states: ``pallas_kernels.kda.to_pool`` / ``from_pool``); slots ``[N]`` int32 (pool row of each request).

GPU (Pallas, Triton lowering): one program per ``[block_v, K]`` tile of one value head of one
request, consecutive programs on consecutive tiles of a request (its contiguous memory). It loads
the tile once, applies the Tn token updates of SPEC section 2 in registers (with the L2 norm, the
gate from ``f, A_log, dt_bias`` and the beta sigmoid fused) and writes it back in place. Per
token the two reductions over K, ``k.S`` and ``q.S`` of the decayed state, run side by side and
``o = q.S + (q.k) delta`` (``delta = beta (v - k.S)``). With K last, a tile row is contiguous and
lies in one warp, so both reductions stay inside a warp (registers and shuffles, no shared
memory or block barrier between the tile's load and its store). The pool is an input/output
alias, so with the pool donated nothing else of it is touched. Other backends use the XLA path of
:mod:`pallas_kernels.kda`. Its tuning and the layouts and variants measured against it:
``benchmarks/kda.py --decode-sweep``, benchmarks/RESULTS.md (KDA decode sweeps 1-3).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda.config import interpret
from pallas_kernels.kda.reference import L2_EPS


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiling of the GPU decode kernel: ``block_v`` value rows per program, ``num_warps`` warps
  (Triton's ``num_stages`` stays 1: nothing here feeds a matrix product)."""
  block_v: int = 16
  num_warps: int = 1


# The tunings ``benchmarks/kda.py --decode-sweep`` times, the default first.
SWEEP = (DecodeConfig(), DecodeConfig(block_v=8), DecodeConfig(block_v=32),
         DecodeConfig(block_v=4), DecodeConfig(block_v=16, num_warps=4),
         DecodeConfig(block_v=32, num_warps=8), DecodeConfig(block_v=32, num_warps=2))


def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, b_ref, alog_ref, dtb_ref, s_ref,
                   o_ref, so_ref, *, tn, group, bv, nvt, scale, l2, gate, lower_bound,
                   beta_logit):
  f32 = jnp.float32
  p, n = pl.program_id(0), pl.program_id(1)
  slot = slots_ref[n]
  h, vs = p // nvt, pl.ds((p % nvt) * bv, bv)
  s = s_ref[slot, h, vs, :]  # [BV, K] float32
  for t in range(tn):
    q = q_ref[n, t, h // group, :].astype(f32)
    k = k_ref[n, t, h // group, :].astype(f32)
    if l2:
      q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS)
      k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    g = g_ref[n, t, h, :].astype(f32)
    if gate is not None:
      x = g + dtb_ref[h, :].astype(f32)
      a = jnp.exp(alog_ref[h].astype(f32))
      g = (lower_bound * jax.nn.sigmoid(a * x) if gate == "bounded"
           else -a * jax.nn.softplus(x))
    beta = b_ref[n, t, h].astype(f32)
    if beta_logit:
      beta = jax.nn.sigmoid(beta)
    s = s * jnp.exp(g)[None, :]
    pred = jnp.sum(s * k[None, :], axis=1)
    qs = jnp.sum(s * q[None, :], axis=1)
    delta = beta * (v_ref[n, t, h, vs].astype(f32) - pred)
    s = s + delta[:, None] * k[None, :]
    o = qs + jnp.sum(q * k) * delta  # q.S' with S' = S + k delta
    o_ref[n, t, h, vs] = (scale * o).astype(o_ref.dtype)
  so_ref[slot, h, vs, :] = s


def decode_gpu(q, k, v, g, beta, state, slots, *, scale, use_qk_l2norm, A_log, dt_bias, gate,
               lower_bound, beta_is_logit, config: DecodeConfig = DecodeConfig()):
  """The Pallas GPU kernel at the tiling ``config`` (the default: the fastest of the sweep)."""
  n, tn, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  bv = min(config.block_v, vd)
  if vd % bv:
    raise ValueError(f"kda_decode: block_v {config.block_v} must divide V={vd}")
  if gate is None:
    A_log, dt_bias = jnp.zeros((hv,), jnp.float32), jnp.zeros((hv * kd,), jnp.float32)
  kern = functools.partial(_decode_kernel, tn=tn, group=hv // h, bv=bv, nvt=vd // bv,
                           scale=float(scale), l2=bool(use_qk_l2norm), gate=gate,
                           lower_bound=float(lower_bound), beta_logit=bool(beta_is_logit))
  return pl.pallas_call(
      kern,
      out_shape=[jax.ShapeDtypeStruct((n, tn, hv, vd), v.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype)],
      grid=(hv * (vd // bv), n),
      input_output_aliases={8: 1},
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret(),
      name="kda_decode",
  )(slots.astype(jnp.int32), q, k, v, g, beta, A_log.reshape(hv), dt_bias.reshape(hv, kd),
    state)


def kda_decode(q, k, v, g, beta, state, *, slots, scale, use_qk_l2norm=False, A_log=None,
               dt_bias=None, gate=None, lower_bound=-5.0, beta_is_logit=False, backend="gpu",
               config: DecodeConfig = DecodeConfig()):
  """Advances the pool rows ``slots`` by the Tn tokens. Returns ``(o [N, Tn, HV, V], state)``.
  ``config``: the GPU kernel's tiling.

  Donate ``state`` to the enclosing ``jax.jit`` so the update happens in place.
  """
  n, tn, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  if state.dtype != jnp.float32 or state.shape[1:] != (hv, vd, kd):
    raise ValueError(f"kda_decode: state {state.shape} {state.dtype} must be the float32 "
                     f"K-last pool [S, HV={hv}, V={vd}, K={kd}]")
  if slots.shape != (n,):
    raise ValueError(f"kda_decode: slots {slots.shape} must be [N={n}]")
  if gate is not None and (A_log is None or dt_bias is None):
    raise ValueError("kda_decode: gate set but A_log / dt_bias missing")
  kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                gate=gate, lower_bound=lower_bound, beta_is_logit=beta_is_logit)
  if backend == "gpu":
    return decode_gpu(q, k, v, g, beta, state, slots, config=config, **kwargs)
  if backend != "tpu":
    raise ValueError(f"kda_decode: unknown backend {backend!r}")
  from pallas_kernels.kda import decode_xla  # the package's XLA path
  return decode_xla(q, k, v, g, beta, state, slots, **kwargs)
