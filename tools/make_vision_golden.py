"""Writes the MoonViT golden files of tests/test_vision.py by running the reference vision tower.

Runs in its own environment, not the project venv (torch is not a k3jax dependency):

    python3.12 -m venv /tmp/visvenv
    /tmp/visvenv/bin/pip install torch transformers safetensors numpy
    /tmp/visvenv/bin/python tools/make_vision_golden.py --reference PATH --processor PATH \
        [--out tests/golden]

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
  ``{name}_projected [tokens, text_hidden]``;
- ``processor.npz``: uint8 images (``image_i``: three images scaled by the patch limit, the
  side limit or not at all, and a 3-frame video chunk) and what the reference processor makes of
  them (``pixel_values_i``, ``grid_i``, ``tokens_i``) under ``PROCESSOR``'s settings.

The processor (``--processor``) is Kimi K2.5's ``media_utils.py`` (moonshotai/Kimi-K2.5 on the
Hugging Face Hub; K3's image processor applies the same rule): its ``navit_resize_image``,
``navit_resize_video``, ``image_to_np``, ``normalize`` and ``navit_patchify``, called in the order
of ``KimiK25VisionProcessor.preprocess`` (PIL bicubic resize, zero padding right and bottom,
normalise, patchify; a video chunk's frames each resized by the per-frame limit).

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


PROCESSOR = dict(patch_size=PATCH, merge_kernel_size=2, in_patch_limit=64,
                 in_patch_limit_each_frame=32, patch_limit_on_one_side=16,
                 image_mean=[0.48, 0.46, 0.41], image_std=[0.27, 0.26, 0.28])
IMAGES = [(31, 45), (120, 200), (20, 300), (3, 40, 60)]  # (height, width) or (frames, h, w)


def load_module(path: Path, name: str):
  spec = importlib.util.spec_from_file_location(name, path)
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


def processed(media, rng) -> dict[str, np.ndarray]:
  """Random uint8 images of ``IMAGES`` and the reference processor's output for each."""
  from PIL import Image
  c = PROCESSOR
  out = {}
  for i, shape in enumerate(IMAGES):
    frames = rng.integers(0, 256, (1,) * (3 - len(shape)) + shape + (3,), dtype=np.uint8)
    h, w = frames.shape[1:3]
    if len(shape) == 2:
      plan = media.navit_resize_image(w, h, c["patch_size"], c["merge_kernel_size"],
                                      c["in_patch_limit"], c["patch_limit_on_one_side"], None)
    else:  # a video chunk: every frame sampled (sample_fps inf), the per-frame limit
      plan = media.navit_resize_video(w, h, len(frames), 1.0, float("inf"), c["patch_size"],
                                      c["merge_kernel_size"], c["in_patch_limit_each_frame"],
                                      c["patch_limit_on_one_side"], None, None, None)
    resized = [np.pad(media.image_to_np(Image.fromarray(f), (plan["new_width"], plan["new_height"]),
                                        "resize"),
                      ((0, plan["pad_height"]), (0, plan["pad_width"]), (0, 0)))
               for f in frames]
    pixels = media.normalize(np.stack(resized), np.array(c["image_mean"]),
                             1.0 / np.array(c["image_std"]))
    patches = media.navit_patchify(pixels, c["patch_size"])
    out[f"image_{i}"] = frames if len(shape) == 3 else frames[0]
    out[f"pixel_values_{i}"] = patches["pixel_values"]
    out[f"grid_{i}"] = patches["grid_thw"]
    out[f"tokens_{i}"] = np.array(plan["num_tokens"])
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--reference", type=Path, required=True, help="the K3 vision modeling file")
  ap.add_argument("--processor", type=Path, required=True, help="K2.5's media_utils.py")
  ap.add_argument("--out", type=Path, default=Path("tests/golden"))
  args = ap.parse_args()
  ref = load_module(args.reference, "k3_vision_reference")
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
  np.savez(out / "processor.npz", **processed(load_module(args.processor, "k25_media_utils"), rng))
  digest = hashlib.sha256(args.reference.read_bytes()).hexdigest()
  print(f"wrote {out} from {args.reference} (sha256 {digest})")


if __name__ == "__main__":
  main()
