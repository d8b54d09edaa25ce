"""Pure-JAX references for Kimi Delta Attention (SPEC section 2).

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` log-space decay
(``g <= 0``); beta ``[B, T, HV]``; state ``[B, HV, K, V]`` float32. ``HV`` is a multiple of ``H``
(grouped values): value head ``j`` reads query/key head ``j // (HV // H)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def l2norm(x: jax.Array) -> jax.Array:
  """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, computed in float32 (or float64)."""
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)).astype(x.dtype)


def kda_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array, kind: str,
             lower_bound: float = -5.0) -> jax.Array:
  """Log-space decay from the raw gate projection.

  f: ``[..., HV, K]``; A_log: ``[HV]``; dt_bias: ``[HV*K]``. Returns g with the dtype of f
  promoted to float32.
  - "softplus" (Kimi Linear): ``g = -exp(A_log) * softplus(f + dt_bias)``
  - "bounded" (K3): ``g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` in (lower_bound, 0)
  """
  dt = jnp.promote_types(f.dtype, jnp.float32)
  hv, kd = f.shape[-2:]
  x = f.astype(dt) + dt_bias.astype(dt).reshape(hv, kd)
  a = jnp.exp(A_log.astype(dt)).reshape(hv, 1)
  if kind == "softplus":
    return -a * jax.nn.softplus(x)
  if kind == "bounded":
    return lower_bound * jax.nn.sigmoid(a * x)
  raise ValueError(f"kda_gate: unknown gate kind {kind!r} (expected 'softplus' or 'bounded')")


def expand_heads(x: jax.Array, hv: int) -> jax.Array:
  """Repeats query/key heads ``[..., H, D]`` to the value heads ``[..., HV, D]``."""
  h = x.shape[-2]
  if hv % h:
    raise ValueError(f"value heads {hv} must be a multiple of query/key heads {h}")
  return x if hv == h else jnp.repeat(x, hv // h, axis=-2)


def restart_mask(segment_ids: jax.Array | None, b: int, t: int) -> jax.Array:
  """``[B, T]`` bool: True where a new segment starts (never at t=0: the row's first segment
  continues from the initial state)."""
  if segment_ids is None:
    return jnp.zeros((b, t), bool)
  return jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)


def kda_naive(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None):
  """Token-by-token recurrence. Returns (o ``[B, T, HV, V]``, final state ``[B, HV, K, V]``).

  At a segment start the state is reset to zero before the token is processed.
  """
  b, t, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  q = expand_heads(q, hv).astype(acc)
  k = expand_heads(k, hv).astype(acc)
  v, g, beta = v.astype(acc), g.astype(acc), beta.astype(acc)
  s0 = (jnp.zeros((b, hv, kd, vd), acc) if initial_state is None
        else initial_state.astype(acc))
  restart = restart_mask(segment_ids, b, t)

  def step(s, xs):
    qt, kt, vt, gt, bt, rt = xs  # [B,HV,K], [B,HV,K], [B,HV,V], [B,HV,K], [B,HV], [B]
    s = jnp.where(rt[:, None, None, None], 0.0, s)
    s = s * jnp.exp(gt)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", kt, s)
    s = s + jnp.einsum("bhk,bhv->bhkv", kt, bt[..., None] * (vt - pred))
    o = scale * jnp.einsum("bhk,bhkv->bhv", qt, s)
    return s, o

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, restart))
  s, o = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(o, 0, 1), s
