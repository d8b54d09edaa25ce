"""Gated MLPs: SiTU-GLU (K3) and SiLU-GLU (Kimi Linear), and the dense GLU block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.nn import Linear
from sharding import shard


def _situ_parts(a, b, beta: float, beta_lin: float):
  """``(tanh(a / beta), sigmoid(a), tanh(b / beta_lin))`` in float32 (float64 for float64 inputs)
  from three exponentials of non-positive arguments and one division (no overflow: every factor
  lies in (0, 2]), cheaper on GPUs than two library tanh and a sigmoid."""
  dt = jnp.promote_types(jnp.result_type(a, b), jnp.float32)
  a, b = a.astype(dt), b.astype(dt)
  e1 = jnp.exp(-2.0 / beta * jnp.abs(a))      # tanh(|a|/beta) = (1 - e1) / (1 + e1)
  e2 = e1 * e1 if beta == 4.0 else jnp.exp(-jnp.abs(a))  # sigmoid(|a|) = 1 / (1 + e2)
  e3 = jnp.exp(-2.0 / beta_lin * jnp.abs(b))  # tanh(|b|/beta_lin) = (1 - e3) / (1 + e3)
  p1, p2, p3 = 1.0 + e1, 1.0 + e2, 1.0 + e3
  r = 1.0 / (p1 * p2 * p3)
  ta = jnp.sign(a) * ((1.0 - e1) * p2 * p3 * r)
  sa = jnp.where(a >= 0, 1.0, e2) * (p1 * p3 * r)
  tb = jnp.sign(b) * ((1.0 - e3) * p1 * p2 * r)
  return ta, sa, tb


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def situ_glu(a: jax.Array, b: jax.Array, beta: float = 4.0, beta_lin: float = 25.0) -> jax.Array:
  """SiTU-GLU: ``(beta * tanh(a / beta) * sigmoid(a)) * (beta_lin * tanh(b / beta_lin))``.

  Bounded by ``beta * beta_lin`` (100 for K3); behaves like SwiGLU near the origin. Computed in
  float32 and returned in the inputs' dtype; the backward recomputes from ``a`` and ``b`` alone."""
  ta, sa, tb = _situ_parts(a, b, beta, beta_lin)
  return ((beta * beta_lin) * ta * sa * tb).astype(jnp.result_type(a, b))


def _situ_glu_fwd(a, b, beta, beta_lin):
  return situ_glu(a, b, beta, beta_lin), (a, b)


def _situ_glu_bwd(beta, beta_lin, res, g):
  a, b = res
  ta, sa, tb = _situ_parts(a, b, beta, beta_lin)
  g = g.astype(ta.dtype)
  u = beta * ta * sa  # the gate half, and d u / d a below
  du = (1.0 - ta * ta) * sa + beta * ta * sa * (1.0 - sa)
  da = g * (beta_lin * tb) * du
  db = g * u * (1.0 - tb * tb)
  return da.astype(a.dtype), db.astype(b.dtype)


situ_glu.defvjp(_situ_glu_fwd, _situ_glu_bwd)


def silu_glu(a: jax.Array, b: jax.Array) -> jax.Array:
  return jax.nn.silu(a) * b


def glu_activation(cfg: ModelConfig):
  """The ``(gate, up) -> h`` activation of the config."""
  if cfg.activation == "situ":
    beta, beta_lin = cfg.situ_beta, cfg.situ_linear_beta
    return lambda a, b: situ_glu(a, b, beta, beta_lin)
  return silu_glu


class GLU(nnx.Module):
  """``down(act(gate(x), up(x)))``: x ``[B, T, d]`` -> ``[B, T, d]``."""

  def __init__(self, cfg: ModelConfig, intermediate: int, *, rngs: nnx.Rngs):
    dt, d, std = cfg.pdtype, cfg.hidden_size, cfg.init_std
    self.gate_proj = Linear(d, intermediate, ("embed", "mlp"), rngs=rngs, dtype=dt, std=std)
    self.up_proj = Linear(d, intermediate, ("embed", "mlp"), rngs=rngs, dtype=dt, std=std)
    self.down_proj = Linear(intermediate, d, ("mlp", "embed"), rngs=rngs, dtype=dt, std=std)
    self.act = glu_activation(cfg)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.act(self.gate_proj(x), self.up_proj(x))
    if h.ndim == 3:
      h = shard(h, ("batch", "length", "mlp"))
    return self.down_proj(h)
