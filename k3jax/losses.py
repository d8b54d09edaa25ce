"""Memory-lean, fused next-token cross-entropy over the output head.

The logits of all tokens x vocab (163840 for K3) are never materialised at once: the tokens are
processed in chunks inside a ``lax.scan``. Under differentiation the forward scan also forms each
chunk's logit gradient ``softmax - onehot`` (cast to the compute dtype) and from it the gradients
of the hidden states and of the head, so the backward pass only scales them: three matmuls per
chunk (logits, ``dh``, ``dW``) instead of four (with a recomputed forward), all with
compute-dtype operands and float32 accumulation. Without differentiation (eval) only the losses
are computed.

``logits_dtype`` is the type the logits are stored in between the head's matmul and the softmax
(float32 by default). ``bfloat16`` halves the traffic of the largest tensors of a training step
(``[chunk, V]`` written by the matmul, read by the log-sum-exp and by the logit gradient) at the
price of rounding each logit to 8 bits of mantissa before the softmax, as Megatron-LM's and
MaxText's bf16 heads do; the loss and its gradient are then exact for the rounded logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.logsumexp import logsumexp
from sharding.mesh import spec_axes
from sharding.rules import logical_spec, per_device


def cross_entropy(h: jax.Array, w_head: jax.Array, targets: jax.Array, weights: jax.Array, *,
                  chunk_size: int = 1024, logits_dtype=None) -> tuple[jax.Array, jax.Array]:
  """h ``[B, T, d]``, w_head ``[d, V]``, targets ``[B, T]`` int, weights ``[B, T]``;
  ``logits_dtype`` None: float32 (float64 for float64 inputs).

  Returns (sum of weighted token losses, sum of weights), both float32 (or float64 in x64
  parameter dtype). The head is used in h's dtype; its gradient comes back in w_head's dtype.

  Under a mesh that splits the tokens (and not the vocabulary) each device runs the chunked loss
  on its own tokens, ``chunk_size`` of them at a time, with the whole head: the head's gradient
  is summed over the chunks on each device and reduced over the devices once. Left to the SPMD
  partitioner, the scan over chunks would reduce the ``[d, V]`` float32 gradient over all
  devices at every chunk, with each chunk's tokens on few devices.
  """
  tok = logical_spec(("batch", "length"))
  if logical_spec(("vocab",))[0] is not None or (tok[0] is None and tok[1] is None):
    return _local_cross_entropy(h, w_head, targets, weights, chunk_size, logits_dtype)

  def local(h, w, t, wt):  # per-device sums as [1] pieces of a [devices] vector: no psum inside
    total, count = _local_cross_entropy(h, w, t, wt, chunk_size, logits_dtype)
    return total[None], count[None]

  axes = spec_axes(tok)
  parts = per_device(local, (("batch", "length", None), None, tok, tok), (P(axes), P(axes)))
  total, count = parts(h, w_head, targets, weights)
  return jnp.sum(total), jnp.sum(count)


def _local_cross_entropy(h, w_head, targets, weights, chunk_size, logits_dtype):
  """:func:`cross_entropy` on one device."""
  acc = jnp.promote_types(h.dtype, jnp.float32)
  d = h.shape[-1]
  n = h.shape[0] * h.shape[1]
  chunk = min(chunk_size, n)
  pad = (-n) % chunk
  hf = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0))).reshape(-1, chunk, d)
  tf = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)
  wf = jnp.pad(weights.reshape(n).astype(acc), (0, pad)).reshape(-1, chunk)
  stored = jnp.dtype(acc if logits_dtype is None else logits_dtype)
  total = _chunked_loss(hf, w_head, tf, wf, stored)
  return total, jnp.sum(wf)


def _chunk_logits(hc, wh, stored):
  """One chunk's logits ``[c, V]`` in ``stored`` (accumulated in float32 at least); ``wh`` is
  the head already in hc's dtype (cast once, outside the loop over chunks)."""
  return jnp.dot(hc, wh, preferred_element_type=stored)


def _token_losses(logits, tc):
  """(log-sum-exp ``[c]``, token losses ``lse - logits[target]`` ``[c]``), float32 at least."""
  lse = logsumexp(logits)
  return lse, lse - jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0].astype(lse.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked_loss(hf, w, tf, wf, stored):
  """hf ``[C, c, d]``, w ``[d, V]``, tf ``[C, c]`` int, wf ``[C, c]`` -> sum of weighted losses;
  ``stored``: the logits' dtype."""
  wh = w.astype(hf.dtype)

  def body(total, xs):
    hc, tc, wc = xs
    return total + jnp.sum(_token_losses(_chunk_logits(hc, wh, stored), tc)[1] * wc), None

  total, _ = jax.lax.scan(body, jnp.zeros((), wf.dtype), (hf, tf, wf))
  return total


def _chunked_loss_fwd(hf, w, tf, wf, stored):
  acc = wf.dtype
  wh = w.astype(hf.dtype)

  def body(carry, xs):
    total, dw = carry
    hc, tc, wc = xs
    logits = _chunk_logits(hc, wh, stored)
    lse, tok = _token_losses(logits, tc)
    p = jnp.exp(logits.astype(acc) - lse[:, None]) * wc[:, None]
    hit = jnp.arange(logits.shape[-1], dtype=tc.dtype)[None, :] == tc[:, None]
    dl = jnp.where(hit, p - wc[:, None], p).astype(hf.dtype)  # d loss / d logits, [c, V]
    dh = jnp.dot(dl, wh.T, preferred_element_type=acc).astype(hf.dtype)
    dw = dw + jnp.dot(hc.T, dl, preferred_element_type=acc)
    return (total + jnp.sum(tok * wc), dw), (dh, tok)

  init = (jnp.zeros((), acc), jnp.zeros(w.shape, acc))
  (total, dw), (dh, tok) = jax.lax.scan(body, init, (hf, tf, wf))
  return total, (dh, dw.astype(w.dtype), tok)


def _chunked_loss_bwd(stored, res, g):
  del stored
  dh, dw, tok = res
  return (dh * g.astype(dh.dtype), dw * g.astype(dw.dtype), None, tok * g)


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)
