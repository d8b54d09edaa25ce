"""Checkpoint conversion: MXFP4, config mapping, validation, round trips and golden parity with
transformers' KimiLinearForCausalLM (files written by tools/make_golden.py; no torch here)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import chex
import jax
import ml_dtypes
import numpy as np
import yaml
import pytest
from flax import nnx
from numerics import max_rel_err
from safetensors.numpy import save_file

import convert
from k3jax import generate
from k3jax import config as config_lib
from k3jax.convert import (ConversionError, SafetensorsReader, block_shape, config_from_hf,
                           config_to_hf, hf_to_orbax, load_hf_params, load_orbax_params, mesh_shard_shape,
                           mxfp4_dequantize, mxfp4_quantize, orbax_to_hf, plan, read_hf_config)
from k3jax.pretrained import from_pretrained
from sharding.rules import named_sharding

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "kimi_linear_tiny"
BF16 = ml_dtypes.bfloat16
forward = nnx.jit(lambda model, ids: model(ids))  # one compilation per config and shape


# ---------------------------------------------------------------------------------------------
# MXFP4


def test_mxfp4_dequantize_by_hand():
  # One row of 64 values = 2 groups. Byte = (odd code << 4) | even code; code = sign bit 8 plus
  # magnitude index into [0, .5, 1, 1.5, 2, 3, 4, 6].
  packed = np.zeros((1, 32), np.uint8)
  packed[0, 0] = 0x21  # even: code 1 (+0.5), odd: code 2 (+1.0)
  packed[0, 1] = 0xF8  # even: code 8 (-0.0), odd: code 15 (-6.0)
  packed[0, 2] = 0x7B  # even: code 11 (-1.5), odd: code 7 (+6.0)
  packed[0, 16] = 0x5C  # group 2: even code 12 (-2.0), odd code 5 (+3.0)
  scale = np.array([[128, 125]], np.uint8)  # 2 ** 1, 2 ** -2
  w = mxfp4_dequantize(packed, scale)
  chex.assert_shape(w, (1, 64))
  chex.assert_type(w, np.float32)
  expect = np.zeros(64, np.float32)
  expect[:6] = [1.0, 2.0, -0.0, -12.0, -3.0, 12.0]
  expect[32:34] = [-0.5, 0.75]
  np.testing.assert_array_equal(w[0], expect)
  assert np.signbit(w[0, 2])  # code 8 is -0.0
  # exact in bfloat16 too, where a direct exponent-field path is used
  np.testing.assert_array_equal(mxfp4_dequantize(packed, scale, BF16).astype(np.float32), w)
  rng = np.random.default_rng(3)
  packed = rng.integers(0, 256, (16, 64), dtype=np.uint8)
  for lo, hi in ((2, 253), (0, 255)):  # inside and outside the direct path's scale range
    scale = rng.integers(lo, hi, (16, 4), dtype=np.uint8)
    w = mxfp4_dequantize(packed, scale)
    np.testing.assert_array_equal(w.astype(BF16), mxfp4_dequantize(packed, scale, BF16))


def _quantizer_style_mxfp4(rng, rows, cols):
  """Random MXFP4 data as the compressed-tensors quantizer writes it: each group's largest
  magnitude code is 4.0 or 6.0 (codes 6 or 7)."""
  codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
  g = codes.reshape(rows, cols // 32, 32)
  g[..., 0] = (g[..., 0] & 8) | rng.choice(np.array([6, 7], np.uint8), g.shape[:2])
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
  scale = rng.integers(110, 135, (rows, cols // 32), dtype=np.uint8)
  return packed, scale


def test_mxfp4_quantize_inverts_dequantize_bit_exactly():
  rng = np.random.default_rng(0)
  packed, scale = _quantizer_style_mxfp4(rng, 24, 96)
  w = mxfp4_dequantize(packed, scale)
  p2, s2 = mxfp4_quantize(w.astype(BF16))
  np.testing.assert_array_equal(p2, packed)
  np.testing.assert_array_equal(s2, scale)


def test_mxfp4_quantize_rounds_to_nearest_code():
  rng = np.random.default_rng(1)
  w = rng.standard_normal((8, 64)).astype(np.float32)
  packed, scale = mxfp4_quantize(w)
  back = mxfp4_dequantize(packed, scale)
  # reference: per group, the scale puts amax in [3.5, 7); values round to the nearest code
  grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
  for r in range(8):
    for g in range(2):
      x = w[r, 32 * g:32 * g + 32].astype(np.float64)
      s = 2.0 ** (int(scale[r, g]) - 127)
      assert 3.5 <= np.abs(x).max() / s < 7
      near = grid[np.abs(np.abs(x / s)[:, None] - grid[None]).argmin(1)] * np.sign(x) * s
      np.testing.assert_allclose(back[r, 32 * g:32 * g + 32], near, rtol=0, atol=1e-12)


def test_mxfp4_rejects_nan_scale():
  with pytest.raises(ConversionError, match="NaN"):
    mxfp4_dequantize(np.zeros((1, 16), np.uint8), np.full((1, 1), 255, np.uint8))


# ---------------------------------------------------------------------------------------------
# Config mapping


@pytest.mark.parametrize("yaml_name", ["k3.yaml", "kimi_linear_48b.yaml", "k3_tiny.yaml"])
def test_config_round_trip(yaml_name):
  cfg = config_lib.load(ROOT / "configs" / yaml_name).model
  hf = config_to_hf(cfg)
  assert hf["model_type"] == cfg.arch
  back = config_from_hf(json.loads(json.dumps(hf)), name=cfg.name)
  # training-only fields an HF config does not carry
  back = dataclasses.replace(back, remat=cfg.remat, scan_layers=cfg.scan_layers,
                             moe=dataclasses.replace(back.moe, balancing=cfg.moe.balancing),
                             kda=dataclasses.replace(back.kda,
                                                     save_residuals=cfg.kda.save_residuals))
  assert back == cfg


def test_config_from_released_kimi_linear_fields():
  hf = json.loads((GOLDEN / "config.json").read_text())
  cfg = config_from_hf(hf)
  assert cfg.arch == "kimi_linear" and cfg.mla_layers == (3,) and cfg.dense_layers == (0,)
  assert cfg.kda.gate == "softplus" and cfg.kda.output_gate == "low_rank"
  assert cfg.moe.routed_scaling_factor == 2.446 and not cfg.attn_res.enabled
  bad = dict(hf, num_expert_group=4, tie_word_embeddings=True)
  with pytest.raises(ConversionError, match="grouped routing.*tie_word|tie_word.*grouped"):
    config_from_hf(bad)


# ---------------------------------------------------------------------------------------------
# A tiny random Kimi K3 checkpoint with the released names, MXFP4 experts and a vision tower.

K3_TEXT = {
    "model_type": "kimi_linear", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3,
    "intermediate_size": 96, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
    "mla_use_output_gate": True, "num_experts": 4, "num_experts_per_token": 2,
    "num_shared_experts": 2, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 1.0,
    "routed_expert_hidden_size": 32, "latent_moe_use_norm": True, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
    "attn_res_block_size": 2, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False,
    "linear_attn_config": {"num_heads": 2, "head_dim": 64, "short_conv_kernel_size": 4,
                           "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                           "kda_layers": [1, 2], "full_attn_layers": [3]},
}


def _k3_tensors(rng) -> dict[str, np.ndarray]:
  t = K3_TEXT
  d, v, hk = t["hidden_size"], t["vocab_size"], 2 * 64
  L, F, E = t["routed_expert_hidden_size"], t["moe_intermediate_size"], t["num_experts"]
  h, nope, rope, vd = 2, 16, 8, 16
  out = {}

  def w(name, *shape, dtype=BF16, scale=0.1):
    out[name] = (scale * rng.standard_normal(shape)).astype(dtype)

  pre = "language_model.model."
  w("language_model.lm_head.weight", v, d)
  w(pre + "embed_tokens.weight", v, d, scale=1.0)
  w(pre + "norm.weight", d)
  w(pre + "output_attn_res_norm.weight", d)
  w(pre + "output_attn_res_proj.weight", 1, d)
  for i in range(3):
    lp = f"{pre}layers.{i}."
    for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
      w(lp + n + ".weight", d)
    w(lp + "self_attention_res_proj.weight", 1, d)
    w(lp + "mlp_res_proj.weight", 1, d)
    a = lp + "self_attn."
    if i < 2:  # KDA
      for n in "qkv":
        w(a + f"{n}_proj.weight", hk, d)
        w(a + f"{n}_conv1d.weight", hk, 1, 4, dtype=np.float32, scale=0.5)
      w(a + "f_a_proj.weight", 64, d)
      w(a + "f_b_proj.weight", hk, 64)
      out[a + "A_log"] = np.concatenate([rng.standard_normal(2), np.zeros(2)]).astype(np.float32)
      w(a + "dt_bias", hk, dtype=np.float32)
      w(a + "b_proj.weight", 2, d)
      w(a + "g_proj.weight", hk, d)
      w(a + "o_norm.weight", 64, dtype=np.float32)
      w(a + "o_proj.weight", d, hk)
    else:  # MLA
      w(a + "q_a_proj.weight", 32, d)
      w(a + "q_a_layernorm.weight", 32)
      w(a + "q_b_proj.weight", h * (nope + rope), 32)
      w(a + "kv_a_proj_with_mqa.weight", 32 + rope, d)
      w(a + "kv_a_layernorm.weight", 32)
      w(a + "kv_b_proj.weight", h * (nope + vd), 32)
      w(a + "o_proj.weight", d, h * vd)
      w(a + "g_proj.weight", h * vd, d)
    if i == 0:
      w(lp + "mlp.gate_proj.weight", 96, d)
      w(lp + "mlp.up_proj.weight", 96, d)
      w(lp + "mlp.down_proj.weight", d, 96)
      continue
    m = lp + "block_sparse_moe."
    w(m + "gate.weight", E, d)
    w(m + "gate.e_score_correction_bias", E, dtype=np.float32, scale=0.05)
    w(m + "routed_expert_down_proj.weight", L, d)
    w(m + "routed_expert_norm.weight", L)
    w(m + "routed_expert_up_proj.weight", d, L)
    for n in ("gate_proj", "up_proj"):
      w(m + f"shared_experts.{n}.weight", 2 * F, d)
    w(m + "shared_experts.down_proj.weight", d, 2 * F)
    for e in range(E):
      for n, (r, c) in (("w1", (F, L)), ("w3", (F, L)), ("w2", (L, F))):
        packed, scale = _quantizer_style_mxfp4(rng, r, c)
        out[f"{m}experts.{e}.{n}.weight_packed"] = packed
        out[f"{m}experts.{e}.{n}.weight_scale"] = scale
  w("vision_tower.patch_embed.weight", 8, 4)  # not part of the language model: skipped
  return out


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("k3_hf")
  tensors = _k3_tensors(np.random.default_rng(7))
  names = sorted(tensors)
  half = len(names) // 2  # two shards plus an index, like the release
  shards = {"model-00001-of-00002.safetensors": names[:half],
            "model-00002-of-00002.safetensors": names[half:]}
  for fname, ns in shards.items():
    save_file({n: tensors[n] for n in ns}, str(root / fname), metadata={"format": "pt"})
  index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
  (root / "model.safetensors.index.json").write_text(json.dumps(index))
  config = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "torch_dtype": "bfloat16", "text_config": K3_TEXT,
            "quantization_config": {"quant_method": "compressed-tensors",
                                    "format": "mxfp4-pack-quantized"}}
  (root / "config.json").write_text(json.dumps(config))
  (root / "tokenizer_config.json").write_text("{}")
  return root, tensors


def _read_all(directory: Path) -> dict[str, tuple[str, tuple, bytes]]:
  r = SafetensorsReader(directory)
  try:
    return {n: (t.dtype, t.shape, r.read(n).tobytes()) for n, t in r.tensors.items()}
  finally:
    r.close()


def test_k3_loads_and_runs(k3_dir, tmp_path):
  src, tensors = k3_dir
  model = from_pretrained(src, dtype="float32")
  cfg = model.cfg
  assert cfg.arch == "kimi_k3" and cfg.kda.gate == "bounded" and cfg.moe.latent_dim == 32
  assert cfg.attn_res.enabled and cfg.attn_res.block_size == 2 and cfg.mla.output_gate
  # spot-check the mapping against the raw tensors
  m = "language_model.model.layers.1.block_sparse_moe.experts.3."
  deq = {n: mxfp4_dequantize(tensors[m + n + ".weight_packed"], tensors[m + n + ".weight_scale"])
         for n in ("w1", "w3", "w2")}
  gate_up = np.asarray(model.layers[1].mlp.experts.w_gate_up[...][3])
  np.testing.assert_array_equal(gate_up, np.concatenate([deq["w1"].T, deq["w3"].T], 1))
  np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.experts.w_down[...][3]), deq["w2"].T)
  a = "language_model.model.layers.0.self_attn."
  np.testing.assert_array_equal(np.asarray(model.layers[0].self_attn.A_log[...]), tensors[a + "A_log"][:2])
  np.testing.assert_array_equal(np.asarray(model.layers[0].self_attn.q_conv1d.kernel[...]),
                                tensors[a + "q_conv1d.weight"][:, 0, :].T)
  np.testing.assert_array_equal(np.asarray(model.layers[2].mlp_res.proj[...]),
                                tensors["language_model.model.layers.2.mlp_res_proj.weight"][0].astype(np.float32))
  np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.gate.bias[...]),
                                tensors["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"])
  ids = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)
  logits = np.asarray(forward(model, ids))
  chex.assert_shape(logits, (2, 12, 128))
  chex.assert_type(logits, np.float32)
  chex.assert_tree_all_finite(logits)

  # HF -> Orbax (laid out for a mesh) -> same model, and Orbax -> HF bit-identical
  orbax_dir, back = tmp_path / "k3_orbax", tmp_path / "k3_back"
  assert convert.main(["hf-to-orbax", "model.remat=full", "--src", str(src),
                       "--dst", str(orbax_dir), "--no-progress", "--mesh", "fsdp=2,expert=2"]) == 0
  assert yaml.safe_load((orbax_dir / "k3jax.yaml").read_text())["model"]["remat"] == "full"
  manifest = json.loads((orbax_dir / "hf_manifest.json").read_text())
  assert not any(n.startswith("vision_tower") for n in manifest["tensors"])
  model2 = from_pretrained(orbax_dir, dtype="float32")
  np.testing.assert_array_equal(np.asarray(forward(model2, ids)), logits)
  assert convert.main(["orbax-to-hf", "--src", str(orbax_dir), "train.steps=3", "--dst",
                       str(tmp_path / "no"), "--no-progress"]) == 2
  assert convert.main(["orbax-to-hf", "--src", str(orbax_dir), "--dst", str(back), "--no-progress",
                       "model.kda.implementation=naive"]) == 0
  want = {n: v for n, v in _read_all(src).items() if not n.startswith("vision_tower")}
  assert _read_all(back) == want
  assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
  assert (back / "tokenizer_config.json").is_file()
  # experts written as plain bf16 instead: no quantization_config, same model
  plain = tmp_path / "k3_plain"
  orbax_to_hf(orbax_dir, plain, experts="bf16", progress=False)
  cfg_json = json.loads((plain / "config.json").read_text())
  assert "quantization_config" not in cfg_json and "quantization_config" not in cfg_json["text_config"]
  np.testing.assert_array_equal(np.asarray(forward(from_pretrained(plain, dtype="float32"), ids)), logits)


# the vision tower of a tiny K3 vision-language checkpoint (released names and field names)
K3_VISION = {
    "patch_size": 4, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
    "vt_hidden_size": 32, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
    "vt_intermediate_size": 48, "qkv_hidden_size": 48, "norm_type": "rmsnorm", "mlp_type": "mlp2",
    "patch_embed_proj_bias": True, "attn_bias": True, "linear_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
    "mm_projector_type": "patchmergerv2", "mm_hidden_size": 32, "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5, "text_hidden_size": 64, "media_placeholder_token_id": 100,
}


@pytest.fixture(scope="module")
def k3_vl_dir(tmp_path_factory, k3_dir):
  """k3_dir's language model with a vision tower and projector (every tensor random bf16)."""
  src, tensors = k3_dir
  root = tmp_path_factory.mktemp("k3_vl_hf")
  hf = json.loads((src / "config.json").read_text())
  hf.update(vision_config=K3_VISION, media_placeholder_token_id=100)
  cfg = config_from_hf(hf)
  rng = np.random.default_rng(11)
  t = {n: v for n, v in tensors.items() if not n.startswith("vision_tower")}
  for p in plan(cfg, "language_model."):
    if p.path.startswith(("vision_tower.", "mm_projector.")):
      shape = p.hf_shape or (p.shape[::-1] if p.kind == "linear" else p.shape)
      t[p.sources[0] + ("" if p.sources[0].endswith(".bias") else ".weight")] = (
          0.3 * rng.standard_normal(shape)).astype(BF16)
  save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
  (root / "config.json").write_text(json.dumps(hf))
  return root, t


@pytest.mark.slow
def test_k3_vision_language_round_trip(k3_vl_dir, tmp_path):
  """A K3 checkpoint with a vision tower: loaded (the patch conv, linears, biases and norms in
  place), run on an image prompt, HF -> Orbax -> HF byte-identical, config included."""
  from k3jax import vision
  src, tensors = k3_vl_dir
  model = from_pretrained(src, dtype="float32")
  v = model.cfg.vision
  assert (v.hidden_size, v.qkv_size, v.norm, v.projector, v.video_attention, v.image_token_id) == (
      32, 48, "rmsnorm", "patchmerger_v2", "joint", 100)
  conv = tensors["vision_tower.patch_embed.proj.weight"].astype(np.float32)  # [D, C, p, p]
  np.testing.assert_array_equal(np.asarray(model.vision_tower.patch_embed.proj.kernel[...]),
                                conv.reshape(32, -1).T)
  np.testing.assert_array_equal(np.asarray(model.mm_projector.proj_out.kernel[...]),
                                tensors["mm_projector.proj.2.weight"].astype(np.float32).T)
  np.testing.assert_array_equal(np.asarray(model.vision_tower.encoder.blocks[1].wqkv.bias[...]),
                                tensors["vision_tower.encoder.blocks.1.wqkv.bias"].astype(np.float32))
  assert model.vision_tower.encoder.blocks[0].mlp.fc0.bias is None  # linear_bias false
  item = vision.preprocess(np.random.default_rng(1).integers(0, 256, (20, 30, 3), np.uint8), v)
  arrays = vision.batch([item], max_patches=64)
  ids = np.full((1, 16), 5, np.int32)
  ids[0, 2:2 + item.num_tokens] = 100
  with_image = np.asarray(nnx.jit(lambda m, i, a: m(i, vision=a))(model, ids, arrays))
  chex.assert_tree_all_finite(with_image)
  assert not np.allclose(with_image, np.asarray(forward(model, ids)))

  orbax_dir, back = tmp_path / "vl_orbax", tmp_path / "vl_back"
  hf_to_orbax(src, orbax_dir, progress=False, max_block_bytes=4096)
  manifest = json.loads((orbax_dir / "hf_manifest.json").read_text())
  assert "vision_tower.patch_embed.proj.weight" in manifest["tensors"]
  orbax_to_hf(orbax_dir, back, progress=False, max_block_bytes=4096)
  assert _read_all(back) == _read_all(src)
  assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
  # the config alone writes the same vision_config back
  assert config_from_hf(config_to_hf(model.cfg)).vision == v


def test_mesh_layout_chunks_follow_shards(k3_dir):
  src, _ = k3_dir
  cfg = config_from_hf(read_hf_config(src))
  params = {p.path: p for p in plan(cfg, "language_model.")}
  mesh = {"fsdp": 2, "expert": 2}
  abstract = jax.sharding.AbstractMesh((2, 2), ("fsdp", "expert"))
  checked = 0
  for p in params.values():  # the per-device shard of the default sharding rules
    try:
      want = named_sharding(abstract, p.names).shard_shape(p.shape)
    except ValueError:  # indivisible at this tiny size: the converter keeps such a dim whole
      continue
    assert mesh_shard_shape(p, mesh) == want, p.path
    checked += 1
  assert checked > len(params) // 2
  gu = params["layers.1.mlp.experts.w_gate_up"]
  shard = mesh_shard_shape(gu, mesh)
  assert shard[0] == 2  # experts split over "expert"
  assert block_shape(gu, 2, shard) == (1,) + shard[1:]  # one expert per block
  lm = params["lm_head.kernel"]  # linear: blocks cut along the HF row (our last) axis
  assert block_shape(lm, 4, None, max_bytes=64 * 32 * 4) == (64, 32)


# ---------------------------------------------------------------------------------------------
# Validation and atomic output


def test_validation_lists_every_problem_and_leaves_nothing(k3_dir, tmp_path):
  src, tensors = k3_dir
  bad = tmp_path / "bad"
  bad.mkdir()
  t = dict(tensors)
  del t["language_model.model.layers.0.self_attn.o_proj.weight"]
  t["language_model.model.layers.2.self_attn.kv_b_proj.weight"] = np.zeros((7, 32), BF16)
  t["language_model.model.layers.1.self_attn.extra.weight"] = np.zeros((2,), BF16)
  t["language_model.model.layers.0.self_attn.A_log"] = np.ones(4, np.float32)  # non-zero padding
  save_file(t, str(bad / "model.safetensors"))
  (bad / "config.json").write_text((src / "config.json").read_text())
  dst = tmp_path / "out"
  with pytest.raises(ConversionError) as e:
    hf_to_orbax(bad, dst, progress=False)
  msg = str(e.value)
  for needle in ("1 missing", "layers.0.self_attn.o_proj.weight", "layers.2.self_attn.kv_b_proj.weight: BF16[7, 32]",
                 "1 unexpected", "layers.1.self_attn.extra.weight"):
    assert needle in msg, msg
  assert not dst.exists() and not list(tmp_path.glob(".out.tmp-*"))
  # a failure during writing (non-zero A_log padding is only seen when read) leaves nothing either
  del t["language_model.model.layers.1.self_attn.extra.weight"]
  t["language_model.model.layers.2.self_attn.kv_b_proj.weight"] = tensors["language_model.model.layers.2.self_attn.kv_b_proj.weight"]
  t["language_model.model.layers.0.self_attn.o_proj.weight"] = tensors["language_model.model.layers.0.self_attn.o_proj.weight"]
  save_file(t, str(bad / "model.safetensors"))
  with pytest.raises(ConversionError, match="padding after the first 2 heads"):
    hf_to_orbax(bad, dst, progress=False)
  assert not dst.exists() and not list(tmp_path.glob(".out.tmp-*"))
  assert convert.main(["hf-to-orbax", "--src", str(bad), "--dst", str(dst), "--no-progress"]) == 2


# ---------------------------------------------------------------------------------------------
# Golden parity with transformers (Kimi Linear) and the Kimi Linear round trip


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kimi_linear_golden_logits_and_greedy(tmp_path, scan):
  """transformers' logits and greedy tokens, with the layers unrolled and scanned (the same HF
  files either way)."""
  io = np.load(GOLDEN / "io.npz")
  model = from_pretrained(GOLDEN, overrides=[f"model.scan_layers={str(scan).lower()}"])
  assert model.cfg.layer_groups()[2] == 2
  assert model.cfg.param_dtype == "float32"
  logits = np.asarray(forward(model, io["input_ids"]))
  ref = io["logits"]
  rel = max_rel_err(logits, ref)
  assert rel < 1e-4, rel
  # greedy through the cached decode path (prefill, then KDA-state / MLA-latent steps)
  prompt, want = io["prompt"], io["greedy"]
  got = generate(model, [list(map(int, prompt[0]))], max_new_tokens=len(want))[0]
  np.testing.assert_array_equal(got, want)


def test_kimi_linear_round_trip_bit_identical(tmp_path):
  orbax_dir, back = tmp_path / "kl_orbax", tmp_path / "kl_back"
  # tiny blocks, so that large-tensor streaming (many blocks per tensor) runs both ways
  stats = hf_to_orbax(GOLDEN, orbax_dir, progress=False, max_block_bytes=8192)
  assert stats["read_bytes"] > 0 and stats["peak_rss_bytes"] > 0
  orbax_to_hf(orbax_dir, back, progress=False, max_block_bytes=8192)
  assert _read_all(back) == _read_all(GOLDEN)
  assert json.loads((back / "config.json").read_text()) == json.loads((GOLDEN / "config.json").read_text())
  with pytest.raises(ConversionError, match="already exists"):
    orbax_to_hf(orbax_dir, back, progress=False)
  # the Orbax tree restores as plain arrays
  cfg, flat = load_orbax_params(orbax_dir)
  assert cfg.arch == "kimi_linear" and flat["layers.1.mlp.experts.w_gate_up"].shape == (8, 64, 64)


def test_from_pretrained_sharded_restore(tmp_path):
  orbax_dir = tmp_path / "kl_orbax"
  hf_to_orbax(GOLDEN, orbax_dir, progress=False, mesh={"expert": 1})
  mesh = jax.make_mesh((1,), ("expert",))
  model = from_pretrained(orbax_dir, mesh=mesh)
  w = model.layers[1].mlp.experts.w_gate_up[...]
  assert isinstance(w, jax.Array) and w.sharding.mesh.shape == {"expert": 1}


# ---------------------------------------------------------------------------------------------
# Strict reading: headers, dtypes, config.json, symbolic links, interruption, stale temporaries


def _golden_copy(dst: Path, header_edit=None, config_text: str | None = None) -> Path:
  """A copy of the Kimi Linear golden checkpoint, its header changed by ``header_edit(header)``."""
  dst.mkdir()
  raw = (GOLDEN / "model.safetensors").read_bytes()
  n = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + n])
  if header_edit:
    header_edit(header)
  blob = json.dumps(header).encode()
  (dst / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])
  (dst / "config.json").write_text(config_text or (GOLDEN / "config.json").read_text())
  return dst


def test_header_offsets_and_lengths_are_checked_and_all_listed(tmp_path):
  def edit(h):
    h["model.embed_tokens.weight"]["data_offsets"] = h["lm_head.weight"]["data_offsets"]  # overlap
    begin, end = h["model.norm.weight"]["data_offsets"]
    h["model.norm.weight"]["data_offsets"] = [begin, end - 4]  # one element short
    h["model.layers.0.input_layernorm.weight"]["dtype"] = "Q4"
  src = _golden_copy(tmp_path / "src", edit)
  with pytest.raises(ConversionError) as e:
    hf_to_orbax(src, tmp_path / "out", progress=False)
  msg = str(e.value)
  assert "3 header problems" in msg, msg
  for needle in ("model.embed_tokens.weight: data_offsets overlap those of lm_head.weight",
                 "model.norm.weight: data_offsets", "F32[64] needs 256",
                 "model.layers.0.input_layernorm.weight: dtype 'Q4'"):
    assert needle in msg, msg
  assert not (tmp_path / "out").exists()


def test_dtype_must_be_the_checkpoints_float_kind(k3_dir, tmp_path):
  """lm_head as F16 or I32 in a bf16 checkpoint: refused by name, though the file itself is
  valid; an F32 norm beside it is accepted (F32 always is, for a floating parameter)."""
  src, tensors = k3_dir
  for dt in (np.float16, np.int32):
    bad = tmp_path / f"bad_{np.dtype(dt).name}"
    bad.mkdir()
    t = dict(tensors, **{"language_model.lm_head.weight": tensors["language_model.lm_head.weight"].astype(dt),
                         "language_model.model.norm.weight": tensors["language_model.model.norm.weight"].astype(np.float32)})
    save_file(t, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ConversionError) as e:
      from_pretrained(bad, dtype="float32")
    msg = str(e.value)
    assert "1 wrong shape or dtype" in msg and "language_model.lm_head.weight: " in msg, msg
    assert "expected BF16/F32[128, 64]" in msg, msg


@pytest.mark.parametrize("text, needle", [
    ("drop vocab_size", "vocab_size is missing"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    ('rms_norm_eps="small"', "rms_norm_eps='small' is not a positive finite number"),
    ("rms_norm_eps=-1", "rms_norm_eps=-1 is not a positive finite number"),
])
def test_bad_config_json_is_one_error_naming_the_field(tmp_path, text, needle):
  hf = json.loads((GOLDEN / "config.json").read_text())
  if text == "drop vocab_size":
    del hf["vocab_size"]
    text = json.dumps(hf)
  elif text.startswith("rms_norm_eps="):
    hf["rms_norm_eps"] = json.loads(text.split("=", 1)[1])
    text = json.dumps(hf)
  src = _golden_copy(tmp_path / "src", config_text=text)
  with pytest.raises(ConversionError, match=re.escape(needle)):
    hf_to_orbax(src, tmp_path / "out", progress=False)
  assert not (tmp_path / "out").exists()


def test_symlinks_outside_the_source_are_refused(tmp_path):
  secret = tmp_path / "elsewhere" / "secret.txt"
  secret.parent.mkdir()
  secret.write_text("do not copy")
  src = _golden_copy(tmp_path / "src")
  (src / "notes.txt").symlink_to(secret)
  with pytest.raises(ConversionError, match=r"outside it.*\n  notes.txt -> .*secret.txt"):
    hf_to_orbax(src, tmp_path / "out", progress=False)
  assert not (tmp_path / "out").exists()
  # a Hugging Face cache snapshot links into its repository's blobs/: allowed
  blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc"
  blobs.mkdir(parents=True)
  snap.mkdir(parents=True)
  for f in ("model.safetensors", "config.json"):
    shutil.copy(GOLDEN / f, blobs / f"hash_{f}")
    (snap / f).symlink_to(Path("../../blobs") / f"hash_{f}")
  cfg, _ = load_hf_params(snap)
  assert cfg.arch == "kimi_linear"


def test_stale_temporaries_are_removed_or_named(tmp_path):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  host = socket.gethostname()
  stale = tmp_path / f".out.tmp-{host}-{int(dead.stdout)}-0123abcd"
  (stale / "params").mkdir(parents=True)
  (stale / "params" / "junk").write_bytes(b"x" * 1000)
  live = tmp_path / f".out2.tmp-{host}-{os.getpid()}-0123abcd"
  live.mkdir()
  hf_to_orbax(GOLDEN, tmp_path / "out", progress=False)
  assert not stale.exists() and (tmp_path / "out" / "params").is_dir()
  with pytest.raises(ConversionError, match=re.escape(f"{live} is another conversion")):
    hf_to_orbax(GOLDEN, tmp_path / "out2", progress=False)


_SLOW_CONVERSION = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if inherited ignored
from k3jax.convert import to_orbax
block = to_orbax._Source.block
def slow(self, idx):
  print("block", flush=True)
  time.sleep(0.05)
  return block(self, idx)
to_orbax._Source.block = slow
to_orbax.hf_to_orbax(sys.argv[1], sys.argv[2], progress=False, max_block_bytes=4096)
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_the_conversion_and_removes_its_temporary(tmp_path, sig):
  dst = tmp_path / "out"
  p = subprocess.Popen([sys.executable, "-c", _SLOW_CONVERSION, str(GOLDEN), str(dst)], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
  for line in p.stdout:
    if line.startswith("block"):
      break
  assert list(tmp_path.glob(".out.tmp-*"))  # it is writing
  p.send_signal(sig)
  out = p.communicate(timeout=60)[0]
  assert p.returncode in (-sig, 128 + sig) or "KeyboardInterrupt" in out, (p.returncode, out[-2000:])
  assert not dst.exists() and not list(tmp_path.glob(".out.tmp-*")), out[-2000:]
