"""The GLU activations' maths and their XLA forms (the reference of :mod:`pallas_kernels.glu`).

Everything is evaluated in float32 (float64 for float64 inputs) and returned in the inputs'
dtype. ``gu [..., 2F]`` packs the gate half ``a`` and the up half ``b``.
"""

from __future__ import annotations

import jax.numpy as jnp

KINDS = ("situ", "silu")


def _situ_parts(a, b, beta: float, beta_lin: float, exp):
  """``(tanh(a / beta), sigmoid(a), tanh(b / beta_lin))`` from three exponentials of
  non-positive arguments and one division (no overflow: every factor lies in (0, 2]), cheaper on
  GPUs than two library tanh and a sigmoid."""
  e1 = exp(-2.0 / beta * jnp.abs(a))      # tanh(|a|/beta) = (1 - e1) / (1 + e1)
  e2 = e1 * e1 if beta == 4.0 else exp(-jnp.abs(a))  # sigmoid(|a|) = 1 / (1 + e2)
  e3 = exp(-2.0 / beta_lin * jnp.abs(b))  # tanh(|b|/beta_lin) = (1 - e3) / (1 + e3)
  p1, p2, p3 = 1.0 + e1, 1.0 + e2, 1.0 + e3
  r = 1.0 / (p1 * p2 * p3)
  ta = jnp.sign(a) * ((1.0 - e1) * p2 * p3 * r)
  sa = jnp.where(a >= 0, 1.0, e2) * (p1 * p3 * r)
  tb = jnp.sign(b) * ((1.0 - e3) * p1 * p2 * r)
  return ta, sa, tb


def glu_math(kind: str, beta: float, beta_lin: float, a, b, grads: bool = True, exp=jnp.exp):
  """``h`` (and ``dh/da``, ``dh/db`` when ``grads``) of activation ``kind`` at float32 (or
  float64) ``a``, ``b``. ``situ``: ``(beta tanh(a/beta) sigmoid(a)) (beta_lin tanh(b/beta_lin))``;
  ``silu``: ``silu(a) b``. ``exp`` is the exponential to use (the Triton kernels pass
  :func:`pallas_kernels.triton_math.exp`)."""
  if kind == "situ":
    ta, sa, tb = _situ_parts(a, b, beta, beta_lin, exp)
    u = beta * ta * sa  # the gate half
    h = u * (beta_lin * tb)
    if not grads:
      return h
    du = (1.0 - ta * ta) * sa + beta * ta * sa * (1.0 - sa)
    return h, du * (beta_lin * tb), u * (1.0 - tb * tb)
  s = 1.0 / (1.0 + exp(-a))
  if not grads:
    return a * s * b
  return a * s * b, b * s * (1.0 + a * (1.0 - s)), a * s


def f32(x):
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def split(gu, f: int):
  """The gate and up columns ``[0, F)`` and ``[F, 2F)`` of ``gu [..., W]``, widened to float32."""
  return f32(gu[..., :f]), f32(gu[..., f:2 * f])


def glu_fwd(gu, f: int, kind: str, beta: float, beta_lin: float):
  """``h [..., F]`` of the gate and up columns ``[0, 2F)`` of ``gu [..., W]``."""
  return glu_math(kind, beta, beta_lin, *split(gu, f), grads=False).astype(gu.dtype)


def glu_grads(a, b, g, kind: str, beta: float, beta_lin: float):
  """Float32 (or wider) ``(d a, d b)`` for gate ``a``, up ``b`` and output cotangent ``g``."""
  _, da, db = glu_math(kind, beta, beta_lin, f32(a), f32(b))
  g = f32(g)
  return g * da, g * db


def glu_bwd(gu, g, f: int, kind: str, beta: float, beta_lin: float):
  """``d gu [..., 2F]`` of the columns ``[0, 2F)`` of ``gu [..., W]`` for the output cotangent
  ``g [..., F]``."""
  da, db = glu_grads(*split(gu, f), g, kind, beta, beta_lin)
  return jnp.concatenate([da, db], axis=-1).astype(gu.dtype)


def glu_pair_fwd(a, b, kind: str, beta: float, beta_lin: float):
  """``h [..., F]`` of the gate ``a`` and up ``b`` ``[..., F]``, in their dtype."""
  return glu_math(kind, beta, beta_lin, f32(a), f32(b), grads=False).astype(jnp.result_type(a, b))


def glu_pair_bwd(a, b, g, kind: str, beta: float, beta_lin: float):
  """``(d a, d b)`` in a's and b's dtypes for the output cotangent ``g [..., F]``."""
  da, db = glu_grads(a, b, g, kind, beta, beta_lin)
  return da.astype(a.dtype), db.astype(b.dtype)
