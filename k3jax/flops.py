"""Model FLOPs per token, counted from the ``ModelConfig``, for model FLOPs utilisation (MFU).

Counted (forward, 2 FLOPs per multiply-add): every matmul a token goes through (projections,
the top-k routed experts plus shared experts, the dense MLP, the router, the LM head), the short
convolutions, the KDA chunked-recurrence work and causal MLA attention over the keys a token
really sees: its own document's earlier tokens (``mean_causal_context`` of the batch's segment
ids; ``(seq_len + 1) / 2`` for rows of one document).
The vision tower (:func:`vision_forward_flops`, per batch: its cost depends on the images, not
on the text tokens): the patch embedding, each block's projections and MLP, bidirectional
attention over the keys each patch sees (its image or video chunk; with divided video attention
its frame, then the chunk's frames at its position) and the projector per visual token.
Not counted: embedding lookup, norms, activations, Block AttnRes mixing, softmax, the optimizer,
the tower's positional-grid interpolation.
A training step counts 3x the forward (forward plus a backward of twice its cost); the recompute
of rematerialisation is not counted (model FLOPs, not hardware FLOPs).

KDA per token and head with chunk size C, key dim K and value dim V:
``C*K`` (strictly lower ``A_kk``) + ``C*K`` (causal ``Q K^T`` inside the chunk) + ``C*(K+V)``
(triangular solve giving ``W`` and ``U``) + ``C*V`` (intra-chunk output) + ``6*K*V`` (``W S``,
``Q S`` and the state update).
"""

from __future__ import annotations

import jax
import numpy as np

from k3jax.config import ModelConfig

# Dense bf16 peak FLOP/s by device kind (nominal datasheet figures, no sparsity).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def _kda_layer(m: ModelConfig) -> dict[str, float]:
  k = m.kda
  d, h, hv, kd, vd = m.hidden_size, k.num_heads, k.value_heads, k.head_dim, k.v_head_dim
  proj = d * h * kd * 2 + d * hv * vd  # q, k, v
  proj += d * k.f_rank + k.f_rank * hv * kd  # forget gate
  proj += d * hv  # beta
  proj += d * hv * vd if k.output_gate == "full" else d * k.output_gate_rank + k.output_gate_rank * hv * vd
  proj += hv * vd * d  # o_proj
  conv = k.conv_size * (h * kd * 2 + hv * vd)
  c = k.chunk_size
  chunk = hv * (c * kd + c * kd + c * (kd + vd) + c * vd + 6 * kd * vd)  # FLOPs, see above
  return {"matmul": 2.0 * proj, "conv": 2.0 * conv, "kda_chunk": float(chunk)}


def mean_causal_context(segment_ids) -> float:
  """Mean number of keys a token attends to (itself and its document's earlier tokens) in packed
  rows ``segment_ids [B, T]`` (documents are runs of one id > 0; padding, id 0, not counted)."""
  seg = np.asarray(segment_ids)
  keys = tokens = 0
  for row in seg.reshape(-1, seg.shape[-1]):
    starts = np.r_[0, np.flatnonzero(np.diff(row)) + 1]
    lengths = np.diff(np.r_[starts, row.size])[row[starts] > 0].astype(np.int64)
    keys += int(np.sum(lengths * (lengths + 1) // 2))
    tokens += int(np.sum(lengths))
  return keys / max(tokens, 1)


def _mla_layer(m: ModelConfig, seq_len: int, context: float | None) -> dict[str, float]:
  a = m.mla
  d, h, qk, v = m.hidden_size, a.num_heads, a.qk_head_dim, a.v_head_dim
  q = d * a.q_lora_rank + a.q_lora_rank * h * qk if a.q_lora_rank else d * h * qk
  kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (a.qk_nope_head_dim + v)
  out = h * v * d + (d * h * v if a.output_gate else 0)
  if context is None:
    context = (seq_len + 1) / 2  # mean number of keys a query sees under a causal mask
  return {"matmul": 2.0 * (q + kv + out), "attention": 2.0 * h * (qk + v) * context}


def _mlp_layer(m: ModelConfig, i: int) -> dict[str, float]:
  d = m.hidden_size
  if not m.is_moe(i):
    return {"matmul": 2.0 * 3 * d * m.dense_intermediate}
  e = m.moe
  width = e.latent_dim or d
  routed = e.top_k * 3 * width * e.expert_intermediate
  latent = 2 * d * e.latent_dim if e.latent_dim else 0
  shared = 3 * d * e.num_shared_experts * e.expert_intermediate
  return {"matmul": 2.0 * (d * e.num_experts + shared + latent), "moe_experts": 2.0 * routed}


def forward_flops_per_token(m: ModelConfig, seq_len: int, context: float | None = None
                            ) -> dict[str, float]:
  """Forward FLOPs per token by kind (``matmul``, ``moe_experts``, ``kda_chunk``, ``attention``,
  ``conv``, ``lm_head``) and their ``total``, for rows of ``seq_len`` tokens whose queries see
  ``context`` keys on average (default: one causal document per row)."""
  out: dict[str, float] = {"lm_head": 2.0 * m.hidden_size * m.vocab_size}
  for i in range(m.num_layers):
    parts = _mla_layer(m, seq_len, context) if m.layer_kind(i) == "mla" else _kda_layer(m)
    for name, parts_i in (("mixer", parts), ("mlp", _mlp_layer(m, i))):
      for k, v in parts_i.items():
        out[k] = out.get(k, 0.0) + v
  out["total"] = sum(out.values())
  return out


def train_flops_per_token(m: ModelConfig, seq_len: int, context: float | None = None) -> float:
  """Model FLOPs of one training token: 3x the forward."""
  return 3.0 * forward_flops_per_token(m, seq_len, context)["total"]


def vision_forward_flops(m: ModelConfig, arrays: dict) -> float:
  """Forward FLOPs of the vision tower and projector on :func:`k3jax.vision.batch`'s arrays (0
  without a tower); a training step counts 3x."""
  v = m.vision
  if v is None:
    return 0.0
  d, a = v.hidden_size, v.attn_size
  per_patch = v.channels * v.patch_size ** 2 * d + v.num_layers * (4 * d * a + 2 * d * v.intermediate_size)
  keys = 0.0
  seg, frames = np.asarray(arrays["segment_ids"]), np.asarray(arrays["frame_ids"])
  for row_seg, row_frame in zip(seg.reshape(-1, seg.shape[-1]), frames.reshape(-1, seg.shape[-1])):
    for s in np.unique(row_seg[row_seg > 0]):
      n = int(np.sum(row_seg == s))
      f = len(np.unique(row_frame[row_seg == s]))
      keys += n * (n if v.video_attention == "joint" or f == 1 else n // f + f)
  patches = int(np.sum(seg > 0))
  width = d * v.merge
  tokens = int(np.sum(np.asarray(arrays["num_tokens"])))
  attention = 2.0 * v.num_layers * 2 * a * keys  # q k^T and p v over every visible key
  return 2.0 * patches * per_patch + attention + 2.0 * tokens * (width * width + width * m.hidden_size)


def device_peak_flops(override_tflops: float = 0.0) -> tuple[float | None, str]:
  """(peak FLOP/s of all local devices, description); (None, reason) when unknown (CPU)."""
  devices = jax.local_devices()
  if override_tflops > 0:
    return override_tflops * 1e12 * len(devices), f"{override_tflops} TFLOP/s per device (train.peak_tflops)"
  kind = devices[0].device_kind
  for name, peak in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
    if name.lower() in kind.lower():
      return peak * len(devices), f"{kind}: {peak / 1e12:.0f} TFLOP/s dense bf16 per device (nominal)"
  return None, f"no peak FLOP/s known for {kind!r}: mfu is null (set train.peak_tflops)"
