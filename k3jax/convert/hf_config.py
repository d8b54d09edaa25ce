"""HF ``config.json`` <-> :class:`~k3jax.config.ModelConfig`.

:func:`config_from_hf` reads ``kimi_linear`` and ``kimi_k3`` (whose language model sits in
``text_config``), with the released field names or the transformers-native ones;
:func:`config_to_hf` writes the released format.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from k3jax import config as config_lib
from k3jax import storage
from k3jax.config import ModelConfig
from k3jax.convert.errors import ConversionError
from k3jax.convert.hf_vision import vision_from_hf, vision_to_hf


ARCHS = ("kimi_linear", "kimi_k3")


def _text_config(hf: dict) -> dict:
  """The language-model part of an HF config (K3 keeps it under ``text_config``)."""
  t = hf.get("text_config") or hf
  if not isinstance(t, dict):
    raise ConversionError(f"config.json: text_config is a {type(t).__name__}, not an object")
  return t


# fields without a default (alternative names of one field together)
_REQUIRED = (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("intermediate_size",),
             ("num_attention_heads",), ("kv_lora_rank",), ("qk_nope_head_dim",),
             ("qk_rope_head_dim",), ("v_head_dim",), ("moe_intermediate_size",),
             ("num_experts", "num_local_experts", "n_routed_experts"),
             ("num_experts_per_token", "num_experts_per_tok"))
# real-valued fields: name -> (default, must be > 0)
_REALS = {"rms_norm_eps": (1e-5, True), "activation_situ_beta": (4.0, True),
          "activation_situ_linear_beta": (25.0, True), "routed_scaling_factor": (1.0, True)}


def _field_problems(t: dict, lin: dict) -> list[str]:
  """Missing required fields and real-valued fields that are not (positive) finite numbers."""
  problems = [f"{' / '.join(names)} is missing" for names in _REQUIRED
              if _first(t, *names) is None]
  reals = [(t, k, *v) for k, v in _REALS.items()] + [(lin, "gate_lower_bound", -5.0, False)]
  for d, key, default, positive in reals:
    v = _first(d, key, default=default)
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
        or (positive and v <= 0)):
      problems.append(f"{key}={v!r} is not a {'positive ' if positive else ''}finite number")
  return problems


def _arch(hf: dict) -> str:
  arch = hf.get("model_type")
  if arch not in ARCHS:
    raise ConversionError(f"config.json: model_type {arch!r} is not one of {ARCHS}")
  return arch


def _first(d: dict, *keys, default=None):
  for k in keys:
    if d.get(k) is not None:
      return d[k]
  return default


def config_from_hf(hf: dict, *, name: str = "hf", param_dtype: str | None = None) -> ModelConfig:
  """Maps an HF ``config.json`` (as a dict) to a validated :class:`ModelConfig`.

  Raises :class:`ConversionError` naming each field whose value k3jax cannot represent.
  """
  if not isinstance(hf, dict):
    raise ConversionError(f"config.json is a JSON {type(hf).__name__}, not an object")
  arch = _arch(hf)
  t = _text_config(hf)
  lin = t.get("linear_attn_config") or {}
  if not isinstance(lin, dict):
    raise ConversionError("config.json: linear_attn_config is not an object")
  problems = _field_problems(t, lin)
  if problems:
    raise ConversionError("config.json: " + "; ".join(problems))
  n = t["num_hidden_layers"]
  if not isinstance(n, int):
    raise ConversionError(f"config.json: num_hidden_layers={n!r} is not an integer")
  if "full_attn_layers" in lin:
    mla = tuple(sorted(i - 1 for i in lin["full_attn_layers"]))  # 1-based in the release
  elif t.get("layer_types"):
    mla = tuple(i for i, k in enumerate(t["layer_types"]) if k == "full_attention")
  else:  # transformers' default pattern
    mla = tuple(i for i in range(n) if i and i % 4 == 0)
  if t.get("mlp_layer_types"):
    dense = tuple(i for i, k in enumerate(t["mlp_layer_types"]) if k == "dense")
  else:
    dense = tuple(range(int(_first(t, "first_k_dense_replace", default=1))))
  if _first(t, "moe_layer_freq", default=1) != 1:
    problems.append(f"moe_layer_freq={t['moe_layer_freq']} (only 1 is supported)")
  if t.get("tie_word_embeddings"):
    problems.append("tie_word_embeddings=true (k3jax has an untied lm_head)")
  if t.get("mla_use_nope") is False:
    problems.append("mla_use_nope=false (k3jax implements NoPE MLA only)")
  heads = _first(t, "num_attention_heads")
  if _first(t, "num_key_value_heads", default=heads) != heads:
    problems.append(f"num_key_value_heads={t['num_key_value_heads']} != num_attention_heads={heads}")
  if _first(t, "moe_router_activation_func", "scoring_func", default="sigmoid") != "sigmoid":
    problems.append("moe_router_activation_func must be sigmoid")
  if _first(t, "num_expert_group", "n_group", default=1) != 1 or _first(t, "topk_group", default=1) != 1:
    problems.append("grouped routing (num_expert_group/topk_group > 1) is not supported")
  latent = _first(t, "routed_expert_hidden_size", "moe_latent_hidden_size", default=0)
  if latent and t.get("latent_moe_use_norm") is False:
    problems.append("latent_moe_use_norm=false (k3jax always normalises the latent)")
  act = t.get("hidden_act", "silu")
  if act not in ("silu", "situ"):
    problems.append(f"hidden_act={act!r} (silu or situ)")
  if problems:
    raise ConversionError("config.json: unsupported values: " + "; ".join(problems))

  kda_dim = _first(lin, "head_dim", default=_first(t, "linear_head_dim", default=128))
  eos = t.get("eos_token_id", 2)
  if isinstance(eos, list):
    eos = eos[0]
  dtype_name = param_dtype or {"float32": "float32", "bfloat16": "bfloat16"}.get(
      _first(hf, "torch_dtype", "dtype", default=_first(t, "torch_dtype", "dtype", default="bfloat16")),
      "bfloat16")
  model = dict(
      name=name, arch=arch,
      vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_layers=n,
      rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
      mla_layers=list(mla), dense_layers=list(dense),
      dense_intermediate=t["intermediate_size"],
      activation=act,
      situ_beta=float(_first(t, "activation_situ_beta", default=4.0)),
      situ_linear_beta=float(_first(t, "activation_situ_linear_beta", default=25.0)),
      max_position=int(_first(t, "model_max_length", "max_position_embeddings", default=1_048_576)),
      bos_token_id=_first(t, "bos_token_id", default=1),
      eos_token_id=eos,
      pad_token_id=_first(t, "pad_token_id", default=0),
      param_dtype=dtype_name, compute_dtype=dtype_name,
      kda=dict(
          num_heads=_first(lin, "num_heads", default=_first(t, "linear_num_heads", default=32)),
          head_dim=kda_dim, v_head_dim=kda_dim,
          conv_size=_first(lin, "short_conv_kernel_size", default=_first(t, "linear_conv_kernel_dim", default=4)),
          gate="bounded" if lin.get("gate_lower_bound") is not None else "softplus",
          gate_lower_bound=float(_first(lin, "gate_lower_bound", default=-5.0)),
          output_gate="full" if lin.get("use_full_rank_gate") else "low_rank",
          # HF ties a low-rank gate's rank to head_dim; a full gate has none (the default stays)
          **({} if lin.get("use_full_rank_gate") else {"output_gate_rank": kda_dim})),
      mla=dict(
          num_heads=heads, q_lora_rank=t.get("q_lora_rank") or 0,
          kv_lora_rank=t["kv_lora_rank"], qk_nope_head_dim=t["qk_nope_head_dim"],
          qk_rope_head_dim=t["qk_rope_head_dim"], v_head_dim=t["v_head_dim"],
          output_gate=bool(t.get("mla_use_output_gate", False))),
      moe=dict(
          num_experts=_first(t, "num_experts", "num_local_experts", "n_routed_experts"),
          top_k=_first(t, "num_experts_per_token", "num_experts_per_tok"),
          num_shared_experts=_first(t, "num_shared_experts", "n_shared_experts", default=0),
          expert_intermediate=t["moe_intermediate_size"],
          latent_dim=latent or 0,
          routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
          renormalize=bool(_first(t, "moe_renormalize", "norm_topk_prob", default=True))),
      attn_res=dict(enabled=t.get("attn_res_block_size") is not None,
                    block_size=t.get("attn_res_block_size") or 12),
  )
  if arch == "kimi_k3" and hf.get("vision_config") is not None:
    model["vision"] = vision_from_hf(hf["vision_config"], t["hidden_size"],
                                     hf.get("media_placeholder_token_id"))
  try:
    return config_lib.from_dict({"model": model}).model
  except config_lib.ConfigError as e:
    raise ConversionError(f"config.json maps to an invalid k3jax config: {e}") from e


def config_to_hf(cfg: ModelConfig) -> dict:
  """An HF ``config.json`` in the released format for ``cfg`` (inverse of :func:`config_from_hf`)."""
  k, a, m = cfg.kda, cfg.mla, cfg.moe
  fixed = {"kda.v_head_dim": k.v_head_dim, "kda.value_heads / num_heads": k.value_heads // k.num_heads * k.head_dim,
           "kda.f_rank": k.f_rank}
  if k.output_gate == "low_rank":
    fixed["kda.output_gate_rank"] = k.output_gate_rank
  odd = [f"{n}={v}" for n, v in fixed.items() if v != k.head_dim]
  if odd:
    raise ConversionError(f"HF configs tie these KDA sizes to head_dim={k.head_dim}: " + ", ".join(odd))
  lin = {
      "num_heads": k.num_heads, "head_dim": k.head_dim, "short_conv_kernel_size": k.conv_size,
      "kda_layers": [i + 1 for i in range(cfg.num_layers) if cfg.layer_kind(i) == "kda"],
      "full_attn_layers": [i + 1 for i in cfg.mla_layers],
  }
  if k.gate == "bounded":
    lin["gate_lower_bound"] = k.gate_lower_bound
  if k.output_gate == "full":
    lin["use_full_rank_gate"] = True
  dense = sorted(cfg.dense_layers)
  if dense != list(range(len(dense))):
    raise ConversionError(f"dense_layers={cfg.dense_layers}: HF configs only express a dense prefix "
                          "(first_k_dense_replace)")
  dtype = {"float32": "float32", "bfloat16": "bfloat16", "float64": "float32"}[cfg.param_dtype]
  t = {
      "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers, "rms_norm_eps": cfg.rms_norm_eps,
      "intermediate_size": cfg.dense_intermediate, "first_k_dense_replace": len(dense),
      "hidden_act": cfg.activation, "model_max_length": cfg.max_position,
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
      "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": False, "torch_dtype": dtype,
      "linear_attn_config": lin,
      "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_heads,
      "q_lora_rank": a.q_lora_rank or None, "kv_lora_rank": a.kv_lora_rank,
      "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
      "v_head_dim": a.v_head_dim, "mla_use_nope": True,
      "num_experts": m.num_experts, "num_experts_per_token": m.top_k,
      "num_shared_experts": m.num_shared_experts, "moe_intermediate_size": m.expert_intermediate,
      "routed_scaling_factor": m.routed_scaling_factor, "moe_renormalize": m.renormalize,
      "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
      "moe_layer_freq": 1,
  }
  if cfg.activation == "situ":
    t.update(activation_situ_beta=cfg.situ_beta, activation_situ_linear_beta=cfg.situ_linear_beta)
  if a.output_gate:
    t["mla_use_output_gate"] = True
  if m.latent_dim:
    t.update(routed_expert_hidden_size=m.latent_dim, latent_moe_use_norm=True)
  if cfg.attn_res.enabled:
    t["attn_res_block_size"] = cfg.attn_res.block_size
  if cfg.arch == "kimi_linear":
    if cfg.vision is not None:
      raise ConversionError("a vision tower needs arch kimi_k3 (kimi_linear HF configs have none)")
    return t
  out = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
         "torch_dtype": dtype, "text_config": t}
  if cfg.vision is not None:
    out.update(vision_config=vision_to_hf(cfg), media_placeholder_token_id=cfg.vision.image_token_id)
  return out


def read_hf_config(src: Path) -> dict:
  """The ``config.json`` of the HF directory ``src`` as a dict."""
  path = storage.path(src) / "config.json"
  if not path.is_file():
    raise ConversionError(f"{src}: config.json not found")
  try:
    hf = json.loads(path.read_text())
  except (ValueError, RecursionError) as e:
    raise ConversionError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(hf, dict):
    raise ConversionError(f"{path}: a JSON {type(hf).__name__}, not an object")
  return hf


def checkpoint_floats(hf: dict) -> tuple[str, ...]:
  """The safetensors dtypes a floating tensor of the checkpoint may have: its ``torch_dtype``
  (bfloat16 when absent) and F32 (the kept-float32 gates, biases and convolutions)."""
  name = _first(hf, "torch_dtype", "dtype", default=_first(_text_config(hf), "torch_dtype", "dtype"))
  kind = {"float32": "F32", "float16": "F16"}.get(name, "BF16")
  return tuple(dict.fromkeys((kind, "F32")))
