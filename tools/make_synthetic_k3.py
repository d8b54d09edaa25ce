"""Writes a synthetic 2-layer Kimi K3 checkpoint at full width, for measuring the converter.

    .venv/bin/python tools/make_synthetic_k3.py --out /tmp/k3_synth [--experts 896] [--vision]

Layer 0: KDA + dense MLP (33792); layer 1: gated MLA + LatentMoE with ``--experts`` routed
experts stored MXFP4 (compressed-tensors packing), 2 shared experts, latent 3584. Names carry the
release's ``language_model.`` prefix; shards of at most 5 GB plus ``model.safetensors.index.json``.
Values are random (bf16 normal * 0.02; MXFP4 codes uniform, E8M0 scales in [118, 126]); the
point is the sizes: 896 experts make ~15.8 GB of MXFP4 experts that dequantize to ~59 GB of
bfloat16, and the largest tensors are the [163840, 7168] bf16 embedding and head (2.35 GB).
Needs about one largest tensor of RAM. ``--vision`` adds the release's MoonViT-V2 tower and
projector (``vision_tower.*``, ``mm_projector.*`` and ``vision_config`` as in the public K3
loaders' ``KimiK3VisionConfig``: 27 blocks of width 1024, 12 heads of 128, MLP 4096, RMSNorm, no
biases, ``patchmergerv2``; about 0.44B parameters, 0.9 GB).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from k3jax.convert import MXFP4_GROUP, SafetensorsWriter
from k3jax.convert.hf_vision import K3_VISION_CONFIG as VISION

D, V, DENSE, F, LATENT, SHARED = 7168, 163840, 33792, 3072, 3584, 2
KDA_H, KDA_D, CONV = 96, 128, 4
MLA_H, Q_LORA, KV_LORA, NOPE, ROPE, VD = 96, 1536, 512, 128, 64, 128


def config(experts: int, vision: bool = False) -> dict:
  text = {
      "model_type": "kimi_linear", "vocab_size": V, "hidden_size": D, "num_hidden_layers": 2,
      "intermediate_size": DENSE, "moe_intermediate_size": F, "first_k_dense_replace": 1,
      "num_attention_heads": MLA_H, "num_key_value_heads": MLA_H, "q_lora_rank": Q_LORA,
      "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": VD,
      "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": experts,
      "num_experts_per_token": min(16, experts - 1), "num_shared_experts": SHARED, "num_expert_group": 1,
      "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
      "routed_scaling_factor": 1.0, "routed_expert_hidden_size": LATENT,
      "latent_moe_use_norm": True, "hidden_act": "situ", "activation_situ_beta": 4.0,
      "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5, "attn_res_block_size": 12,
      "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
      "tie_word_embeddings": False,
      "linear_attn_config": {"num_heads": KDA_H, "head_dim": KDA_D, "short_conv_kernel_size": CONV,
                             "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                             "kda_layers": [1], "full_attn_layers": [2]},
  }
  out = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
         "torch_dtype": "bfloat16", "text_config": text,
         "quantization_config": {"quant_method": "compressed-tensors",
                                 "format": "mxfp4-pack-quantized"}}
  if vision:
    out.update(vision_config=VISION, media_placeholder_token_id=163605)
  return out


def vision_tensors() -> list[tuple[str, str, tuple[int, ...]]]:
  """(name, dtype, shape) of the released vision tower and projector."""
  v = VISION
  w, qkv, mlp, p = v["vt_hidden_size"], v["qkv_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
  merged = w * 4
  out = [("vision_tower.patch_embed.proj.weight", "BF16", (w, 3, p, p)),
         ("vision_tower.patch_embed.pos_emb.weight", "BF16", (64, 64, w))]
  for i in range(v["vt_num_hidden_layers"]):
    b = f"vision_tower.encoder.blocks.{i}."
    out += [(b + "norm0.weight", "BF16", (w,)), (b + "norm1.weight", "BF16", (w,)),
            (b + "wqkv.weight", "BF16", (3 * qkv, w)), (b + "wo.weight", "BF16", (w, qkv)),
            (b + "mlp.fc0.weight", "BF16", (mlp, w)), (b + "mlp.fc1.weight", "BF16", (w, mlp))]
  return out + [("vision_tower.encoder.final_layernorm.weight", "BF16", (w,)),
                ("mm_projector.proj.0.weight", "BF16", (merged, merged)),
                ("mm_projector.proj.2.weight", "BF16", (D, merged)),
                ("mm_projector.post_norm.weight", "BF16", (D,))]


def tensors(experts: int) -> list[tuple[str, str, tuple[int, ...]]]:
  """(name, safetensors dtype, shape) in file order."""
  out = []

  def t(name, *shape, dt="BF16"):
    out.append((name, dt, tuple(shape)))

  p = "language_model.model."
  t(p + "embed_tokens.weight", V, D)
  for i in range(2):
    lp = f"{p}layers.{i}."
    for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
      t(lp + n + ".weight", D)
    t(lp + "self_attention_res_proj.weight", 1, D)
    t(lp + "mlp_res_proj.weight", 1, D)
    a = lp + "self_attn."
    if i == 0:
      hk = KDA_H * KDA_D
      for n in "qkv":
        t(a + f"{n}_proj.weight", hk, D)
        t(a + f"{n}_conv1d.weight", hk, 1, CONV, dt="F32")
      t(a + "f_a_proj.weight", KDA_D, D)
      t(a + "f_b_proj.weight", hk, KDA_D)
      t(a + "A_log", 128, dt="F32")  # 96 heads zero-padded to 128, as reported for the release
      t(a + "dt_bias", hk, dt="F32")
      t(a + "b_proj.weight", KDA_H, D)
      t(a + "g_proj.weight", hk, D)
      t(a + "o_norm.weight", KDA_D, dt="F32")
      t(a + "o_proj.weight", D, hk)
      t(lp + "mlp.gate_proj.weight", DENSE, D)
      t(lp + "mlp.up_proj.weight", DENSE, D)
      t(lp + "mlp.down_proj.weight", D, DENSE)
      continue
    t(a + "q_a_proj.weight", Q_LORA, D)
    t(a + "q_a_layernorm.weight", Q_LORA)
    t(a + "q_b_proj.weight", MLA_H * (NOPE + ROPE), Q_LORA)
    t(a + "kv_a_proj_with_mqa.weight", KV_LORA + ROPE, D)
    t(a + "kv_a_layernorm.weight", KV_LORA)
    t(a + "kv_b_proj.weight", MLA_H * (NOPE + VD), KV_LORA)
    t(a + "o_proj.weight", D, MLA_H * VD)
    t(a + "g_proj.weight", MLA_H * VD, D)
    m = lp + "block_sparse_moe."
    t(m + "gate.weight", experts, D)
    t(m + "gate.e_score_correction_bias", experts, dt="F32")
    t(m + "routed_expert_down_proj.weight", LATENT, D)
    t(m + "routed_expert_norm.weight", LATENT)
    t(m + "routed_expert_up_proj.weight", D, LATENT)
    t(m + "shared_experts.gate_proj.weight", SHARED * F, D)
    t(m + "shared_experts.up_proj.weight", SHARED * F, D)
    t(m + "shared_experts.down_proj.weight", D, SHARED * F)
    for e in range(experts):
      for n, (r, c) in (("w1", (F, LATENT)), ("w3", (F, LATENT)), ("w2", (LATENT, F))):
        t(f"{m}experts.{e}.{n}.weight_packed", r, c // 2, dt="U8")
        t(f"{m}experts.{e}.{n}.weight_scale", r, c // MXFP4_GROUP, dt="U8")
  t(p + "norm.weight", D)
  t(p + "output_attn_res_norm.weight", D)
  t(p + "output_attn_res_proj.weight", 1, D)
  t("language_model.lm_head.weight", V, D)
  return out


def fill(rng: np.random.Generator, name: str, dt: str, shape: tuple[int, ...]) -> np.ndarray:
  if name.endswith("A_log"):
    return np.concatenate([rng.standard_normal(96), np.zeros(shape[0] - 96)]).astype(np.float32)
  if dt == "U8":
    if name.endswith("weight_scale"):
      return rng.integers(118, 127, shape, dtype=np.uint8)
    return rng.integers(0, 256, shape, dtype=np.uint8)
  out = np.empty(shape, ml_dtypes.bfloat16 if dt == "BF16" else np.float32)
  flat = out.reshape(-1)
  step = 1 << 26
  for i in range(0, flat.size, step):  # fill in pieces: no float32 copy of a whole tensor
    flat[i:i + step] = (0.02 * rng.standard_normal(min(step, flat.size - i), np.float32)).astype(out.dtype)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--experts", type=int, default=896)
  ap.add_argument("--vision", action="store_true", help="add the vision tower and projector")
  args = ap.parse_args()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=False)
  plan = tensors(args.experts) + (vision_tensors() if args.vision else [])
  rng = np.random.default_rng(0)
  t0 = time.perf_counter()
  w = SafetensorsWriter(out, plan)
  for name, dt, shape in plan:
    w.write(name, fill(rng, name, dt, shape))
  w.close()
  (out / "config.json").write_text(json.dumps(config(args.experts, args.vision), indent=2))
  print(f"wrote {out}: {len(plan)} tensors, {w.total_bytes / 1e9:.2f} GB in "
        f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
