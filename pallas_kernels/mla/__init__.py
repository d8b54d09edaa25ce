"""MLA attention ops: ``mla_attention`` (training/prefill), ``mla_attention_grad`` (its backward
over one block of a larger key set: blockwise and ring attention) and ``mla_decode`` (paged
latent cache).

``implementation``: ``"xla"`` (reference), ``"pallas_gpu"``, ``"pallas_tpu"``, ``"pallas"`` (the
current platform's), ``"cudnn"`` (GPU, values padded to the query dim; prefill only),
``"cudnn_fwd"`` (GPU: cuDNN with padded values for an undifferentiated call with T == S, no
segment ids and no ``q_offset``, else the Pallas kernels, always under differentiation; decode:
Pallas) or ``None`` (the best available: ``"cudnn_fwd"`` on GPU, Pallas on TPU, XLA on CPU).
``"cudnn"`` takes separate key segment ids and a query offset through a dense ``[B, 1, T, S]``
mask (correct but slow for long keys: prefer Pallas there).

Why ``"cudnn_fwd"`` on GPU (H200, bf16, ``benchmarks/RESULTS.md``): at B1 T16384 H32 and B2 T8192
H96 causal, cuDNN's forward is 1.15-1.21x faster than the Pallas forward, but the Pallas
forward+backward is 1.10-1.14x faster than cuDNN's; with packed documents cuDNN needs a dense mask
(3.6-3.9x slower than its causal case) while Pallas skips blocks (1.6-2.8x faster than causal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import resolve_implementation
from pallas_kernels.mla import reference

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu", "pallas", "cudnn", "cudnn_fwd")


def resolve(implementation: str | None) -> str:
  """The concrete implementation name for ``implementation`` on the current backend."""
  return resolve_implementation("mla", implementation, IMPLEMENTATIONS,
                                {"gpu": "cudnn_fwd", "tpu": "pallas", "cpu": "xla"})


def mla_attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, causal=True,
                  scale=None, implementation=None, return_lse=False):
  """Softmax attention with MLA's shapes (query/key dim != value dim).

  q: ``[B, T, H, Dk]``; k: ``[B, S, H, Dk]``; v: ``[B, S, H, Dv]``; segment_ids: ``[B, T]`` (the
  queries') or None; kv_segment_ids: ``[B, S]`` (the keys'; default segment_ids, then T == S).
  q_offset: int or int32 scalar (may be traced), the key position of query row 0 (default
  ``S - T``: the last query with the last key); causal lets query i see keys ``j <= q_offset + i``.
  Returns ``[B, T, H, Dv]`` in q's dtype (float32 accumulation); with ``return_lse`` also each
  row's log-sum-exp of its visible scaled scores ``[B, T, H]`` float32 (``-inf`` where it sees no
  key), differentiable (the XLA and Pallas implementations; ``"cudnn_fwd"`` then runs Pallas).
  """
  impl = resolve(implementation)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  masks = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset)
  if impl == "xla":
    return reference.attention(q, k, v, **masks, causal=causal, scale=scale,
                               return_lse=return_lse)
  if impl == "cudnn":
    if return_lse:
      raise ValueError("mla_attention: return_lse needs the XLA or a Pallas implementation "
                       "(cuDNN's log-sum-exp is not exposed)")
    return padded_dot_product_attention(q, k, v, **masks, causal=causal, scale=scale)
  if (impl == "cudnn_fwd" and not return_lse and segment_ids is None and q_offset is None
      and q.shape[1] == k.shape[1]):
    return fast_forward_pallas_grad(q, k, v, bool(causal), float(scale), "cudnn")
  from pallas_kernels.mla import prefill
  return prefill.mla_attention(q, k, v, **masks, causal=causal, scale=scale,
                               backend=_pallas_backend(impl), return_lse=return_lse)


def mla_attention_grad(q, k, v, o, lse, do, *, segment_ids=None, kv_segment_ids=None,
                       q_offset=None, causal=True, scale=None, implementation=None):
  """The backward of attention over one block of a larger key set, without its forward: each
  query row's softmax is normalised by lse ``[B, T, H]`` (natural log over the whole set,
  ``-inf`` where the row sees no key) and o ``[B, T, H, Dv]`` is the output over the whole set,
  do its cotangent. Returns ``(dq, dk, dv)``: this block's share of dq (summed over the blocks,
  the whole dq) and the block's exact dk and dv. Masks and shapes as :func:`mla_attention`'s;
  ``"cudnn"`` has no such entry point (``"cudnn_fwd"`` runs the Pallas kernels)."""
  impl = resolve(implementation)
  want = q.shape[:3] + v.shape[-1:]
  if q.ndim != 4 or v.ndim != 4 or o.shape != want or do.shape != want or lse.shape != want[:3]:
    raise ValueError(f"mla_attention_grad: expected o and do [B, T, H, Dv] = {want} and lse "
                     f"[B, T, H] for q {q.shape}, v {v.shape}; got {o.shape}, {do.shape}, "
                     f"{lse.shape}")
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  masks = dict(segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
               causal=causal, scale=scale)
  if impl == "xla":
    return reference.attention_grad(q, k, v, o, lse, do, **masks)
  if impl == "cudnn":
    raise ValueError("mla_attention_grad: needs the XLA or a Pallas implementation (cuDNN's "
                     "backward takes no outside log-sum-exp)")
  from pallas_kernels.mla import prefill
  return prefill.mla_attention_grad(q, k, v, o, lse, do, **masks, backend=_pallas_backend(impl))


def _pallas_backend(impl: str) -> str:
  return "gpu" if impl == "cudnn_fwd" else impl.removeprefix("pallas_")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fast_forward_pallas_grad(q, k, v, causal, scale, fast):
  """Attention computed by ``padded_dot_product_attention(implementation=fast)`` when not
  differentiated; under differentiation the Pallas GPU forward (which saves the log-sum-exp) and
  backward run instead."""
  return padded_dot_product_attention(q, k, v, causal=causal, scale=scale, implementation=fast)


def _ffpg_fwd(q, k, v, causal, scale, fast):
  from pallas_kernels.mla import prefill
  del fast
  return jax.vjp(functools.partial(prefill.mla_attention, causal=causal, scale=scale,
                                   backend="gpu"), q, k, v)


def _ffpg_bwd(causal, scale, fast, vjp, do):
  del causal, scale, fast
  return vjp(do)


fast_forward_pallas_grad.defvjp(_ffpg_fwd, _ffpg_bwd)


def padded_dot_product_attention(q, k, v, *, segment_ids=None, kv_segment_ids=None,
                                 q_offset=None, causal=True, scale, implementation="cudnn"):
  """``jax.nn.dot_product_attention`` with v zero-padded to q's head dim (it needs Dv == Dk),
  sliced back to ``[B, T, H, Dv]``. Segments, a query offset and causal with T != S go in as a
  dense mask (``reference.attention_mask``)."""
  dk, dv = q.shape[-1], v.shape[-1]
  if dv > dk:
    raise ValueError(f"mla_attention(cudnn): value dim {dv} exceeds query dim {dk}")
  vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dk - dv))) if dv < dk else v
  t, s = q.shape[1], k.shape[1]
  mask = None
  if segment_ids is not None or (causal and (t != s or q_offset is not None)):
    mask = reference.attention_mask(t, s, segment_ids, causal, kv_segment_ids=kv_segment_ids,
                                    q_offset=q_offset)[:, None]
  o = jax.nn.dot_product_attention(q, k, vp, mask=mask, scale=scale,
                                   is_causal=bool(causal) and t == s and q_offset is None,
                                   implementation=implementation)[..., :dv]
  if mask is not None:  # rows with no visible key give zeros (as the reference)
    o = jnp.where(mask.any(-1).swapaxes(1, 2)[..., None], o, 0)
  return o


def mla_decode(q, cache, page_table, lengths, *, kv_lora_rank, scale, implementation=None,
               config=None):
  """Absorbed-query attention over a paged latent cache.

  q: ``[N, Tn, H, R + Dr]`` absorbed queries (R = kv_lora_rank latent part, Dr shared key part);
  cache: ``[P, page_size, R + Dr]`` pages of ``[c, k_r]``; page_table: ``[N, max_pages]`` int32;
  lengths: ``[N]`` int32 cached tokens per request *including* the Tn new ones, which sit at
  positions ``lengths - Tn .. lengths - 1`` and attend causally. Returns ``[N, Tn, H, R]``
  (the attention-weighted latent values; float32 accumulation, q's dtype). ``config``: how the
  Pallas kernels run (:class:`pallas_kernels.mla.decode.DecodeConfig`; None its defaults).
  """
  impl = resolve(implementation)
  if impl in ("xla", "cudnn"):
    return reference.paged_decode(q, cache, page_table, lengths, kv_lora_rank=kv_lora_rank,
                                  scale=scale)
  from pallas_kernels.mla import decode
  return decode.mla_decode(q, cache, page_table, lengths, kv_lora_rank=kv_lora_rank, scale=scale,
                           backend=_pallas_backend(impl), config=config or decode.DecodeConfig())


__all__ = ["mla_attention", "mla_attention_grad", "mla_decode", "padded_dot_product_attention",
           "fast_forward_pallas_grad", "resolve", "IMPLEMENTATIONS"]
