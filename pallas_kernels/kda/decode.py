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
:mod:`pallas_kernels.kda`.

Measured on an H200 (``benchmarks/kda.py --decode-sweep``, 2026-12-01, H=32, K=V=128, Tn=1):
3.61 TB/s at N=256 and 3.14 at N=64 (one warp per 16 value rows), against an in-place XLA
scaling of the same pool at 3.99 and 3.50. The pool's former ``[K, V]`` layout put K across the
warps of a tile; its best tiling reached 3.43 and 2.91. Slower there and removed: the grid by
request (3.18 at N=256), the reductions one after the other (3.33), a program over several tiles
with the next one prefetched (3.0), eviction hints (3.27).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import gpu
from pallas_kernels.kda.reference import L2_EPS

# Keyword arguments of ``_decode_gpu`` timed by ``benchmarks/kda.py --decode-sweep``, the
# default first (2026-12-01, N=256: 3.61 TB/s; V tile 8 3.51, V tile 16 at 4 warps 3.54).
SWEEP = (
    {},  # V tile 16, 1 warp
    dict(block_v=8),
    dict(block_v=32),
    dict(block_v=4),
    dict(block_v=16, num_warps=4),
    dict(block_v=32, num_warps=8),
    dict(block_v=32, num_warps=2),
)


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


def _decode_gpu(q, k, v, g, beta, state, slots, *, scale, use_qk_l2norm, A_log, dt_bias, gate,
                lower_bound, beta_is_logit, block_v=16, num_warps=1):
  """The Pallas GPU kernel; ``block_v`` (V tile width) and ``num_warps`` tune it (the defaults:
  the fastest of the sweep). (Triton's ``num_stages`` is left at 1: it leaves this kernel's code
  unchanged, as nothing here feeds a matrix product.)"""
  n, tn, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  bv = min(block_v, vd)
  if vd % bv:
    raise ValueError(f"kda_decode: block_v {block_v} must divide V={vd}")
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
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=gpu._interpret(),
      name="kda_decode",
  )(slots.astype(jnp.int32), q, k, v, g, beta, A_log.reshape(hv), dt_bias.reshape(hv, kd),
    state)


def kda_decode(q, k, v, g, beta, state, *, slots, scale, use_qk_l2norm=False, A_log=None,
               dt_bias=None, gate=None, lower_bound=-5.0, beta_is_logit=False, backend="gpu"):
  """Advances the pool rows ``slots`` by the Tn tokens. Returns ``(o [N, Tn, HV, V], state)``.

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
    return _decode_gpu(q, k, v, g, beta, state, slots, **kwargs)
  if backend != "tpu":
    raise ValueError(f"kda_decode: unknown backend {backend!r}")
  from pallas_kernels.kda import decode_xla  # the package's XLA path
  return decode_xla(q, k, v, g, beta, state, slots, **kwargs)
