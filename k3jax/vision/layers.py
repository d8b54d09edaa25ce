"""The tower's building blocks: a linear layer with an optional bias, LayerNorm / RMSNorm, and
the two-layer MLP of each encoder block (tanh GELU, as the reference's ``PytorchGELUTanh``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.nn import Linear, constant, param, rms_norm


class Dense(Linear):
  """``y = x @ kernel (+ bias)``: kernel ``[in, out]`` (a torch ``Linear`` weight transposed)."""

  def __init__(self, din: int, dout: int, names: tuple[str | None, str | None], *, bias: bool,
               rngs: nnx.Rngs, dtype, std: float):
    super().__init__(din, dout, names, rngs=rngs, dtype=dtype, std=std)
    self.bias = param(rngs, constant(0.0), (dout,), (names[1],), dtype) if bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = super().__call__(x)
    return y if self.bias is None else y + self.bias[...].astype(y.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """LayerNorm over the last axis, in float32 (or wider), returned in x's dtype."""
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  centred = xf - mean
  var = jnp.mean(centred * centred, axis=-1, keepdims=True)
  y = centred * jax.lax.rsqrt(var + eps) * weight.astype(xf.dtype) + bias.astype(xf.dtype)
  return y.astype(x.dtype)


class Norm(nnx.Module):
  """``kind`` "layernorm" (weight and bias, K2.5) or "rmsnorm" (weight, K3) over ``dim``."""

  def __init__(self, dim: int, kind: str, eps: float, *, rngs: nnx.Rngs, dtype,
               name: str | None = "embed"):
    self.weight = param(rngs, constant(1.0), (dim,), (name,), dtype)
    self.bias = param(rngs, constant(0.0), (dim,), (name,), dtype) if kind == "layernorm" else None
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.bias is None:
      return rms_norm(x, self.weight[...], self.eps)
    return layer_norm(x, self.weight[...], self.bias[...], self.eps)


class MLP2(nnx.Module):
  """``fc1(gelu_tanh(fc0(x)))``: ``[..., d] -> [..., d]`` through ``intermediate``."""

  def __init__(self, d: int, intermediate: int, *, bias: bool, rngs: nnx.Rngs, dtype, std: float):
    kw = dict(bias=bias, rngs=rngs, dtype=dtype, std=std)
    self.fc0 = Dense(d, intermediate, ("embed", "mlp"), **kw)
    self.fc1 = Dense(intermediate, d, ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc1(jax.nn.gelu(self.fc0(x), approximate=True))
