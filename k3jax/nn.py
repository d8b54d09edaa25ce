"""Basic building blocks: parameters with logical axis names, Linear, RMSNorm, Embed.

Every parameter is an ``nnx.Param`` whose ``sharding_names`` metadata holds one logical axis
name per dimension (see :mod:`sharding.rules`). Parameters are stored in ``param_dtype`` and
cast to the compute dtype where they are used.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def param(rngs: nnx.Rngs, init: Init, shape: Sequence[int], names: Sequence[str | None],
          dtype) -> nnx.Param:
  """An ``nnx.Param`` of ``shape`` with logical axis ``names`` (one per dimension)."""
  if len(shape) != len(names):
    raise ValueError(f"param: {len(names)} axis names {tuple(names)} for shape {tuple(shape)}")
  return nnx.Param(init(rngs.params(), tuple(shape), dtype), sharding_names=tuple(names),
                   eager_sharding=False)


def normal(std: float) -> Init:
  return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def constant(value: float) -> Init:
  return lambda key, shape, dtype: jnp.full(shape, value, dtype)


class Linear(nnx.Module):
  """``y = x @ kernel`` with ``kernel [in, out]`` (no bias)."""

  def __init__(self, din: int, dout: int, names: tuple[str | None, str | None], *, rngs: nnx.Rngs,
               dtype, std: float = 0.02):
    self.kernel = param(rngs, normal(std), (din, dout), names, dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.dot(x, self.kernel[...].astype(x.dtype))


def head_major(sharded: Sequence[jax.Array], whole: Sequence[jax.Array], shards: int) -> nnx.Param:
  """One input weight ``[in, shards, P]`` for several projections of the same input, ``P`` split
  over ``shards`` head shards the way each shard needs it: its own share of every ``sharded``
  kernel's columns (``[in, out]``, heads split over ``tensor``), then every ``whole`` kernel (an
  unsharded low rank) repeated. Logical names ``("embed", "heads", None)``."""
  split = lambda w: w.reshape(w.shape[0], shards, -1)
  rep = lambda w: jnp.broadcast_to(w[:, None], (w.shape[0], shards, w.shape[1]))
  w = jnp.concatenate([split(w) for w in sharded] + [rep(w) for w in whole], -1)
  return nnx.Param(w, sharding_names=("embed", "heads", None), eager_sharding=False)


def per_shard(a: jax.Array, kernel: jax.Array) -> jax.Array:
  """Each shard's copy of a low-rank input ``a [B, T, shards, r]`` (a :func:`head_major`
  weight's repeated part) times its own columns of ``kernel [r, out]`` (heads split over the
  shards) -> ``[B, T, out]``: the low rank's second projection without gathering a shard."""
  w = kernel.astype(a.dtype)
  y = jnp.einsum("btsr,rsn->btsn", a, w.reshape(w.shape[0], a.shape[2], -1))
  return y.reshape(*a.shape[:2], -1)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
  """RMSNorm over the last axis of x ``[..., d]`` in float32 (or wider), returned in x's dtype;
  weight ``[d]`` or None.

  The backward keeps x in its own dtype and the rows' ``1 / rms`` ``[..., 1]``, not the float32
  copies of ``[..., d]`` that autodiff would."""
  return _rms_norm(x, weight, eps)


def _rms_norm_fwd(x, weight, eps):
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  y = xf * r
  if weight is not None:
    y = y * weight.astype(y.dtype)
  return y.astype(x.dtype), (x, weight, r)


def _rms_norm_bwd(eps, res, dy):
  del eps
  x, weight, r = res
  xf = x.astype(r.dtype)
  g = dy.astype(r.dtype)
  dw = None
  if weight is not None:
    dw = jnp.sum((g * xf * r).reshape(-1, x.shape[-1]), axis=0).astype(weight.dtype)
    g = g * weight.astype(r.dtype)
  # r <= eps^-1/2, so r^3 stays finite; a row whose square sum overflowed (r = 0) gets a NaN
  # gradient from inf * 0, as under autodiff, for the train step's non-finite guard to see
  dx = r * g - xf * (r * r * r * jnp.mean(g * xf, axis=-1, keepdims=True))
  return dx.astype(x.dtype), dw


_rms_norm = jax.custom_vjp(lambda x, weight, eps: _rms_norm_fwd(x, weight, eps)[0],
                           nondiff_argnums=(2,))
_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype, name: str | None = "embed"):
    self.weight = param(rngs, constant(1.0), (dim,), (name,), dtype)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)


class Embed(nnx.Module):
  def __init__(self, vocab: int, dim: int, *, rngs: nnx.Rngs, dtype, std: float = 0.02):
    self.embedding = param(rngs, normal(std), (vocab, dim), ("vocab", "embed"), dtype)

  def __call__(self, ids: jax.Array, dtype) -> jax.Array:
    return jnp.take(self.embedding[...], ids, axis=0).astype(dtype)
