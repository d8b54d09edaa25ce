"""Writes the MoonViT golden files of tests/test_vision.py by running the reference vision tower.

Runs in its own environment, not the project venv (torch is not a k3jax dependency):

    python3.12 -m venv /tmp/visvenv
    /tmp/visvenv/bin/pip install torch transformers safetensors numpy
    /tmp/visvenv/bin/python tools/make_vision_golden.py --reference PATH [--out tests/golden]

The reference (``--reference``) is the Kimi K3 vision modeling file, the public K3 loaders'
MoonViT3d: ``nemo_automodel/components/models/kimi_k3/vision.py`` of NVIDIA-NeMo/Automodel
(header "modified for Kimi-K3", "Reference implementation for model architecture"; classes
``MoonViT3dPretrainedModel``, ``PatchMergerMLP``, ``PatchMergerMLPV2``). The golden files were
made from commit 10ceda1be02807a01f6adc2a3d21328e9279fd0a of that file (sha256 8e424541cfde318e
b60d3789c35e13dfc491ab4b209979df447e33596b34fa37), e.g. ``git show 10ceda1:nemo_automodel/
components/models/kimi_k3/vision.py > /tmp/k3_vision_reference.py``. It is Kimi K2.5's
``modeling_kimi_k25.py`` tower (moonshotai/Kimi-K2.5) with K3's switches added (``norm_type``,
``qkv_hidden_size``, the bias flags, ``pos_emb_interpolation_mode``, ``PatchMergerMLPV2``), so
one file covers both: the tool builds two tiny random towers,

- ``k3``: RMSNorm, no biases, bilinear grid, ``qkv_hidden_size`` != width, ``patchmergerv2``
  (K3's released settings, ``KimiK3VisionConfig``);
- ``k25``: LayerNorm, biases, bicubic grid, ``patchmerger`` (K2.5's settings),

each with every weight random (norm weights and biases too, so that a wrong mapping shows), runs
images of several sizes and aspect ratios (patch grids smaller than, equal to and larger than
the learned grid) and a video chunk of 3 frames as one packed call (eager attention, float32),
and writes under ``OUT/moonvit_tiny/``:

- ``{k3,k25}/model.safetensors``: float32 weights in the released names (``vision_tower.*``,
  ``mm_projector.*``);
- ``{k3,k25}/vision_config.json``: the tower's config fields (the release's names);
- ``io.npz``: ``pixel_values [N, 3, p, p]`` and ``grid_thws [n, 3]`` (the processor's format),
  and per tower ``{name}_tower [tokens, 4, D]`` (after the temporal pool) and
  ``{name}_projected [tokens, text_hidden]``.

Patches are 4 x 4 pixels and the towers 2 layers of width 32-40 to keep the files small.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the reference torch.compiles its resize

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402

SEED = 1234
PATCH = 4
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 10, 4), (1, 2, 2), (1, 6, 12), (3, 6, 4)]  # (t, h, w)
TOWERS = {
    "k3": dict(hidden_size=32, num_attention_heads=2, qkv_hidden_size=48, intermediate_size=64,
               norm_type="rmsnorm", attn_bias=False, linear_bias=False, patch_embed_proj_bias=False,
               pos_emb_interpolation_mode="bilinear", mm_projector_type="patchmergerv2"),
    "k25": dict(hidden_size=40, num_attention_heads=2, qkv_hidden_size=None, intermediate_size=56,
                norm_type="layernorm", attn_bias=True, linear_bias=True, patch_embed_proj_bias=True,
                pos_emb_interpolation_mode="bicubic", mm_projector_type="patchmerger"),
}
COMMON = dict(patch_size=PATCH, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
              pos_emb_type="divided_fixed", num_hidden_layers=2, merge_kernel_size=[2, 2],
              merge_type="sd2_tpool", mlp_type="mlp2", projector_ln_eps=1e-5, text_hidden_size=24)


def load_reference(path: Path):
  spec = importlib.util.spec_from_file_location("k3_vision_reference", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def build(ref, fields: dict):
  cfg = PretrainedConfig()
  for k, v in {**COMMON, **fields}.items():
    setattr(cfg, k, v)
  cfg.kimi_attn_implementation = "eager"
  cfg._attn_implementation = "eager"
  tower = ref.MoonViT3dPretrainedModel(cfg)
  proj_cfg = argparse.Namespace(mm_hidden_size=cfg.hidden_size, hidden_size=cfg.text_hidden_size,
                                merge_kernel_size=cfg.merge_kernel_size,
                                projector_ln_eps=cfg.projector_ln_eps)
  cls = {"patchmerger": ref.PatchMergerMLP, "patchmergerv2": ref.PatchMergerMLPV2}
  projector = cls[cfg.mm_projector_type](proj_cfg)
  with torch.no_grad():
    for module in (tower, projector):
      for name, p in module.named_parameters():
        if name.endswith("bias"):
          p.copy_(0.1 * torch.randn_like(p))
        elif p.ndim == 1:  # norm weights
          p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif name.endswith("pos_emb.weight"):
          p.copy_(0.5 * torch.randn_like(p))
        else:
          p.copy_(torch.randn_like(p) / np.sqrt(p[0].numel()))
  return tower.eval(), projector.eval()


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reference", type=Path, required=True, help="the K3 vision modeling file")
  ap.add_argument("--out", type=Path, default=Path("tests/golden"))
  args = ap.parse_args()
  ref = load_reference(args.reference)
  torch.manual_seed(SEED)
  rng = np.random.default_rng(SEED)
  n = sum(t * h * w for t, h, w in GRIDS)
  pixel_values = rng.normal(size=(n, 3, PATCH, PATCH)).astype(np.float32)
  grid_thws = np.array(GRIDS, np.int64)
  out = args.out / "moonvit_tiny"
  out.mkdir(parents=True, exist_ok=True)
  io = {"pixel_values": pixel_values, "grid_thws": grid_thws}
  for name, fields in TOWERS.items():
    tower, projector = build(ref, fields)
    with torch.no_grad():
      feats = tower(torch.from_numpy(pixel_values), torch.from_numpy(grid_thws))
      projected = projector(feats)
    io[f"{name}_tower"] = torch.cat(feats).numpy()
    io[f"{name}_projected"] = torch.cat(projected).numpy()
    weights = {f"vision_tower.{k}": v.contiguous() for k, v in tower.state_dict().items()}
    weights.update({f"mm_projector.{k}": v.contiguous() for k, v in projector.state_dict().items()})
    (out / name).mkdir(exist_ok=True)
    save_file(weights, out / name / "model.safetensors")
    (out / name / "vision_config.json").write_text(json.dumps({**COMMON, **fields}, indent=1) + "\n")
  np.savez(out / "io.npz", **io)
  digest = hashlib.sha256(args.reference.read_bytes()).hexdigest()
  print(f"wrote {out} from {args.reference} (sha256 {digest})")


if __name__ == "__main__":
  main()
