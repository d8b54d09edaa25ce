"""KDA decode: a few new tokens for N requests against a pool of float32 states.

Shapes: q, k ``[N, Tn, H, K]``; v ``[N, Tn, HV, V]``; g ``[N, Tn, HV, K]``; beta ``[N, Tn, HV]``;
state pool ``[S, HV, K, V]`` float32; slots ``[N]`` int32 (pool row of each request).

GPU (Pallas, Triton lowering): a request's state is cut into ``HV * V / block_v`` units, one
``[K, block_v]`` tile of one value head each, numbered ``u = head * (V / block_v) + V tile`` (the
memory order). A program takes ``units`` consecutive units of one request: it loads each tile
once, applies the Tn token updates of SPEC section 2 in registers (with the L2 norm, the gate
from ``f, A_log, dt_bias`` and the beta sigmoid fused) and writes it back in place; with more
than one unit it issues the next tile's load before working on the current one (software
pipelining). The pool is an input/output alias, so with the pool donated nothing else of it is
touched. Other backends use the XLA path of :mod:`pallas_kernels.kda`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kda import gpu, reference
from pallas_kernels.kda.reference import L2_EPS

ORDERS = ("requests", "units")  # which grid axis the GPU schedules fastest
EVICTION_POLICIES = (None, "evict_first")
REDUCTIONS = ("sequential", "together")
# Keyword arguments of ``_decode_gpu`` timed by ``benchmarks/kda.py --decode-sweep``, the
# default first (the sweeps of 2026-12-01 on an H200, N=256: 3.40 TB/s for the default, 3.33
# with the reductions in sequence, 3.25-3.28 at V tile 32, with evict_first, 3.21 at V tile 128,
# 3.18 by request, 3.0 with prefetching units, 2.7 with one warp). Registers per thread at H=32,
# K=V=128, Tn=1 with the reductions in sequence (Triton 3.5.1, ptxas sm_90a, no spills) in
# brackets: the tiles in registers fill about half of the register file per SM in all.
SWEEP = (
    {},  # V tile 64, 4 warps, consecutive programs on consecutive tiles of a request [128]
    dict(order="requests"),  # consecutive programs on different requests (2 MB apart) [128]
    dict(block_v=32),  # fla's tiling [72]
    dict(block_v=128),  # [237]
    dict(block_v=32, num_warps=2),  # [127]
    dict(eviction_policy="evict_first"),  # [128]
    dict(block_v=32, units=4),  # the next tile's load issued before this one's work [118]
    dict(block_v=64, units=2),  # [253]
    dict(block_v=16, num_warps=1),  # one warp: no block-wide barriers [128]
    dict(reductions="sequential"),  # q.S' after the update: the reductions one after the other
)


def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, b_ref, alog_ref, dtb_ref, s_ref,
                   o_ref, so_ref, *, tn, group, bv, nvt, units, order, evict, together, scale,
                   l2, gate, lower_bound, beta_logit):
  f32 = jnp.float32
  n, p = ((pl.program_id(0), pl.program_id(1)) if order == "requests"
          else (pl.program_id(1), pl.program_id(0)))
  slot = slots_ref[n]
  first = p * units

  def tile(ref, u):  # [K, BV] view of unit u
    return ref.at[slot, u // nvt, :, pl.ds((u % nvt) * bv, bv)]

  def load(u):
    return plgpu.load(tile(s_ref, u), eviction_policy=evict)

  def advance(u, s):  # the Tn tokens on the tile s of unit u, written back
    h, vs = u // nvt, pl.ds((u % nvt) * bv, bv)
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
      s = s * jnp.exp(g)[:, None]
      pred = jnp.sum(k[:, None] * s, axis=0)
      if together:  # q.S' = q.S + (q.k) delta: both reductions read the decayed S
        qs = jnp.sum(q[:, None] * s, axis=0)
      delta = beta * (v_ref[n, t, h, vs].astype(f32) - pred)
      s = s + k[:, None] * delta[None, :]
      o = qs + jnp.sum(q * k) * delta if together else jnp.sum(q[:, None] * s, axis=0)
      o_ref[n, t, h, vs] = (scale * o).astype(o_ref.dtype)
    plgpu.store(tile(so_ref, u), s, eviction_policy=evict)

  def body(i, s):
    nxt = load(first + i + 1)  # in flight while unit first + i is worked on
    advance(first + i, s)
    return nxt

  s = jax.lax.fori_loop(0, units - 1, body, load(first)) if units > 1 else load(first)
  advance(first + units - 1, s)


def _decode_gpu(q, k, v, g, beta, state, slots, *, scale, use_qk_l2norm, A_log, dt_bias, gate,
                lower_bound, beta_is_logit, block_v=64, num_warps=4, units=1, order="units",
                eviction_policy=None, reductions="together"):
  """The Pallas GPU kernel. Tuning: ``block_v`` (V tile width), ``num_warps``, ``units`` (tiles
  per program, the next one's load issued before the current one is worked on), ``order``
  (``"requests"``: consecutive programs take different requests; ``"units"``: consecutive
  programs take consecutive tiles of one request, i.e. contiguous memory) and
  ``eviction_policy`` of the state loads and stores, ``reductions``: ``"sequential"`` (k.S, the
  update, then q.S') or ``"together"`` (k.S and q.S of the decayed state side by side, then
  ``o = q.S + (q.k) delta``: the two reductions over K no longer wait for each other). (Triton's
  ``num_stages`` is left at 1: it
  leaves this kernel's IR unchanged, as nothing here feeds a matrix product.) Defaults: the
  fastest at N=256 and N=64 of ``benchmarks/kda.py --decode-sweep`` on an H200 (2026-12-01
  06:25 UTC: 0.316 ms, 3.40 TB/s at N=256 and 2.92 TB/s at N=64, against 3.33 and 2.72 with
  the reductions in sequence and 3.18 / 2.82 with ``order="requests"``; an in-place XLA
  scaling of the same pool 4.00 / 3.57 TB/s)."""
  n, tn, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  bv = min(block_v, vd)
  if vd % bv or (hv * (vd // bv)) % units or order not in ORDERS or (
      eviction_policy not in EVICTION_POLICIES) or reductions not in REDUCTIONS:
    raise ValueError(f"kda_decode: block_v {block_v} must divide V={vd}, units {units} must "
                     f"divide HV*V/block_v={hv * (vd // bv)}, order {order!r} in {ORDERS}, "
                     f"eviction_policy {eviction_policy!r} in {EVICTION_POLICIES}, "
                     f"reductions {reductions!r} in {REDUCTIONS}")
  if gate is None:
    A_log, dt_bias = jnp.zeros((hv,), jnp.float32), jnp.zeros((hv * kd,), jnp.float32)
  programs = hv * (vd // bv) // units
  kern = functools.partial(_decode_kernel, tn=tn, group=hv // h, bv=bv, nvt=vd // bv,
                           units=units, order=order, evict=eviction_policy,
                           together=reductions == "together", scale=float(scale),
                           l2=bool(use_qk_l2norm), gate=gate, lower_bound=float(lower_bound),
                           beta_logit=bool(beta_is_logit))
  return pl.pallas_call(
      kern,
      out_shape=[jax.ShapeDtypeStruct((n, tn, hv, vd), v.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype)],
      grid=(n, programs) if order == "requests" else (programs, n),
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
  if state.dtype != jnp.float32 or state.shape[1:] != (hv, kd, vd):
    raise ValueError(f"kda_decode: state {state.shape} {state.dtype} must be float32 "
                     f"[S, {hv}, {kd}, {vd}]")
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
  from pallas_kernels.kda import _prepare  # the package's XLA pre-processing
  del kwargs["scale"]
  q, k, g, beta = _prepare(q, k, g, beta, **kwargs)
  o, s = reference.kda_naive(q, k, v, g, beta, scale=scale, initial_state=state[slots])
  return o.astype(v.dtype), state.at[slots].set(s.astype(state.dtype))
