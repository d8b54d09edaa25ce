"""The k-th smallest value of each column by a radix select in plain jnp (the reference of
:mod:`pallas_kernels.select`), and the order-preserving float32 <-> uint32 key map it uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SIGN = 1 << 31


def to_keys(x: jax.Array) -> jax.Array:
  """uint32 keys of float32 ``x`` (any shape) ordered as the floats: larger float, larger key
  (negative: ``~bits``, else ``bits | 0x80000000``; so -0.0 < +0.0). No NaNs."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  sign = jnp.uint32(_SIGN)
  return jnp.where(bits >= sign, ~bits, bits | sign)


def from_keys(key: jax.Array) -> jax.Array:
  """float32 values of uint32 keys: the inverse of :func:`to_keys`."""
  sign = jnp.uint32(_SIGN)
  bits = jnp.where(key >= sign, key & ~sign, ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def kth_smallest(x: jax.Array, k) -> jax.Array:
  """``jnp.sort(x, axis=0)[k]`` ``[E]`` for float32 ``x [N, E]`` and an int ``0 <= k < N`` (traced
  or not), exactly and without a sort: a radix select over :func:`to_keys`, 4 bits per pass (8
  passes, each one count of N x E comparisons per digit value). No NaNs."""
  key = to_keys(x)
  rank = jnp.broadcast_to(jnp.asarray(k, jnp.int32), x.shape[1:])  # [E] left to skip
  prefix = jnp.zeros(x.shape[1:], jnp.uint32)  # the answer's bits found so far
  match = jnp.ones(x.shape, bool)  # [N, E] keys that agree with them
  digits = jnp.arange(16, dtype=jnp.uint32)
  for shift in range(28, -1, -4):
    digit = (key >> shift) & 15
    counts = jnp.sum(match[..., None] & (digit[..., None] == digits), axis=0,
                     dtype=jnp.int32)  # [E, 16]
    cum = jnp.cumsum(counts, axis=-1)
    d = jnp.sum(cum <= rank[..., None], axis=-1)  # [E] the digit holding the rank-th key
    rank = rank - jnp.where(d > 0, jnp.take_along_axis(cum, jnp.maximum(d - 1, 0)[..., None],
                                                       -1)[..., 0], 0)
    prefix = prefix | (d.astype(jnp.uint32) << shift)
    match = match & (digit == d.astype(jnp.uint32))
  return from_keys(prefix)
