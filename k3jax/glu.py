"""Gated MLPs: SiTU-GLU (K3) and SiLU-GLU (Kimi Linear), and the dense GLU block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.nn import Linear
from sharding import shard


def situ_glu(a: jax.Array, b: jax.Array, beta: float = 4.0, beta_lin: float = 25.0) -> jax.Array:
  """SiTU-GLU: ``(beta * tanh(a / beta) * sigmoid(a)) * (beta_lin * tanh(b / beta_lin))``.

  Bounded by ``beta * beta_lin`` (100 for K3); behaves like SwiGLU near the origin."""
  return (beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a)) * (beta_lin * jnp.tanh(b / beta_lin))


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
