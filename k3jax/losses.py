"""Memory-lean, fused next-token cross-entropy over the output head.

The logits of all tokens x vocab (163840 for K3) are never materialised at once: the tokens are
processed in chunks inside a ``lax.scan``. Under differentiation the forward scan also forms each
chunk's logit gradient ``softmax - onehot`` (cast to the compute dtype) and from it the gradients
of the hidden states and of the head, so the backward pass only scales them: three matmuls per
chunk (logits, ``dh``, ``dW``) instead of four (with a recomputed forward), all with
compute-dtype operands and float32 accumulation. Without differentiation (eval) only the losses
are computed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.logsumexp import logsumexp


def cross_entropy(h: jax.Array, w_head: jax.Array, targets: jax.Array, weights: jax.Array, *,
                  chunk_size: int = 1024) -> tuple[jax.Array, jax.Array]:
  """h ``[B, T, d]``, w_head ``[d, V]``, targets ``[B, T]`` int, weights ``[B, T]``.

  Returns (sum of weighted token losses, sum of weights), both float32 (or float64 in x64
  parameter dtype). The head is used in h's dtype; its gradient comes back in w_head's dtype.
  """
  acc = jnp.promote_types(h.dtype, jnp.float32)
  d = h.shape[-1]
  n = h.shape[0] * h.shape[1]
  chunk = min(chunk_size, n)
  pad = (-n) % chunk
  hf = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0))).reshape(-1, chunk, d)
  tf = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)
  wf = jnp.pad(weights.reshape(n).astype(acc), (0, pad)).reshape(-1, chunk)
  total = _chunked_loss(hf, w_head, tf, wf)
  return total, jnp.sum(wf)


def _chunk_logits(hc, wh, tc):
  """One chunk: (logits ``[c, V]`` float32, logsumexp ``[c]``, per-token loss ``[c]``); ``wh``
  is the head already in hc's dtype (cast once, outside the loop over chunks)."""
  acc = jnp.promote_types(hc.dtype, jnp.float32)
  logits = jnp.dot(hc, wh, preferred_element_type=acc)
  lse = logsumexp(logits)
  tgt = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
  return logits, lse, lse - tgt


@jax.custom_vjp
def _chunked_loss(hf, w, tf, wf):
  """hf ``[C, c, d]``, w ``[d, V]``, tf ``[C, c]`` int, wf ``[C, c]`` -> sum of weighted losses."""
  wh = w.astype(hf.dtype)

  def body(total, xs):
    hc, tc, wc = xs
    return total + jnp.sum(_chunk_logits(hc, wh, tc)[2] * wc), None

  total, _ = jax.lax.scan(body, jnp.zeros((), wf.dtype), (hf, tf, wf))
  return total


def _chunked_loss_fwd(hf, w, tf, wf):
  acc = wf.dtype
  wh = w.astype(hf.dtype)

  def body(carry, xs):
    total, dw = carry
    hc, tc, wc = xs
    logits, lse, tok = _chunk_logits(hc, wh, tc)
    p = jnp.exp(logits - lse[:, None]) * wc[:, None]
    hit = jnp.arange(logits.shape[-1], dtype=tc.dtype)[None, :] == tc[:, None]
    dl = jnp.where(hit, p - wc[:, None], p).astype(hf.dtype)  # d loss / d logits, [c, V]
    dh = jnp.dot(dl, wh.T, preferred_element_type=acc).astype(hf.dtype)
    dw = dw + jnp.dot(hc.T, dl, preferred_element_type=acc)
    return (total + jnp.sum(tok * wc), dw), (dh, tok)

  init = (jnp.zeros((), acc), jnp.zeros(w.shape, acc))
  (total, dw), (dh, tok) = jax.lax.scan(body, init, (hf, tf, wf))
  return total, (dh, dw.astype(w.dtype), tok)


def _chunked_loss_bwd(res, g):
  dh, dw, tok = res
  return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None, tok * g)


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)
