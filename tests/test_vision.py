"""MoonViT-V2 (k3jax.vision): host-side preprocessing and packing, the tower against float64
NumPy and against golden outputs of the reference, the merge into the text sequence."""

import numpy as np
import pytest

from k3jax import config
from k3jax.config import ConfigError, VisionConfig
from k3jax import vision
from k3jax.vision import VisionError


def _pixels(rng, *shape):
  return rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)


@pytest.mark.parametrize("hw, limit, expect", [
    # (height, width), in_patch_limit -> (resized h, w, padded grid rows, cols, tokens)
    ((50, 70), 16384, (50, 70, 4, 6, 6)),
    ((28, 28), 16384, (28, 28, 2, 2, 1)),
    ((1, 1), 16384, (1, 1, 2, 2, 1)),
    # scaled by sqrt(1024 / (200 * 100)): 2800 -> 633 (+11 pad), 1400 -> 316 (+20 pad)
    ((1400, 2800), 1024, (316, 633, 24, 46, 276)),
])
def test_resize_plan_matches_the_reference_rule(hw, limit, expect):
  cfg = VisionConfig(in_patch_limit=limit)
  plan = vision.resize_plan(*hw, cfg)
  assert (plan.height, plan.width, plan.grid[1], plan.grid[2], plan.num_tokens) == expect
  assert (plan.height + plan.pad_height, plan.width + plan.pad_width) == (expect[2] * 14,
                                                                          expect[3] * 14)
  assert vision.num_tokens(*hw, cfg) == expect[4]


def test_side_limit_and_video_frame_limit():
  cfg = VisionConfig(side_limit=8, frame_patch_limit=16, max_patches=4096)
  plan = vision.resize_plan(20, 2000, cfg)  # 8 patches a side at most: 2000 -> 112 pixels
  assert plan.width == 112 and plan.grid == (1, 2, 8)
  video = vision.resize_plan(280, 280, cfg, frames=3)  # 16 patches a frame: 20x20 -> 4x4
  assert (video.height, video.width, video.grid, video.num_tokens) == (56, 56, (3, 4, 4), 4)
  unpooled = VisionConfig(side_limit=8, frame_patch_limit=16, temporal_pool=False)
  assert vision.num_tokens(280, 280, unpooled, frames=3) == 12


def test_preprocess_patches_are_the_normalised_pixels_in_merge_order():
  rng = np.random.default_rng(0)
  cfg = VisionConfig(image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
  pixels = _pixels(rng, 2, 31, 45)  # a 2-frame chunk, padded to 56 x 56: grid 4 x 4
  item = vision.preprocess(pixels, cfg)
  assert item.grid == (2, 4, 4) and item.num_patches == 32 and item.num_tokens == 4
  full = np.zeros((2, 56, 56, 3))
  full[:, :31, :45] = pixels
  norm = (full / 255.0 - np.array(cfg.image_mean)) / np.array(cfg.image_std)
  for n in range(item.num_patches):
    t, r, c = item.positions[n]
    want = norm[t, r * 14:(r + 1) * 14, c * 14:(c + 1) * 14].transpose(2, 0, 1).ravel()
    np.testing.assert_allclose(item.patches[n], want, rtol=0, atol=2e-6)
    assert item.tokens[n] == (r // 2) * 2 + c // 2  # temporal pooling: frames share tokens
  # each run of 4 patches is one 2x2 block, in (row, column) order
  pos = item.positions[:4, 1:]
  assert pos.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
  assert sorted(map(tuple, item.positions.tolist())) == [
      (t, r, c) for t in range(2) for r in range(4) for c in range(4)]


def test_preprocess_resizes_with_pillow_bicubic():
  from PIL import Image
  rng = np.random.default_rng(1)
  cfg = VisionConfig(in_patch_limit=16)  # 112 x 84 (8 x 6 patches) -> 4 x 3 patches' worth
  pixels = _pixels(rng, 84, 112)
  item = vision.preprocess(pixels, cfg)
  plan = vision.resize_plan(84, 112, cfg)
  small = np.asarray(Image.fromarray(pixels).resize((plan.width, plan.height),
                                                    Image.Resampling.BICUBIC))
  assert small.shape == (plan.height, plan.width, 3) and plan.height < 84
  t, r, c = item.positions[5]
  block = np.zeros((plan.grid[1] * 14, plan.grid[2] * 14, 3))
  block[:plan.height, :plan.width] = small
  want = (block[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14] / 255.0 - 0.5) / 0.5
  np.testing.assert_allclose(item.patches[5], want.transpose(2, 0, 1).ravel(), atol=2e-6)


@pytest.mark.parametrize("pixels, match", [
    (np.zeros((0, 5, 3), np.uint8), "empty"),
    (np.zeros((5, 0, 3), np.uint8), "empty"),
    (np.zeros((0, 5, 5, 3), np.uint8), "empty"),
    (np.zeros((5, 5, 3), np.float32), "uint8"),
    (np.zeros((5, 5), np.uint8), "shape"),
    (np.zeros((5, 5, 2), np.uint8), "shape"),
    (np.zeros((1, 1, 5, 5, 3), np.uint8), "shape"),
    (np.zeros((5, 5, 5, 3), np.uint8), "frames"),
    ([[[0, 0, 0]]], "NumPy"),
])
def test_bad_inputs_are_refused(pixels, match):
  with pytest.raises(VisionError, match=match):
    vision.preprocess(pixels, VisionConfig())


def test_limits_are_refused_before_work():
  with pytest.raises(VisionError, match="max_pixels"):
    vision.num_tokens(100_000, 100_000, VisionConfig())
  cfg = VisionConfig(max_patches=64)
  assert vision.num_tokens(112, 112, cfg) == 16  # 8 x 8 patches: at the limit
  with pytest.raises(VisionError, match="max_patches=64"):
    vision.preprocess(np.zeros((113, 112, 3), np.uint8), cfg)  # 10 x 8 patches after padding
  assert issubclass(VisionError, ValueError)


def _cubic(x):
  """Keys' cubic convolution kernel, A = -0.75, float64."""
  a, x = -0.75, abs(x)
  if x <= 1:
    return (a + 2) * x ** 3 - (a + 3) * x ** 2 + 1
  return a * x ** 3 - 5 * a * x ** 2 + 8 * a * x - 4 * a if x < 2 else 0.0


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
@pytest.mark.parametrize("out_size, in_size", [(1, 6), (5, 6), (6, 6), (9, 6), (13, 4)])
def test_interpolation_taps_against_float64(mode, out_size, in_size):
  from k3jax.vision.pos_taps import interpolation_taps
  rng = np.random.default_rng(out_size)
  src = rng.normal(size=in_size)
  idx, w = interpolation_taps(out_size, in_size, mode)
  got = (w * src[idx]).sum(-1)
  want = np.zeros(out_size)
  for i in range(out_size):
    x = (i + 0.5) * in_size / out_size - 0.5
    if mode == "bilinear":
      x = max(x, 0.0)
      lo = int(np.floor(x))
      want[i] = (1 - (x - lo)) * src[lo] + (x - lo) * src[min(lo + 1, in_size - 1)]
    else:
      lo = int(np.floor(x))
      want[i] = sum(_cubic(x - j) * src[min(max(j, 0), in_size - 1)] for j in range(lo - 1, lo + 3))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_batch_packs_rows_with_padding_marked():
  rng = np.random.default_rng(2)
  cfg = VisionConfig()
  image = vision.preprocess(_pixels(rng, 50, 70), cfg)  # 24 patches, 6 tokens
  video = vision.preprocess(_pixels(rng, 3, 30, 40), cfg)  # 3 x 16 patches, 4 tokens
  arrays = vision.batch([[image, video], [], [video]], max_patches=80)
  assert arrays["patches"].shape == (3, 80, 588) and arrays["token_ids"].shape == (3, 20)
  np.testing.assert_array_equal(arrays["num_tokens"], [10, 0, 4])
  seg = arrays["segment_ids"]
  assert (seg[0, :24] == 1).all() and (seg[0, 24:72] == 2).all() and (seg[0, 72:] == 0).all()
  assert (seg[1] == 0).all()
  np.testing.assert_array_equal(arrays["patches"][0, 24:72], video.patches)
  assert (arrays["patches"][0, 72:] == 0).all()
  # frames: the image is one, the video's three follow
  np.testing.assert_array_equal(arrays["frame_ids"][0, :72], np.repeat([1, 2, 3, 4], [24, 16, 16, 16]))
  np.testing.assert_array_equal(arrays["times"][0, :72], np.repeat([-1, 0, 1, 2], [24, 16, 16, 16]))
  # visual tokens: the image's 0-5, the video's 6-9 once per frame (averaged), padding 20
  np.testing.assert_array_equal(arrays["token_ids"][0], list(range(10)) + [6, 7, 8, 9] * 2 + [20, 20])
  np.testing.assert_array_equal(arrays["token_ids"][2, :12], [0, 1, 2, 3] * 3)
  # the temporal order is a permutation putting each position's frames side by side
  order, tid = arrays["temporal_order"][0], arrays["temporal_ids"][0]
  assert sorted(order) == list(range(80))
  pos = np.concatenate([arrays["positions"][0], seg[0][:, None]], axis=-1)[order]
  for s in np.unique(tid[tid > 0]):
    assert len({tuple(p) for p in pos[tid == s]}) == 1  # one position of one item
  assert (np.unique(tid[24:72], return_counts=True)[1] == 3).all()


def test_batch_errors():
  cfg = VisionConfig()
  item = vision.preprocess(np.zeros((28, 56, 3), np.uint8), cfg)  # 8 patches
  with pytest.raises(VisionError, match="over max_patches=4"):
    vision.batch([item], max_patches=4)
  with pytest.raises(VisionError, match="multiple"):
    vision.batch([item], max_patches=10)
  with pytest.raises(VisionError, match="needs cfg"):
    vision.batch([[], []], max_patches=8)
  empty = vision.batch([[], []], max_patches=8, cfg=cfg)
  assert empty["patches"].shape == (2, 8, 588) and (empty["token_ids"] == 2).all()
  other = vision.preprocess(np.zeros((28, 56, 3), np.uint8), VisionConfig(patch_size=7))
  with pytest.raises(VisionError, match="different vision configs"):
    vision.batch([item, other], max_patches=64)


@pytest.mark.parametrize("override, key", [
    ("model.vision.num_heads=3", "model.vision.num_heads"),
    ("model.vision.num_heads=32", "model.vision.num_heads"),  # head dim 2: no 2D rotary
    ("model.vision.merge_kernel=[2]", "model.vision.merge_kernel"),
    ("model.vision.max_patches=30", "model.vision.max_patches"),
    ("model.vision.norm=batchnorm", "model.vision.norm"),
    ("model.vision.video_attention=full", "model.vision.video_attention"),
    ("model.vision.projector=mlp", "model.vision.projector"),
    ("model.vision.image_token_id=100000", "model.vision.image_token_id"),
    ("model.vision.image_token_id=256", "model.vision.image_token_id"),
    ("model.vision.image_std=[0.5,0.5]", "model.vision.image_std"),
    ("model.vision.patch_size=0", "model.vision.patch_size"),
    ("model.vision.colour=1", "model.vision.colour"),
])
def test_vision_config_errors_name_the_key(override, key):
  from conftest import tiny_config
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    tiny_config(override)


def test_vision_config_from_yaml_and_text_only_default():
  from conftest import tiny_config
  assert tiny_config().model.vision is None
  cfg = config.from_dict({"model": {"vision": {"num_layers": 3}}})
  assert cfg.model.vision == VisionConfig(num_layers=3)
  again = config.from_dict(config.to_dict(cfg))
  assert again.model.vision == cfg.model.vision


# ---------------------------------------------------------------------------------------------
# The tower against the reference (tools/make_vision_golden.py)

GOLDEN = __import__("conftest").ROOT / "tests" / "golden" / "moonvit_tiny"


def _golden_model(name: str, **vision_overrides):
  """(ModelConfig, tower, projector) of golden tower ``name`` with its released weights loaded
  through the converter's name plan."""
  import dataclasses
  import json
  from flax import nnx
  from k3jax.convert import names
  from k3jax.convert.hf_vision import vision_from_hf
  from k3jax.convert.safetensors_io import SafetensorsReader
  from k3jax.convert.to_orbax import read_params
  from k3jax.vision.projector import Projector
  from k3jax.vision.tower import VisionTower
  from conftest import tiny_config
  fields = json.loads((GOLDEN / name / "vision_config.json").read_text())
  base = tiny_config("model.hidden_size=24", "model.num_layers=1", "model.mla_layers=[0]",
                     "model.dense_layers=[0]").model
  vcfg = VisionConfig(**{**vision_from_hf(fields, 24, 259), "merge_kernel": (2, 2),
                         **vision_overrides})
  cfg = dataclasses.replace(base, vision=vcfg)
  reader = SafetensorsReader(GOLDEN / name)
  try:
    plan = [p for p in names.plan(cfg) if p.path.startswith(("vision_tower.", "mm_projector."))]
    names.validate(plan, {n: (t.dtype, t.shape) for n, t in reader.tensors.items()}, "", ("F32",))
    values = read_params(reader, plan)
  finally:
    reader.close()
  modules = {"vision_tower": VisionTower(cfg, rngs=nnx.Rngs(0)),
             "mm_projector": Projector(cfg, rngs=nnx.Rngs(0))}
  for prefix, module in modules.items():
    flat = nnx.to_flat_state(nnx.state(module))
    for path, var in flat:
      var.set_value(values[".".join([prefix, *map(str, path)])])
    nnx.update(module, nnx.from_flat_state(flat))
  return cfg, modules["vision_tower"], modules["mm_projector"]


def _golden_items(cfg):
  io = np.load(GOLDEN / "io.npz")
  items, start = [], 0
  for grid in io["grid_thws"]:
    n = int(np.prod(grid))
    items.append(vision.from_patches(io["pixel_values"][start:start + n], tuple(grid), cfg.vision))
    start += n
  return io, items


@pytest.mark.parametrize("name", ["k3", "k25"])
def test_tower_matches_the_reference(name):
  """Images of several sizes (grids below, at and above the learned 8 x 8 grid) and a 3-frame
  video chunk, packed in two rows with padding, against the reference tower and projector."""
  import jax.numpy as jnp
  from flax import nnx
  cfg, tower, projector = _golden_model(name, video_attention="joint")
  io, items = _golden_items(cfg)
  arrays = vision.batch([items[:3], items[3:]], max_patches=176)
  arrays = {k: jnp.asarray(v) for k, v in arrays.items()}
  tokens, projected = nnx.jit(lambda t, p, a: (t(a, jnp.float32), p(t(a, jnp.float32))))(
      tower, projector, arrays)  # [2, M, 4, D], [2, M, d]
  n = np.asarray(arrays["num_tokens"])
  got_tokens = np.concatenate([np.asarray(tokens[b, :n[b]]) for b in range(2)])
  got_proj = np.concatenate([np.asarray(projected[b, :n[b]]) for b in range(2)])
  np.testing.assert_allclose(got_tokens, io[f"{name}_tower"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_proj, io[f"{name}_projected"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The tower's pieces against float64 NumPy


def _np_attention(q, k, v, seg):
  """Bidirectional attention within equal segment ids, float64, ``[P, H, D]``; id 0 gives 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros_like(v)
  for i in range(q.shape[0]):
    if seg[i] == 0:
      continue
    keys = np.flatnonzero(seg == seg[i])
    for h in range(q.shape[1]):
      logit = k[keys, h] @ q[i, h] / np.sqrt(q.shape[-1])
      p = np.exp(logit - logit.max())
      out[i, h] = (p / p.sum()) @ v[keys, h]
  return out


@pytest.mark.parametrize("implementation", ["xla", "pallas_gpu"])
def test_packed_attention_against_float64(implementation):
  """Three segments and padding, head dim 36 (not a multiple of 16: zero-padded for the Pallas
  kernel, here in interpret mode)."""
  import jax
  from k3jax.vision.attention import packed_attention
  seg = np.array([[1] * 7 + [2] * 20 + [3] * 3 + [0] * 6, [4] * 30 + [0] * 6], np.int32)
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (2, 36, 2, 36)) for kk in ks)
  got = np.asarray(packed_attention(q, k, v, jax.numpy.asarray(seg), implementation))
  for b in range(2):
    np.testing.assert_allclose(got[b], _np_attention(q[b], k[b], v[b], seg[b]), atol=2e-5,
                               rtol=2e-5)


def test_rope_against_float64():
  import jax.numpy as jnp
  from k3jax.vision.rope import apply_rope, rope_angles
  rng = np.random.default_rng(3)
  pos = rng.integers(0, 300, (5, 2))
  x = rng.normal(size=(5, 3, 24)).astype(np.float32)
  cos, sin = rope_angles(jnp.asarray(pos), 24, 10000.0)
  got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
  want = np.zeros((5, 3, 24))
  for n in range(5):
    for j in range(12):  # complex pair j: column for even j, row for odd j
      angle = pos[n, 1 - j % 2] * 10000.0 ** (-4 * (j // 2) / 24)
      z = (x[n, :, 2 * j] + 1j * x[n, :, 2 * j + 1]) * np.exp(1j * angle)
      want[n, :, 2 * j], want[n, :, 2 * j + 1] = z.real, z.imag
  np.testing.assert_allclose(got, want, atol=2e-4)  # float32 angles up to ~300 rad


def test_pixel_shuffle_and_temporal_pool_against_float64():
  import jax.numpy as jnp
  from k3jax.vision.tower import pixel_shuffle
  rng = np.random.default_rng(4)
  cfg = VisionConfig()
  video = vision.from_patches(np.zeros((2 * 4 * 6, 588), np.float32), (2, 4, 6), cfg)
  image = vision.from_patches(np.zeros((2 * 2, 588), np.float32), (1, 2, 2), cfg)
  arrays = vision.batch([image, video], max_patches=56)
  x = rng.normal(size=(1, 56, 5))
  got = np.asarray(pixel_shuffle(jnp.asarray(x, jnp.float32), jnp.asarray(arrays["token_ids"]), 4))
  assert got.shape == (1, 14, 4, 5)
  # by position: the image's one token, then the video's 2 x 3 blocks averaged over 2 frames;
  # padding gives zeros
  want = np.zeros((14, 4, 5))
  want[0] = x[0, :4]
  for br in range(2):
    for bc in range(3):
      for r in range(2):
        for c in range(2):
          rows = [n for n in range(4, 52) if tuple(arrays["positions"][0, n]) ==
                  (2 * br + r, 2 * bc + c)]
          assert len(rows) == 2  # one per frame
          want[1 + br * 3 + bc, r * 2 + c] = x[0, rows].mean(0)
  np.testing.assert_allclose(got[0], want, atol=1e-6)


def _np_norm(x, w, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_divided_video_attention_against_float64():
  """One K3 block with ``video_attention: divided`` on an image and a 3-frame chunk: the image
  sees its spatial pass only (as the joint block), the chunk a spatial pass per frame, then a
  temporal pass per position, both with the block's weights."""
  import dataclasses
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3jax.vision.tower import EncoderLayer
  from k3jax.vision.rope import rope_angles
  from conftest import tiny_config
  vcfg = VisionConfig(hidden_size=16, num_heads=2, qkv_size=24, intermediate_size=32,
                      video_attention="divided")
  cfg = dataclasses.replace(tiny_config().model, vision=vcfg)
  layer = EncoderLayer(cfg, rngs=nnx.Rngs(5))
  rng = np.random.default_rng(5)
  for _, var in nnx.to_flat_state(nnx.state(layer)):
    var.set_value(jnp.asarray(rng.normal(size=var.get_value().shape) * 0.3, jnp.float32))
  image = vision.from_patches(np.zeros((8, 588), np.float32), (1, 2, 4), vcfg)
  video = vision.from_patches(np.zeros((3 * 8, 588), np.float32), (3, 2, 4), vcfg)
  arrays = {k: jnp.asarray(v) for k, v in vision.batch([image, video], max_patches=36).items()}
  x = rng.normal(size=(1, 36, 16)).astype(np.float32)
  cos, sin = rope_angles(arrays["positions"], 12, vcfg.rope_theta)
  arrays["temporal_inverse"] = jnp.argsort(arrays["temporal_order"], axis=1)
  got = np.asarray(jax.jit(lambda x: layer(x, arrays, cos, sin))(jnp.asarray(x)))[0]

  w = {".".join(map(str, p)): np.asarray(v.get_value(), np.float64)
       for p, v in nnx.to_flat_state(nnx.state(layer))}
  c, s = np.asarray(cos[0], np.float64), np.asarray(sin[0], np.float64)

  def rot(t):  # [P, H, 12]
    a, b = t[..., 0::2], t[..., 1::2]
    out = np.empty_like(t)
    out[..., 0::2] = a * c[:, None] - b * s[:, None]
    out[..., 1::2] = a * s[:, None] + b * c[:, None]
    return out

  def attn(h, seg):
    qkv = (_np_norm(h, w["norm0.weight"], vcfg.norm_eps) @ w["wqkv.kernel"]).reshape(36, 3, 2, 12)
    o = _np_attention(rot(qkv[:, 0]), rot(qkv[:, 1]), qkv[:, 2], seg)
    return o.reshape(36, 24) @ w["wo.kernel"]

  seg = np.asarray(arrays["segment_ids"][0])
  frame = np.asarray(arrays["frame_ids"][0])
  t, row, col = np.asarray(arrays["times"][0]), *np.asarray(arrays["positions"][0]).T
  place = np.where((t >= 0) & (seg > 0), seg * 100 + row * 10 + col, 0)  # a video position
  h = x[0].astype(np.float64)
  h = h + attn(h, frame)
  h = h + attn(h, place) * (place > 0)[:, None]
  m = _np_norm(h, w["norm1.weight"], vcfg.norm_eps) @ w["mlp.fc0.kernel"]
  m = 0.5 * m * (1 + np.tanh(np.sqrt(2 / np.pi) * (m + 0.044715 * m ** 3)))
  h = h + m @ w["mlp.fc1.kernel"]
  valid = seg > 0
  np.testing.assert_allclose(got[valid], h[valid], atol=2e-5, rtol=2e-5)
  # the image's rows equal the joint block's
  joint = EncoderLayer(dataclasses.replace(cfg, vision=dataclasses.replace(
      vcfg, video_attention="joint")), rngs=nnx.Rngs(0))
  nnx.update(joint, nnx.state(layer))
  got_joint = np.asarray(joint(jnp.asarray(x), arrays, cos, sin))[0]
  np.testing.assert_allclose(got_joint[:8], got[:8], atol=1e-6)
  assert not np.allclose(got_joint[8:32], got[8:32], atol=1e-3)


def test_merge_visual_replaces_placeholders_in_order():
  import jax.numpy as jnp
  from k3jax.vision.merge import merge_visual
  rng = np.random.default_rng(6)
  ids = np.array([[5, 9, 9, 5, 9, 5, 9], [9, 9, 5, 5, 5, 5, 5]], np.int32)
  x, visual = rng.normal(size=(2, 7, 3)), rng.normal(size=(2, 4, 3))
  num = np.array([3, 4], np.int32)
  got = np.asarray(merge_visual(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(visual),
                                jnp.asarray(num), 9, jnp.asarray([0, 1], np.int32)))
  want = x.copy()
  want[0, [1, 2, 4]] = visual[0, :3]  # the 4th placeholder of row 0 has no token: kept
  want[1, [0, 1]] = visual[1, 1:3]  # row 1 starts at its second visual token (offset 1)
  np.testing.assert_allclose(got, want.astype(np.float32), atol=1e-7)


@pytest.mark.slow
def test_tower_gradients_reach_every_parameter():
  """The tower trains: a loss on the visual tokens has finite, non-zero gradients for every
  parameter (the interpolated grid included), and more padding does not change the outputs."""
  import dataclasses
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3jax.vision.projector import Projector
  from k3jax.vision.tower import VisionTower
  from conftest import tiny_config
  cfg = dataclasses.replace(tiny_config().model, vision=VisionConfig(num_layers=1))
  modules = nnx.List([VisionTower(cfg, rngs=nnx.Rngs(0)), Projector(cfg, rngs=nnx.Rngs(1))])
  rng = np.random.default_rng(7)
  items = [vision.preprocess(rng.integers(0, 256, (40, 60, 3), np.uint8), cfg.vision),
           vision.preprocess(rng.integers(0, 256, (2, 28, 28, 3), np.uint8), cfg.vision)]
  encode = nnx.jit(lambda m, a: m[1](m[0](a, jnp.float32))[:, :7])
  arrays = vision.batch([items], max_patches=32)
  np.testing.assert_allclose(np.asarray(encode(modules, vision.batch([items], max_patches=48))),
                             np.asarray(encode(modules, arrays)), atol=1e-6)
  graphdef, params = nnx.split(modules)
  loss = lambda params: jnp.sum(encode(nnx.merge(graphdef, params), arrays) ** 2)
  grads = jax.jit(jax.grad(loss))(params)
  for path, g in nnx.to_flat_state(grads):
    g = np.asarray(g.get_value())
    assert np.isfinite(g).all() and np.abs(g).max() > 0, path


def test_vision_flops_by_hand():
  from k3jax.flops import vision_forward_flops
  from conftest import tiny_config
  import dataclasses
  v = VisionConfig(hidden_size=8, num_heads=2, qkv_size=4, intermediate_size=16, num_layers=3,
                   patch_size=2, video_attention="divided")
  m = dataclasses.replace(tiny_config().model, hidden_size=32, vision=v)
  image = vision.from_patches(np.zeros((16, 12), np.float32), (1, 4, 4), v)  # 4 tokens
  video = vision.from_patches(np.zeros((3 * 4, 12), np.float32), (3, 2, 2), v)  # 1 token
  arrays = vision.batch([[image], [video]], max_patches=20)
  per_patch = 12 * 8 + 3 * (4 * 8 * 4 + 2 * 8 * 16)
  keys = 16 * 16 + 12 * (4 + 3)  # the image sees itself; video patches their frame, then 3 frames
  want = 2 * 28 * per_patch + 2 * 3 * 2 * 4 * keys + 2 * 5 * (32 * 32 + 32 * 32)
  assert vision_forward_flops(m, arrays) == want
  joint = dataclasses.replace(m, vision=dataclasses.replace(v, video_attention="joint"))
  assert vision_forward_flops(joint, arrays) == want + 2 * 3 * 2 * 4 * 12 * (12 - 7)
  assert vision_forward_flops(dataclasses.replace(m, vision=None), arrays) == 0.0


@pytest.mark.slow
def test_generate_with_images_matches_full_forward():
  """Greedy decoding of prompts with images (prefill merges the visual tokens; decode steps are
  text) equals argmax of repeated full forward passes; text prompts get the placeholders after
  BOS; bad image arguments are refused."""
  import jax.numpy as jnp
  from flax import nnx
  from k3jax.generate import GenerateError, generate
  from k3jax.model import K3Model
  from conftest import tiny_config
  cfg = tiny_config("model.vision.num_layers=1").model
  model = K3Model(cfg, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(8)
  items = [vision.preprocess(rng.integers(0, 256, (30, 44, 3), np.uint8), cfg.vision),  # 4 tokens
           vision.preprocess(rng.integers(0, 256, (28, 28, 3), np.uint8), cfg.vision)]  # 1 token
  arrays = vision.batch([[items[0]], [items[1]]], max_patches=32)
  img, bos = cfg.vision.image_token_id, cfg.bos_token_id
  prompts = [[bos] + [img] * 4 + list(b"hi"), [bos, img] + list(b"yo")]
  got = generate(model, prompts, images=arrays, max_new_tokens=3)
  # full forward passes on right-padded rows (causal: the padding does not reach the last token)
  forward = nnx.jit(lambda m, i, a: m(i, vision=a))
  seqs = [list(p) for p in prompts]
  for _ in range(3):
    ids = np.zeros((2, 10), np.int32)
    for b, q in enumerate(seqs):
      ids[b, :len(q)] = q
    logits = np.asarray(forward(model, jnp.asarray(ids), arrays))
    for b, q in enumerate(seqs):
      q.append(int(np.argmax(logits[b, len(q) - 1])))
  assert got == [q[len(p):] for q, p in zip(seqs, prompts)]
  # precomputed visual tokens (a server's image cache) give the same logits
  cached = {"visual_tokens": nnx.jit(lambda m, a: m.encode_images(a))(model, arrays),
            "num_tokens": jnp.asarray(arrays["num_tokens"])}
  np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids), cached)),
                             np.asarray(forward(model, jnp.asarray(ids), arrays)), atol=1e-5)
  from k3jax.tokenizer import ByteTokenizer
  assert generate(model, ["hi", "yo"], images=arrays, max_new_tokens=3, eos_id=-1) == [
      ByteTokenizer().decode(g) for g in got]
  with pytest.raises(GenerateError, match="prompt 0: 3 placeholders, 4 visual tokens"):
    generate(model, [prompts[0][:-3], prompts[1]], images=arrays, max_new_tokens=1)
  with pytest.raises(GenerateError, match="2 rows for 1 prompts"):
    generate(model, prompts[:1], images=arrays, max_new_tokens=1)
  with pytest.raises(GenerateError, match="lacks"):
    generate(model, prompts, images={"num_tokens": arrays["num_tokens"]}, max_new_tokens=1)
  text = K3Model(tiny_config().model, rngs=nnx.Rngs(0))
  with pytest.raises(GenerateError, match="no vision tower"):
    generate(text, prompts, images=arrays, max_new_tokens=1)


@pytest.mark.slow
def test_tower_remat_gives_the_same_gradients():
  import dataclasses
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3jax.vision.tower import VisionTower
  from conftest import tiny_config
  cfg = dataclasses.replace(tiny_config().model, vision=VisionConfig(num_layers=2))
  rng = np.random.default_rng(9)
  item = vision.preprocess(rng.integers(0, 256, (2, 28, 56, 3), np.uint8), cfg.vision)
  arrays = vision.batch([item], max_patches=16)
  grads = []
  for remat in ("none", "full"):
    tower = VisionTower(dataclasses.replace(cfg, remat=remat), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(tower)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(arrays, jnp.float32) ** 2)
    grads.append(jax.tree.leaves(jax.jit(jax.grad(loss))(params)))
  for a, b in zip(*grads):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_from_patches_checks_the_grid_and_video_chunks_split():
  cfg = VisionConfig(rope_max_grid=8, max_patches=64)
  with pytest.raises(VisionError, match="do not fit grid"):
    vision.from_patches(np.zeros((10, 588), np.float32), (1, 2, 4), cfg)
  with pytest.raises(VisionError, match="rotary table covers 8"):
    vision.from_patches(np.zeros((20, 588), np.float32), (1, 2, 10), cfg)
  with pytest.raises(VisionError, match="max_patches=64"):
    vision.from_patches(np.zeros((80, 588), np.float32), (1, 8, 10), VisionConfig(max_patches=64))
  frames = np.zeros((10, 5, 6, 3), np.uint8)
  assert [c.shape[0] for c in vision.video_chunks(frames, VisionConfig())] == [4, 4, 2]


def test_released_k3_tower_size():
  """The released K3 tower and projector (27 x 1024, qkv 1536, MLP 4096, patchmerger_v2 into
  7168): 447,358,976 parameters, counted apart from the text model's active ones."""
  from k3jax.convert.hf_vision import K3_VISION_CONFIG, vision_from_hf
  from k3jax.info import param_counts
  from conftest import tiny_config
  fields = vision_from_hf(K3_VISION_CONFIG, 7168, 163605)
  wide = ["model.hidden_size=7168", "model.vocab_size=163840", "model.num_layers=1",
          "model.mla_layers=[0]"]
  text = param_counts(tiny_config(*wide).model)
  both = param_counts(tiny_config(*wide, f"model.vision={fields}").model)
  assert both["components"]["vision"] == 447_358_976
  assert both["active_params"] == text["active_params"]
  assert both["total_params"] == text["total_params"] + 447_358_976


def test_rgba_on_the_chessboard_or_dropped():
  """K3 resizes an RGBA image (premultiplied) and then composites it onto 8-pixel white / grey
  squares; K2.5 drops alpha first."""
  from PIL import Image
  rng = np.random.default_rng(10)
  rgba = rng.integers(0, 256, (84, 112, 4), np.uint8)
  cfg = VisionConfig(in_patch_limit=16)  # resized to 56 x 42
  plan = vision.resize_plan(84, 112, cfg)
  small = np.asarray(Image.fromarray(rgba).resize((plan.width, plan.height),
                                                  Image.Resampling.BICUBIC)).astype(np.float64)
  y, x = np.mgrid[:plan.height, :plan.width]
  board = np.where((y // 8 + x // 8) % 2 == 0, 255.0, 180.0)[..., None]
  a = small[..., 3:] / 255.0
  rgb = np.floor(a * small[..., :3] + (1 - a) * board + 1e-4).astype(np.uint8)
  item = vision.preprocess(rgba, cfg)
  for n in (0, 7):
    t, r, c = item.positions[n]
    full = np.zeros((plan.grid[1] * 14, plan.grid[2] * 14, 3))
    full[:plan.height, :plan.width] = rgb
    want = (full[r * 14:(r + 1) * 14, c * 14:(c + 1) * 14] / 255.0 - 0.5) / 0.5
    np.testing.assert_allclose(item.patches[n], want.transpose(2, 0, 1).ravel(), atol=1e-2 + 2e-6)
  dropped = vision.preprocess(rgba, VisionConfig(in_patch_limit=16, alpha="drop"))
  np.testing.assert_array_equal(dropped.patches,
                                vision.preprocess(rgba[..., :3].copy(), cfg).patches)
  opaque = rgba.copy()
  opaque[..., 3] = 255
  np.testing.assert_array_equal(vision.preprocess(opaque, cfg).patches,
                                vision.preprocess(rgba[..., :3].copy(), cfg).patches)


def test_default_max_patches_holds_every_resized_image():
  """The default hard limit leaves room for the resize rule's rounding and padding: no image up
  to max_pixels is refused for its patch count."""
  cfg = VisionConfig()
  side = int(cfg.max_pixels ** 0.5)
  worst = max(vision.resize_plan(h, w, cfg).num_patches
              for h in range(1, side + 1, 151) for w in range(1, side + 1, 149))
  assert 65536 < worst <= cfg.max_patches


def test_preprocess_matches_the_reference_processor():
  """Images scaled by the patch limit, by the side limit and not at all, and a 3-frame chunk
  (the per-frame limit), through the K2.5 processor's functions (tools/make_vision_golden.py):
  the same patches bit for bit, the same grid and token count."""
  ref = np.load(GOLDEN / "processor.npz")
  cfg = VisionConfig(patch_size=4, in_patch_limit=64, frame_patch_limit=32, side_limit=16,
                     image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
  scaled = set()
  for i in range(4):
    image = ref[f"image_{i}"]
    item = vision.preprocess(image, cfg)
    want = vision.from_patches(ref[f"pixel_values_{i}"], tuple(ref[f"grid_{i}"]), cfg)
    assert item.grid == want.grid and item.num_tokens == int(ref[f"tokens_{i}"])
    np.testing.assert_array_equal(item.patches, want.patches)
    np.testing.assert_array_equal(item.positions, want.positions)
    shape = image.shape[-3:-1]
    scaled.add(item.grid[1] * 4 < shape[0] or item.grid[2] * 4 < shape[1])
  assert scaled == {True, False}
