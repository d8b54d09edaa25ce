"""MLA attention ops: ``mla_attention`` (training/prefill) and ``mla_decode`` (paged latent cache).

``implementation``: ``"xla"`` (reference), ``"pallas_gpu"``, ``"pallas_tpu"``, ``"pallas"`` (the
current platform's), ``"cudnn"`` (GPU, values padded to the query dim; prefill only) or ``None``
(the best available: Pallas on GPU/TPU, XLA on CPU).
"""

from __future__ import annotations

from pallas_kernels import default_backend
from pallas_kernels.mla import reference

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu", "pallas", "cudnn")


def resolve(implementation: str | None) -> str:
  backend = default_backend()
  if implementation is None:
    implementation = "pallas" if backend in ("gpu", "tpu") else "xla"
  if implementation == "pallas":
    implementation = "pallas_tpu" if backend == "tpu" else "pallas_gpu"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"mla: unknown implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
  return implementation


def mla_attention(q, k, v, *, segment_ids=None, causal=True, scale=None, implementation=None):
  """Softmax attention with MLA's shapes (query/key dim != value dim).

  q: ``[B, T, H, Dk]``; k: ``[B, S, H, Dk]``; v: ``[B, S, H, Dv]``; segment_ids: ``[B, T]``
  (T == S) or None. Causal masking aligns the last query with the last key. Returns
  ``[B, T, H, Dv]`` in q's dtype (float32 accumulation).
  """
  impl = resolve(implementation)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if impl == "xla":
    return reference.attention(q, k, v, segment_ids=segment_ids, causal=causal, scale=scale)
  from pallas_kernels.mla import prefill
  return prefill.mla_attention(q, k, v, segment_ids=segment_ids, causal=causal, scale=scale,
                               backend=impl.removeprefix("pallas_"))


def mla_decode(q, cache, page_table, lengths, *, kv_lora_rank, scale, implementation=None):
  """Absorbed-query attention over a paged latent cache.

  q: ``[N, Tn, H, R + Dr]`` absorbed queries (R = kv_lora_rank latent part, Dr shared key part);
  cache: ``[P, page_size, R + Dr]`` pages of ``[c, k_r]``; page_table: ``[N, max_pages]`` int32;
  lengths: ``[N]`` int32 cached tokens per request *including* the Tn new ones, which sit at
  positions ``lengths - Tn .. lengths - 1`` and attend causally. Returns ``[N, Tn, H, R]``
  (the attention-weighted latent values; float32 accumulation, q's dtype).
  """
  impl = resolve(implementation)
  if impl in ("xla", "cudnn"):
    return reference.paged_decode(q, cache, page_table, lengths, kv_lora_rank=kv_lora_rank,
                                  scale=scale)
  from pallas_kernels.mla import decode
  return decode.mla_decode(q, cache, page_table, lengths, kv_lora_rank=kv_lora_rank, scale=scale,
                           backend=impl.removeprefix("pallas_"))


__all__ = ["mla_attention", "mla_decode", "resolve", "IMPLEMENTATIONS"]
