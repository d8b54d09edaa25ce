"""Memory-lean next-token cross-entropy.

The logits of all tokens x vocab (163840 for K3) are never materialised in float32 at once: the
tokens are processed in chunks inside a ``lax.scan`` whose body is rematerialised, so the
backward pass recomputes one chunk's logits at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(h: jax.Array, w_head: jax.Array, targets: jax.Array, weights: jax.Array, *,
                  chunk_size: int = 1024) -> tuple[jax.Array, jax.Array]:
  """h ``[B, T, d]``, w_head ``[d, V]``, targets ``[B, T]`` int, weights ``[B, T]``.

  Returns (sum of weighted token losses, sum of weights), both float32 (or float64 in x64
  parameter dtype).
  """
  acc = jnp.promote_types(h.dtype, jnp.float32)
  d = h.shape[-1]
  n = h.shape[0] * h.shape[1]
  chunk = min(chunk_size, n)
  pad = (-n) % chunk
  hf = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0)))
  tf = jnp.pad(targets.reshape(n), (0, pad))
  wf = jnp.pad(weights.reshape(n).astype(acc), (0, pad))
  w = w_head.astype(h.dtype)

  @jax.checkpoint
  def chunk_loss(hc, tc, wc):
    logits = jnp.dot(hc, w, preferred_element_type=acc)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
    return jnp.sum((lse - tgt) * wc)

  def body(total, xs):
    return total + chunk_loss(*xs), None

  xs = (hf.reshape(-1, chunk, d), tf.reshape(-1, chunk), wf.reshape(-1, chunk))
  total, _ = jax.lax.scan(body, jnp.zeros((), acc), xs)
  return total, jnp.sum(wf)
