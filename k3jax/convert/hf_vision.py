"""HF ``vision_config`` <-> :class:`~k3jax.config.VisionConfig` (Kimi K2.5 / K3 releases).

Field names are the releases' (``vt_hidden_size``, ``init_pos_emb_height``, ``norm_type``, ...,
or the tower's own ``hidden_size`` etc.); fields a checkpoint leaves out take the reference
tower's defaults (K2.5's behaviour: LayerNorm, biases, bicubic). Released checkpoints attend
jointly over a video chunk's frames (``video_attn_type: spatial_temporal`` in their code), so
they load with ``video_attention: joint``; k3jax's divided attention is written as
``spatial_then_temporal``, a value the reference loaders refuse rather than misread.
"""

from __future__ import annotations

import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert.errors import ConversionError

# The released K3 checkpoint's vision_config (the public K3 loaders' KimiK3VisionConfig; text
# width 7168): about 0.45B parameters.
K3_VISION_CONFIG = {
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
    "vt_hidden_size": 1024, "vt_num_hidden_layers": 27, "vt_num_attention_heads": 12,
    "vt_intermediate_size": 4096, "qkv_hidden_size": 1536, "norm_type": "rmsnorm",
    "mlp_type": "mlp2", "patch_embed_proj_bias": False, "attn_bias": False, "linear_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
    "mm_projector_type": "patchmergerv2", "mm_hidden_size": 1024, "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5, "text_hidden_size": 7168, "media_placeholder_token_id": 163605,
}
_PROJECTORS = {"patchmerger": "patchmerger", "patchmergerv2": "patchmerger_v2"}
_VIDEO = {"spatial_temporal": "joint", "spatial_then_temporal": "divided"}
_FLOAT32_EPS = float(np.finfo(np.float32).eps)  # torch RMSNorm(eps=None) on float32


def _first(d: dict, *keys, default=None):
  for k in keys:
    if d.get(k) is not None:
      return d[k]
  return default


def vision_from_hf(v: dict, text_hidden: int, image_token_id: int | None) -> dict:
  """The ``model.vision`` mapping of a release's ``vision_config``; ConversionError naming each
  field k3jax cannot represent."""
  if not isinstance(v, dict):
    raise ConversionError(f"config.json: vision_config is a {type(v).__name__}, not an object")
  width = _first(v, "vt_hidden_size", "hidden_size")
  fixed = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mlp_type": "mlp2",
           "projector_hidden_act": "gelu", "text_hidden_size": text_hidden, "mm_hidden_size": width}
  problems = [f"{k}={v[k]!r} (k3jax implements {want!r})" for k, want in fixed.items()
              if v.get(k) is not None and v[k] != want]
  projector = v.get("mm_projector_type", "patchmerger")
  if projector not in _PROJECTORS:
    problems.append(f"mm_projector_type={projector!r} (one of {sorted(_PROJECTORS)})")
  video = v.get("video_attn_type", "spatial_temporal")
  if video not in _VIDEO:
    problems.append(f"video_attn_type={video!r} (one of {sorted(_VIDEO)})")
  if width is None:
    problems.append("vt_hidden_size is missing")
  if problems:
    raise ConversionError("config.json: vision_config: unsupported values: " + "; ".join(problems))
  norm = v.get("norm_type", "layernorm")
  out = dict(
      patch_size=v.get("patch_size", 14), hidden_size=width,
      num_layers=_first(v, "vt_num_hidden_layers", "num_hidden_layers"),
      num_heads=_first(v, "vt_num_attention_heads", "num_attention_heads"),
      qkv_size=v.get("qkv_hidden_size") or 0,
      intermediate_size=_first(v, "vt_intermediate_size", "intermediate_size"),
      merge_kernel=list(v.get("merge_kernel_size", [2, 2])),
      pos_emb_height=v.get("init_pos_emb_height", 64), pos_emb_width=v.get("init_pos_emb_width", 64),
      pos_emb_frames=v.get("init_pos_emb_time", 4),
      pos_emb_interpolation=v.get("pos_emb_interpolation_mode", "bicubic"),
      norm=norm, norm_eps=1e-5 if norm == "layernorm" else _FLOAT32_EPS,
      patch_bias=bool(v.get("patch_embed_proj_bias", True)), attn_bias=bool(v.get("attn_bias", True)),
      mlp_bias=bool(v.get("linear_bias", True)), video_attention=_VIDEO[video], temporal_pool=True,
      projector=_PROJECTORS[projector], projector_eps=float(v.get("projector_ln_eps", 1e-5)))
  token = _first(v, "media_placeholder_token_id", default=image_token_id)
  if token is not None:
    out["image_token_id"] = token
  return out


def vision_to_hf(cfg: ModelConfig) -> dict:
  """The release's ``vision_config`` for ``cfg.vision`` (inverse of :func:`vision_from_hf`)."""
  v = cfg.vision
  if not v.temporal_pool:
    raise ConversionError("model.vision.temporal_pool=false has no HF form (merge_type sd2_tpool)")
  return {
      "patch_size": v.patch_size, "init_pos_emb_height": v.pos_emb_height,
      "init_pos_emb_width": v.pos_emb_width, "init_pos_emb_time": v.pos_emb_frames,
      "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": v.pos_emb_interpolation,
      "vt_hidden_size": v.hidden_size, "vt_num_hidden_layers": v.num_layers,
      "vt_num_attention_heads": v.num_heads, "vt_intermediate_size": v.intermediate_size,
      "qkv_hidden_size": v.qkv_size or None, "norm_type": v.norm, "mlp_type": "mlp2",
      "patch_embed_proj_bias": v.patch_bias, "attn_bias": v.attn_bias, "linear_bias": v.mlp_bias,
      "merge_kernel_size": list(v.merge_kernel), "merge_type": "sd2_tpool",
      "video_attn_type": {"joint": "spatial_temporal", "divided": "spatial_then_temporal"}[
          v.video_attention],
      "mm_projector_type": {"patchmerger": "patchmerger", "patchmerger_v2": "patchmergerv2"}[
          v.projector],
      "mm_hidden_size": v.hidden_size, "projector_hidden_act": "gelu",
      "projector_ln_eps": v.projector_eps, "text_hidden_size": cfg.hidden_size,
      "media_placeholder_token_id": v.image_token_id,
  }
