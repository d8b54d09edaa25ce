"""Gated NoPE MLA (SPEC section 3).

Queries ``[H, nope + rope]`` from ``q_proj`` or the q LoRA path; keys ``[k_nope, k_r]`` with the
64-dim ``k_r`` shared by all heads and never rotated; softmax scale ``(nope + rope) ** -0.5``;
optional output gate ``attn * sigmoid(g_proj(x))``.

Decoding caches, per token, the normalised latent ``c`` (kv_lora_rank) and ``k_r`` (rope dim):
576 values for K3. ``kv_b_proj`` is absorbed into the query (``W_uk``) and output (``W_uv``)
sides, so decode attention runs directly on the latent cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels.mla as mla_ops
from k3jax.config import ModelConfig
from k3jax.nn import Linear, RMSNorm, head_major, per_shard
from sharding import context_parallel
from sharding.rules import logical_spec, per_device, shard

PAGE_SIZE = 64


class MLA(nnx.Module):
  """x ``[B, T, d]`` -> ``[B, T, d]``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    a = cfg.mla
    self.cfg = cfg
    d, dt, std = cfg.hidden_size, cfg.pdtype, cfg.init_std
    h, dq = a.num_heads, a.qk_head_dim
    if a.q_lora_rank:
      self.q_a_proj = Linear(d, a.q_lora_rank, ("embed", None), rngs=rngs, dtype=dt, std=std)
      self.q_a_layernorm = RMSNorm(a.q_lora_rank, a.norm_eps, rngs=rngs, dtype=dt, name=None)
      self.q_b_proj = Linear(a.q_lora_rank, h * dq, (None, "heads"), rngs=rngs, dtype=dt, std=std)
    else:
      self.q_proj = Linear(d, h * dq, ("embed", "heads"), rngs=rngs, dtype=dt, std=std)
    self.kv_a_proj_with_mqa = Linear(d, a.kv_lora_rank + a.qk_rope_head_dim, ("embed", "kv"),
                                     rngs=rngs, dtype=dt, std=std)
    self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, a.norm_eps, rngs=rngs, dtype=dt, name="kv")
    self.kv_b_proj = Linear(a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), ("kv", "heads"),
                            rngs=rngs, dtype=dt, std=std)
    if a.output_gate:
      self.g_proj = Linear(d, h * a.v_head_dim, ("embed", "heads"), rngs=rngs, dtype=dt, std=std)
    self.o_proj = Linear(h * a.v_head_dim, d, ("heads", "embed"), rngs=rngs, dtype=dt,
                         std=std / math.sqrt(2 * cfg.num_layers))

  @property
  def scale(self) -> float:
    return self.cfg.mla.qk_head_dim ** -0.5

  def init_cache(self, batch: int, max_len: int) -> dict:
    """Latent cache ``[B, max_len, kv_lora_rank + rope]`` (max_len a multiple of PAGE_SIZE)."""
    a = self.cfg.mla
    return {"latent": jnp.zeros((batch, max_len, a.kv_lora_rank + a.qk_rope_head_dim),
                                self.cfg.cdtype)}

  def _queries(self, x):
    a = self.cfg.mla
    b, t, _ = x.shape
    q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if a.q_lora_rank else self.q_proj(x)
    return shard(q.reshape(b, t, a.num_heads, a.qk_head_dim), ("batch", "length", "heads", None))

  def _latent(self, x):
    """``[B, T, R + Dr]``: the normalised latent c and the shared key part k_r."""
    return self._normed_latent(self.kv_a_proj_with_mqa(x))

  def _normed_latent(self, kv):
    r = self.cfg.mla.kv_lora_rank
    return jnp.concatenate([self.kv_a_layernorm(kv[..., :r]), kv[..., r:]], axis=-1)

  @property
  def fused(self) -> bool:
    """Whether this layer is in the serving layout (:meth:`fuse_inputs`)."""
    return "in_proj" in vars(self)

  def fuse_inputs(self, shards: int) -> None:
    """Turns this layer into the serving layout for ``shards`` head shards (the mesh's ``tensor``
    size): the projections of x (q or q_a, kv_a and the output gate) become one weight ``in_proj
    [d, shards, P]`` (:func:`k3jax.nn.head_major`: each shard's heads of q and the gate, then q_a
    and kv_a repeated), one matmul per layer and step; ``kv_b_proj`` becomes its absorbed halves
    ``w_uk [R, H, nope]`` and ``w_uv [R, H, v]``. The serving engine calls this on its own copy of
    the model; checkpoints and training keep the separate parameters."""
    a = self.cfg.mla
    if a.num_heads % shards:
      raise ValueError(f"MLA.fuse_inputs: {a.num_heads} heads do not split into {shards} shards")
    sharded = (() if a.q_lora_rank else ("q_proj",)) + (("g_proj",) if a.output_gate else ())
    whole = (("q_a_proj",) if a.q_lora_rank else ()) + ("kv_a_proj_with_mqa",)
    kernel = lambda name: getattr(self, name).kernel[...]
    self.in_proj = head_major([kernel(n) for n in sharded], [kernel(n) for n in whole], shards)
    self.shards = shards
    w_kv = self.kv_b_proj.kernel[...].reshape(a.kv_lora_rank, a.num_heads, -1)
    half = lambda w: nnx.Param(w, sharding_names=("kv", "heads", None), eager_sharding=False)
    self.w_uk, self.w_uv = half(w_kv[..., :a.qk_nope_head_dim]), half(w_kv[..., a.qk_nope_head_dim:])
    for n in sharded + whole + ("kv_b_proj",):
      delattr(self, n)

  def _fused_inputs(self, x):
    """The serving layout's queries ``[B, T, H, Dq]``, latents ``[B, T, R + Dr]`` and output
    gate logits ``[B, T, H * Dv]`` (None without the gate) from x ``[B, T, d]``."""
    a = self.cfg.mla
    b, t, _ = x.shape
    s, h = self.shards, a.num_heads
    y = jnp.einsum("btd,dsp->btsp", x, self.in_proj[...].astype(x.dtype))
    y = shard(y, ("batch", "length", "heads", None))
    sizes = ([] if a.q_lora_rank else [h * a.qk_head_dim // s]) + (
        [h * a.v_head_dim // s] if a.output_gate else []) + (
        [a.q_lora_rank] if a.q_lora_rank else []) + [a.kv_lora_rank + a.qk_rope_head_dim]
    parts = jnp.split(y, np.cumsum(sizes)[:-1], axis=-1)
    q = parts.pop(0).reshape(b, t, -1) if not a.q_lora_rank else None
    gate = parts.pop(0).reshape(b, t, -1) if a.output_gate else None
    if a.q_lora_rank:
      q = per_shard(self.q_a_layernorm(parts.pop(0)), self.q_b_proj.kernel[...])
    # every shard holds the whole latent: one copy of it
    lat = self._normed_latent(parts.pop(0)[:, :, 0])
    q = shard(q.reshape(b, t, h, a.qk_head_dim), ("batch", "length", "heads", None))
    return q, lat, gate

  def _output(self, x, o, gate=None):
    """The gated output projection; ``gate``: the output gate's logits when computed already
    (the serving layout), else from x."""
    a = self.cfg.mla
    b, t = x.shape[:2]
    o = o.reshape(b, t, a.num_heads * a.v_head_dim)
    if a.output_gate:
      o = o * jax.nn.sigmoid(self.g_proj(x) if gate is None else gate).astype(o.dtype)
    return self.o_proj(o)

  def __call__(self, x: jax.Array, *, segment_ids=None, valid=None, cache=None, decode=False,
               lengths=None):
    """x ``[B, T, d]``. Training/prefill: causal (and segment-masked) attention over x; with a
    contiguous cache (:meth:`init_cache`), the latents of x are written at positions
    ``0..T-1``. Decode (``decode=True``), and every call with a paged cache ``{"pages"
    [P, page_size, R + Dr], "page_table" [B, max_pages]}`` (the serving engine's; page 0 takes
    the writes of unmapped positions): x holds ``T`` new tokens per row written at ``lengths - T
    .. lengths - 1`` (``lengths [B]``: cached tokens including the new ones) and attention runs on
    the latent cache, the new tokens attending causally. Returns (y ``[B, T, d]``, new cache or
    None)."""
    del valid  # padding sits after the valid tokens: causal masking already hides it
    a = self.cfg.mla
    b, t, _ = x.shape
    h, r = a.num_heads, a.kv_lora_rank
    if self.fused:
      q, lat, gate = self._fused_inputs(x)
    else:
      q, lat, gate = self._queries(x), self._latent(x), None  # lat [B, T, R + Dr]
    if self.fused:  # kv_b_proj's halves held apart: a step slices no parameter
      w_uk, w_uv = self.w_uk[...].astype(x.dtype), self.w_uv[...].astype(x.dtype)
      w_kv = jnp.concatenate([w_uk, w_uv], -1)
    else:
      w_kv = self.kv_b_proj.kernel[...].astype(x.dtype).reshape(r, h, -1)
      w_uk, w_uv = w_kv[..., :a.qk_nope_head_dim], w_kv[..., a.qk_nope_head_dim:]
    paged = cache is not None and "pages" in cache
    if not decode and not paged and cache is None and context_parallel.active():
      o = context_parallel.mla_attention(q, lat, w_kv, segment_ids=segment_ids, scale=self.scale,
                                         nope_dim=a.qk_nope_head_dim,
                                         implementation=a.implementation)
      return self._output(x, o), None
    if not decode and not paged:
      kv = jnp.einsum("btr,rhd->bthd", lat[..., :r], w_kv)
      k_nope, v = kv[..., :a.qk_nope_head_dim], kv[..., a.qk_nope_head_dim:]
      k_r = jnp.broadcast_to(lat[:, :, None, r:], (b, t, h, a.qk_rope_head_dim))
      k = shard(jnp.concatenate([k_nope, k_r], -1), ("batch", "length", "heads", None))
      v = shard(v, ("batch", "length", "heads", None))
      tok = logical_spec(("batch", "length", "heads", None))
      attend = lambda q, k, v, seg: mla_ops.mla_attention(
          q, k, v, segment_ids=seg, causal=True, scale=self.scale, implementation=a.implementation)
      # per row and head on each device's share
      o = per_device(attend, (tok, tok, tok, P(*tok[:2])), tok)(q, k, v, segment_ids)
      new_cache = None
      if cache is not None:
        new_cache = {"latent": jax.lax.dynamic_update_slice_in_dim(
            cache["latent"], lat.astype(cache["latent"].dtype), 0, axis=1)}
      return self._output(x, o), new_cache
    # Write the new latents, then absorbed attention on the paged view of the cache.
    pos = lengths[:, None] - t + jnp.arange(t)[None, :]  # [B, T]
    if paged:
      pages, page_table = cache["pages"], cache["page_table"]
      ps, width = pages.shape[1], page_table.shape[1]
      col = pos // ps
      page = jnp.take_along_axis(page_table, jnp.minimum(col, width - 1), axis=1)
      page = jnp.where(col < width, page, 0)
      pages = pages.at[page, pos % ps].set(lat.astype(pages.dtype))
      new_cache = {"pages": pages, "page_table": page_table}
    else:
      latent = cache["latent"].at[jnp.arange(b)[:, None], pos].set(lat.astype(cache["latent"].dtype))
      max_len = latent.shape[1]
      pages = latent.reshape(b * (max_len // PAGE_SIZE), PAGE_SIZE, latent.shape[-1])
      page_table = jnp.arange(b * (max_len // PAGE_SIZE), dtype=jnp.int32).reshape(b, -1)
      new_cache = {"latent": latent}
    q_abs = jnp.concatenate(
        [jnp.einsum("bthd,rhd->bthr", q[..., :a.qk_nope_head_dim], w_uk), q[..., a.qk_nope_head_dim:]], -1)
    o_lat = mla_ops.mla_decode(q_abs, pages, page_table, lengths.astype(jnp.int32),
                               kv_lora_rank=r, scale=self.scale, implementation=a.implementation)
    o = jnp.einsum("bthr,rhd->bthd", o_lat.astype(x.dtype), w_uv)
    return self._output(x, o, gate), new_cache
