"""Writes the Kimi Linear golden files of tests/test_convert.py from the reference implementation.

Runs in its own environment, not the project venv (torch is not a k3jax dependency):

    python3.11 -m venv /tmp/goldenvenv
    /tmp/goldenvenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors
    /tmp/goldenvenv/bin/python tools/make_golden.py [--out tests/golden]

It builds a tiny random ``KimiLinearForCausalLM`` (transformers >= 5.24 ships it, with pure torch
fallbacks for the KDA chunked/recurrent kernels and the short conv, so it runs on CPU without
Triton or fla): 5 layers (KDA at 1-based 1, 2, 3, 5 and MLA at 4, as in the release's pattern),
dense layer 0, MoE layers 1..4 with a shared expert, every norm and the router bias randomised
so that a wrong mapping shows. It writes, under ``OUT/kimi_linear_tiny/``:

- ``config.json`` in the released format (``linear_attn_config``, ``first_k_dense_replace``, ...)
  and ``model.safetensors`` with the released tensor names (SPEC section 9: separate
  ``q/k/v_conv1d``, per-expert ``w1/w2/w3``, ``block_sparse_moe``), float32;
- ``io.npz``: ``input_ids [2, 24]``, ``logits [2, 24, V]`` float32, ``prompt [1, 8]`` and
  ``greedy [32]`` (greedy continuation by repeated full forward passes) with ``greedy_margin``
  (top-1 minus top-2 logit at each step, to judge how robust the comparison is).

Before writing it reloads the files through ``AutoModelForCausalLM.from_pretrained`` (which
applies transformers' own kimi_linear name conversion) and checks the logits are unchanged, so
the names on disk are the released ones, not our guess.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, KimiLinearConfig, KimiLinearForCausalLM

SEED = 1234

RELEASED_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "model_max_length": 1048576,
    "torch_dtype": "float32",
    "linear_attn_config": {
        "head_dim": 64,
        "num_heads": 2,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5],
        "full_attn_layers": [4],
    },
}


def _randomise(model: KimiLinearForCausalLM, g: torch.Generator):
  """Norm weights ~ 1 + 0.2 N(0, 1), router biases ~ 0.05 N(0, 1): defaults (ones / zeros) would
  hide a missing or swapped tensor."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.05 * torch.randn(b.shape, generator=g))


def released_state_dict(model: KimiLinearForCausalLM, cfg: dict) -> dict[str, torch.Tensor]:
  """transformers' module names -> the released checkpoint names (SPEC section 9)."""
  out = {}
  sd = model.state_dict()
  qkv = cfg["linear_attn_config"]["num_heads"] * cfg["linear_attn_config"]["head_dim"]
  f = cfg["moe_intermediate_size"]
  for name, t in sd.items():
    t = t.detach().clone().contiguous()
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")
    if name.endswith(".self_attn.conv1d.weight"):
      base = name[: -len("conv1d.weight")]
      for i, n in enumerate("qkv"):
        out[f"{base}{n}_conv1d.weight"] = t[i * qkv:(i + 1) * qkv].contiguous()
      continue
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
    if layer >= cfg["first_k_dense_replace"]:
      name = name.replace(".mlp.", ".block_sparse_moe.")
    if name.endswith(".experts.gate_up_proj"):
      base = name[: -len("gate_up_proj")]
      for e in range(t.shape[0]):
        out[f"{base}{e}.w1.weight"] = t[e, :f].contiguous()
        out[f"{base}{e}.w3.weight"] = t[e, f:].contiguous()
      continue
    if name.endswith(".experts.down_proj"):
      base = name[: -len("down_proj")]
      for e in range(t.shape[0]):
        out[f"{base}{e}.w2.weight"] = t[e].contiguous()
      continue
    out[name] = t
  return out


def greedy(model, prompt: torch.Tensor, steps: int) -> tuple[np.ndarray, np.ndarray]:
  """Greedy tokens by repeated full forward passes (no cache) and the top-1 minus top-2 margins."""
  ids = prompt.clone()
  toks, margins = [], []
  with torch.no_grad():
    for _ in range(steps):
      last = model(ids).logits[0, -1].double()
      top = torch.topk(last, 2)
      toks.append(int(top.indices[0]))
      margins.append(float(top.values[0] - top.values[1]))
      ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
  return np.array(toks, np.int32), np.array(margins, np.float64)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "golden"))
  args = ap.parse_args()
  torch.manual_seed(SEED)
  g = torch.Generator().manual_seed(SEED)
  cfg_kwargs = {k: v for k, v in RELEASED_CONFIG.items() if k not in ("architectures", "torch_dtype")}
  config = KimiLinearConfig(**cfg_kwargs)
  assert config.layer_types == ["linear_attention"] * 3 + ["full_attention", "linear_attention"], config.layer_types
  assert config.mlp_layer_types == ["dense"] + ["sparse"] * 4, config.mlp_layer_types
  model = KimiLinearForCausalLM(config).float().eval()
  _randomise(model, g)

  input_ids = torch.randint(3, RELEASED_CONFIG["vocab_size"], (2, 24), generator=g)
  with torch.no_grad():
    logits = model(input_ids).logits.float()
  prompt = input_ids[:1, :8]
  toks, margins = greedy(model, prompt, 32)
  with torch.no_grad():
    gen = model.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 8:]
  cached_matches = bool((gen.numpy() == toks).all())

  out = Path(args.out) / "kimi_linear_tiny"
  out.mkdir(parents=True, exist_ok=True)
  sd = released_state_dict(model, RELEASED_CONFIG)
  with tempfile.TemporaryDirectory() as tmp:  # check the names with transformers' own loader
    save_file(sd, f"{tmp}/model.safetensors", metadata={"format": "pt"})
    Path(tmp, "config.json").write_text(json.dumps(RELEASED_CONFIG, indent=2))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    with torch.no_grad():
      again = reloaded(input_ids).logits.float()
    assert torch.equal(again, logits), float((again - logits).abs().max())
  save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(RELEASED_CONFIG, indent=2) + "\n")
  np.savez(out / "io.npz", input_ids=input_ids.numpy().astype(np.int32), logits=logits.numpy(),
           prompt=prompt.numpy().astype(np.int32), greedy=toks, greedy_margin=margins)
  import transformers
  print(f"wrote {out}: {len(sd)} tensors, transformers {transformers.__version__}, "
        f"torch {torch.__version__}; logits |max| {float(logits.abs().max()):.3f}; "
        f"greedy {toks.tolist()}; min margin {margins.min():.4f}; "
        f"generate() with cache matches: {cached_matches}")


if __name__ == "__main__":
  main()
