"""XLA references for MLA attention (causal at a query offset, packed segments) and paged latent
decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(t: int, s: int, segment_ids=None, causal=True, *, kv_segment_ids=None,
                   q_offset=None) -> jax.Array:
  """``[B or 1, T, S]`` bool: query i may attend key j, i.e. (not causal or
  ``j <= q_offset + i``; q_offset an int or int32 scalar, default ``s - t``) and
  ``segment_ids[i] == kv_segment_ids[j]`` (``[B, T]`` / ``[B, S]``; kv_segment_ids defaults to
  segment_ids and needs it)."""
  if kv_segment_ids is not None and segment_ids is None:
    raise ValueError("attention_mask: kv_segment_ids needs segment_ids (the queries' ids)")
  i = jnp.arange(t)[:, None] + (s - t if q_offset is None else q_offset)
  j = jnp.arange(s)[None, :]
  mask = (j <= i) if causal else jnp.ones((t, s), bool)
  mask = mask[None]
  if segment_ids is not None:
    kv = segment_ids if kv_segment_ids is None else kv_segment_ids
    mask = mask & (segment_ids[:, :, None] == kv[:, None, :])
  return mask


def _scores(q, k, segment_ids, kv_segment_ids, q_offset, causal, scale):
  """The scaled scores ``[B, H, T, S]`` (float32 or wider) and ``attention_mask``'s mask
  ``[B or 1, 1, T, S]``."""
  acc = jnp.promote_types(q.dtype, jnp.float32)
  s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=acc) * scale
  return s, attention_mask(q.shape[1], k.shape[1], segment_ids, causal,
                           kv_segment_ids=kv_segment_ids, q_offset=q_offset)[:, None]


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, causal=True,
              scale, return_lse=False):
  """q ``[B,T,H,Dk]``, k ``[B,S,H,Dk]``, v ``[B,S,H,Dv]`` -> ``[B,T,H,Dv]`` (mask: see
  ``attention_mask``; rows that see no key give zeros); with ``return_lse`` also each row's
  log-sum-exp of its visible scaled scores ``[B,T,H]`` (``-inf`` where it sees no key)."""
  acc = jnp.promote_types(q.dtype, jnp.float32)
  s, mask = _scores(q, k, segment_ids, kv_segment_ids, q_offset, causal, scale)
  s = jnp.where(mask, s, -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  e = jnp.where(mask, jnp.exp(s - top), 0.0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  seen = total > 0
  p = e / jnp.where(seen, total, 1.0)  # rows with no visible key give zeros, not NaN
  o = jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v, preferred_element_type=acc)
  if not return_lse:
    return o.astype(q.dtype)
  lse = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)[..., 0]
  return o.astype(q.dtype), lse.transpose(0, 2, 1)


def attention_grad(q, k, v, o, lse, do, *, segment_ids=None, kv_segment_ids=None, q_offset=None,
                   causal=True, scale):
  """The gradients ``(dq, dk, dv)`` through attention over a part of the keys: k ``[B,S,H,Dk]``
  and v ``[B,S,H,Dv]`` are one block of a larger key set over which each query row's softmax is
  normalised, lse ``[B,T,H]`` (natural log, ``-inf`` where the row sees no key at all) is that
  normaliser and o ``[B,T,H,Dv]`` the output over all of it, do its cotangent. Summing dq over
  the blocks gives the whole attention's dq; dk and dv are exact for this block (the backward of
  ring and blockwise attention, whose blocks need no partial outputs of their own). Masks as
  ``attention``'s."""
  acc = jnp.promote_types(q.dtype, jnp.float32)
  s, mask = _scores(q, k, segment_ids, kv_segment_ids, q_offset, causal, scale)
  lse = lse.astype(acc).transpose(0, 2, 1)[..., None]  # [B, H, T, 1]
  p = jnp.where(mask & jnp.isfinite(lse), jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
  do = do.astype(acc)
  delta = jnp.einsum("bthd,bthd->bht", do, o.astype(acc))[..., None]
  ds = p * (jnp.einsum("bthd,bshd->bhts", do, v.astype(acc)) - delta)
  dq = jnp.einsum("bhts,bshd->bthd", ds, k.astype(acc)) * scale
  dk = jnp.einsum("bhts,bthd->bshd", ds, q.astype(acc)) * scale
  dv = jnp.einsum("bhts,bthd->bshd", p, do)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def merge_partials(o, lse, axis: int, *, base2: bool = False, return_lse: bool = False):
  """Attention over disjoint key sets merged into attention over all of them: o, partial outputs
  each normalised over its own keys, with the parts along ``axis``, and lse, their rows'
  log-sum-exps (o's shape less its last dim; natural log, or base 2 with ``base2``; ``-inf``
  where a part sees no key). Each part is weighted by ``exp(lse - logsumexp(lse))`` over the
  parts; rows that see no key at all give zeros. Computed in float32 (or wider), returned in o's
  dtype; with ``return_lse`` also the merged log-sum-exp (float32 or wider, ``-inf`` where no
  part sees a key). Differentiable in o and lse (the split-K decode's combine and the
  context-parallel MLA's online merge over key blocks)."""
  if o.shape[axis] == 1:
    merged = jnp.squeeze(o, axis)
    return (merged, jnp.squeeze(lse, axis)) if return_lse else merged
  top = jax.lax.stop_gradient(jnp.max(lse, axis=axis, keepdims=True))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = (jnp.exp2 if base2 else jnp.exp)(lse - top)
  total = jnp.sum(w, axis=axis, keepdims=True)
  acc = jnp.promote_types(o.dtype, jnp.float32)
  seen = total > 0
  merged = jnp.sum((w / jnp.where(seen, total, 1.0)).astype(acc)[..., None] * o.astype(acc),
                   axis=axis).astype(o.dtype)
  if not return_lse:
    return merged
  log = jnp.log2 if base2 else jnp.log
  lse = jnp.where(seen, top + log(jnp.where(seen, total, 1.0)), -jnp.inf)
  return merged, jnp.squeeze(lse, axis).astype(jnp.promote_types(lse.dtype, jnp.float32))


def paged_decode(q, cache, page_table, lengths, *, kv_lora_rank, scale):
  """q ``[N,Tn,H,R+Dr]``, cache ``[P,ps,R+Dr]`` -> ``[N,Tn,H,R]`` (see ``mla_decode``)."""
  n, tn = q.shape[:2]
  kv = cache[page_table].reshape(n, -1, cache.shape[-1])  # [N, L, R+Dr]
  # widened before the products: XLA's CPU runtime has no bf16 x bf16 -> f32 batched dot
  dtype, acc = q.dtype, jnp.promote_types(q.dtype, jnp.float32)
  q, kv = q.astype(acc), kv.astype(acc)
  s = jnp.einsum("nthd,nld->nhtl", q, kv) * scale
  pos = jnp.arange(kv.shape[1])[None, None, :]
  qpos = (lengths[:, None] - tn + jnp.arange(tn)[None, :])[:, :, None]  # [N, Tn, 1]
  mask = (pos <= qpos)[:, None]  # [N, 1, Tn, L]
  s = jnp.where(mask, s, -jnp.inf)
  p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
  o = jnp.einsum("nhtl,nld->nthd", p, kv[..., :kv_lora_rank])
  return o.astype(dtype)
