"""MoonViT-V2: patch embedding, the encoder and the pixel shuffle, on ``batch``'s arrays.

Reference: the public K3 loaders' MoonViT3d, ``nemo_automodel/components/models/kimi_k3/
vision.py`` of NVIDIA-NeMo/Automodel at commit 10ceda1be02807a01f6adc2a3d21328e9279fd0a ("modified
for Kimi-K3"; Kimi K2.5's ``modeling_kimi_k25.py`` tower of moonshotai/Kimi-K2.5 with K3's
switches added). tests/golden/moonvit_tiny holds its outputs with K3's settings and with K2.5's
(tools/make_vision_golden.py); this module matches both to 1e-5 in float32. The computation:

- patch embedding: the ``C x p x p`` conv with stride p is a matmul of each flattened patch; the
  learned ``[H0, W0, D]`` grid resized to the image's patch grid is added (bilinear for K3,
  bicubic for K2.5, as ``F.interpolate`` with ``align_corners=False``), plus a fixed sin-cos
  embedding of the frame index for the frames of a video chunk (not for single images);
- ``num_layers`` pre-norm blocks: ``x + wo(attn(rope(wqkv(norm0(x)))))``, ``x + fc1(gelu_tanh(
  fc0(norm1(x))))``; 2D rotary embedding on q and k (:mod:`k3jax.vision.rope`); bidirectional
  attention within each item (segment ids), never across items;
- a final norm; then each ``kh x kw`` block of patches is concatenated into one visual token
  (pixel shuffle) and a chunk's frames are averaged (``temporal_pool``, ``sd2_tpool``).

Switches (K3's released values are the defaults, K2.5's the other setting): ``norm`` (RMSNorm /
LayerNorm), the three bias flags, ``qkv_size``, ``pos_emb_interpolation``, ``projector``
(``patchmerger_v2``: Linear, GELU, Linear without biases, then RMSNorm into the text width /
``patchmerger``: LayerNorm, Linear, GELU, Linear) and ``alpha`` (RGBA input, host side).

Where this tower differs from the reference, and why:

- ``video_attention: divided`` (the default): SPEC section 6 says K3 splits video attention
  into a spatial pass within a frame and a temporal pass across frames, with parameters shared
  with images. The reference (and K2.5's, whose ``video_attn_type: spatial_temporal`` means the
  same) attends jointly over all patches of a chunk. No public K3 code shows the split, so it is
  our reading: each block runs the spatial pass (segments = frames) and then, for video patches
  only, a temporal pass (segments = one patch position across the chunk's frames) with the same
  ``norm0``, ``wqkv`` and ``wo``; images see exactly the reference block. ``joint`` is the
  reference (and what converted checkpoints get).
- K3's RMSNorm takes ``eps=None`` in the reference: torch then uses the input dtype's epsilon
  (1.2e-7 in float32, 7.8e-3 in bfloat16). ``norm_eps`` is fixed at float32's epsilon, so a
  bfloat16 run normalises as the float32 reference does, not as a bfloat16 torch run would.
- The patches are stored in merge-block order (the reference: row-major per frame) and the
  rotary angles are computed per patch (the reference slices a 512 x 512 table); attention runs
  on the MLA kernels (the reference: flash-attention varlen or eager), a head dim that is not a
  multiple of 16 zero-padded. None of these changes a value beyond float rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.vision.attention import packed_attention
from k3jax.vision.layers import MLP2, Dense, Norm
from k3jax.vision.pos_emb import PositionalGrid
from k3jax.vision.rope import apply_rope, rope_angles
from sharding.rules import shard

_ACT = ("batch", None, "embed")


class PatchEmbed(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v, dt, std = cfg.vision, cfg.pdtype, cfg.init_std
    self.proj = Dense(v.channels * v.patch_size ** 2, v.hidden_size, ("patch", "embed"),
                      bias=v.patch_bias, rngs=rngs, dtype=dt, std=std)
    self.pos_emb = PositionalGrid(v.pos_emb_height, v.pos_emb_width, v.pos_emb_frames,
                                  v.hidden_size, rngs=rngs, dtype=dt, std=std)

  def __call__(self, arrays: dict, dtype) -> jax.Array:
    x = self.proj(arrays["patches"].astype(dtype))
    return x + self.pos_emb(arrays, dtype)


class EncoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v, dt, std = cfg.vision, cfg.pdtype, cfg.init_std
    d = v.hidden_size
    self.heads, self.head_dim = v.num_heads, v.head_dim
    self.divided = v.video_attention == "divided"
    self.implementation = cfg.mla.implementation
    self.norm0 = Norm(d, v.norm, v.norm_eps, rngs=rngs, dtype=dt)
    self.norm1 = Norm(d, v.norm, v.norm_eps, rngs=rngs, dtype=dt)
    a = v.attn_size
    self.wqkv = Dense(d, 3 * a, ("embed", "heads"), bias=v.attn_bias, rngs=rngs, dtype=dt, std=std)
    self.wo = Dense(a, d, ("heads", "embed"), bias=v.attn_bias, rngs=rngs, dtype=dt, std=std)
    self.mlp = MLP2(d, v.intermediate_size, bias=v.mlp_bias, rngs=rngs, dtype=dt, std=std)

  def _attention(self, x, segment_ids, cos, sin):
    b, p, _ = x.shape
    qkv = self.wqkv(self.norm0(x)).reshape(b, p, 3, self.heads, self.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = packed_attention(q, k, v, segment_ids, self.implementation)
    return self.wo(o.reshape(b, p, -1))

  def __call__(self, x, arrays, cos, sin):
    if not self.divided:
      x = x + self._attention(x, arrays["segment_ids"], cos, sin)
    else:
      x = x + self._attention(x, arrays["frame_ids"], cos, sin)
      x = shard(x, _ACT)
      order, inverse = arrays["temporal_order"], arrays["temporal_inverse"]
      take = lambda t: jnp.take_along_axis(t, order[..., None], axis=1)
      is_video = (arrays["times"] >= 0)[..., None]
      temporal = lambda x: jnp.take_along_axis(
          self._attention(take(x), arrays["temporal_ids"], take(cos), take(sin)),
          inverse[..., None], axis=1)
      # the temporal pass only where a row holds a video chunk
      x = x + jax.lax.cond(jnp.any(is_video), lambda: jnp.where(is_video, temporal(x), 0),
                           lambda: jnp.zeros_like(x)).astype(x.dtype)
    x = shard(x, _ACT)
    return shard(x + self.mlp(self.norm1(x)), _ACT)


class Encoder(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v = cfg.vision
    self.blocks = nnx.List([EncoderLayer(cfg, rngs=rngs) for _ in range(v.num_layers)])
    self.final_layernorm = Norm(v.hidden_size, v.norm, v.norm_eps, rngs=rngs, dtype=cfg.pdtype)
    self.head_dim, self.theta = v.head_dim, v.rope_theta
    # under any model.remat policy the backward recomputes each block from its input
    self.remat = cfg.remat != "none"

  def __call__(self, x, arrays):
    cos, sin = rope_angles(arrays["positions"], self.head_dim, self.theta)
    # the divided temporal pass gathers into temporal order and back
    arrays = {**arrays, "temporal_inverse": jnp.argsort(arrays["temporal_order"], axis=1)}
    run = nnx.remat(_run_block) if self.remat else _run_block
    for block in self.blocks:
      x = run(block, x, arrays, cos, sin)
    return self.final_layernorm(x)


def _run_block(block, x, arrays, cos, sin):
  return block(x, arrays, cos, sin)


def pixel_shuffle(x: jax.Array, token_ids: jax.Array, merge: int) -> jax.Array:
  """x ``[B, P, D]`` (patches in merge-block order) -> visual tokens ``[B, M, merge, D]``
  (``M = P / merge``): each run of ``merge`` patches is one token's block; blocks fed to the same
  token (one position in several frames of a chunk) are averaged; rows past the row's tokens
  are zero."""
  b, p, d = x.shape
  groups = x.reshape(b, p // merge, merge * d)
  m = groups.shape[1]
  acc = jnp.promote_types(x.dtype, jnp.float32)
  summed = jax.vmap(lambda g, t: jax.ops.segment_sum(g.astype(acc), t, num_segments=m))(
      groups, token_ids)
  count = jax.vmap(lambda t: jax.ops.segment_sum(jnp.ones_like(t, acc), t, num_segments=m))(
      token_ids)
  tokens = summed / jnp.maximum(count, 1)[..., None]
  return tokens.astype(x.dtype).reshape(b, m, merge, d)


class VisionTower(nnx.Module):
  """``batch``'s arrays -> the tower's visual tokens ``[B, M, merge, D]`` before the projector."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.patch_embed = PatchEmbed(cfg, rngs=rngs)
    self.encoder = Encoder(cfg, rngs=rngs)
    self.merge = cfg.vision.merge

  def __call__(self, arrays: dict, dtype) -> jax.Array:
    x = shard(self.patch_embed(arrays, dtype), _ACT)
    x = self.encoder(x, arrays)
    return pixel_shuffle(x, arrays["token_ids"], self.merge)
