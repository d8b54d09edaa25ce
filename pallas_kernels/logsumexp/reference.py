"""XLA form of the row log-sum-exp (the reference of :mod:`pallas_kernels.logsumexp`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logsumexp(x: jax.Array) -> jax.Array:
  """``log(sum(exp(x), -1))`` of ``x [..., V]`` in ONE pass over x: a variadic reduction of
  (running max, sum of exponentials relative to it), one exponential per element. The usual
  form reads x twice (max, then the sum). bf16 input is summed in float32."""
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  def combine(a, b):
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    e = jnp.where(m == -jnp.inf, 0.0, jnp.exp(jnp.minimum(m1, m2) - m))
    return m, jnp.where(m1 >= m2, s1 + s2 * e, s1 * e + s2)

  neg, zero = jnp.array(-jnp.inf, x.dtype), jnp.array(0, x.dtype)
  m, s = jax.lax.reduce((x, jnp.ones_like(x)), (neg, zero), combine, (x.ndim - 1,))
  return m + jnp.log(s)
