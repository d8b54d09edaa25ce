"""The Kimi K3 / Kimi Linear decoder: embedding, hybrid KDA/MLA layers with dense or LatentMoE
MLPs, Block Attention Residuals (or plain residuals), final norm and an untied head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.attn_res import AttnRes, BlockBuffer
from k3jax.config import ModelConfig
from k3jax.glu import GLU
from k3jax.kda import KDA
from k3jax.latent_moe import LatentMoE
from k3jax.mla import MLA
from k3jax.nn import Embed, Linear, RMSNorm
from k3jax.scan import balance_barrier, run_groups, run_layers
from k3jax.vision.merge import merge_visual
from k3jax.vision.projector import Projector
from k3jax.vision.tower import VisionTower
from pallas_kernels import KERNEL_OUTPUT
from pallas_kernels.moe.permute_gpu import EXPAND_KERNEL
from sharding.rules import shard

_ACT = ("batch", "length", "embed")
# Kernels whose outputs "dots_kernels" recomputes all the same: the MoE's token expansion is a
# row gather, cheaper to redo than to keep (benchmarks/RESULTS.md, Training run 26).
_RECOMPUTED_KERNELS = (EXPAND_KERNEL,)
_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # The Pallas kernels' outputs too: the backward then reruns no forward kernel of the layer
    # (under "dots" each KDA forward kernel runs three times per step).
    # Mosaic GPU kernels (the grouped matmuls) are ``mpmd_map`` calls inside ``custom_vmap``,
    # which no primitive policy sees: their wrappers name their outputs instead.
    "dots_kernels": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            lambda prim, *_, **params: prim.name == "pallas_call"
            and params.get("name") not in _RECOMPUTED_KERNELS),
        jax.checkpoint_policies.save_only_these_names(KERNEL_OUTPUT)),
}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _shared_call(graphdef, static: tuple, state, args: tuple, kw: dict):
  """``nnx.merge(graphdef, state)(*args, **kw, **dict(static))`` as a jitted function: inside a
  step the modules of one graphdef (every KDA layer, every MoE of one config) called on the same
  shapes trace once and lower once, their Pallas kernels included, and XLA inlines the calls."""
  return nnx.merge(graphdef, state)(*args, **kw, **dict(static))


def _call_once(module, *args, static: dict | None = None, decoding: bool = False, **kw):
  """``module(*args, **static, **kw)`` through :func:`_shared_call` (``static``: the hashable
  keyword arguments; the rest are pytrees of arrays): how a decoder layer calls its mixer, MLP
  and AttnRes, in training as in decoding. With ``decoding`` a MoE decodes
  (``LatentMoE(decoding=True)``: no router statistics, and few tokens run every expert densely)."""
  graphdef, state = nnx.split(module)
  if decoding and isinstance(module, LatentMoE):
    static = dict(static or {}, decoding=True)
  return _shared_call(graphdef, tuple(sorted((static or {}).items())), state, args, kw)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, idx: int, *, rngs: nnx.Rngs):
    self.idx = idx
    self.kind = cfg.layer_kind(idx)
    self.moe = cfg.is_moe(idx)
    self.attn_res_on = cfg.attn_res.enabled
    self.block_size = cfg.attn_res.block_size
    d, eps, dt = cfg.hidden_size, cfg.rms_norm_eps, cfg.pdtype
    self.input_layernorm = RMSNorm(d, eps, rngs=rngs, dtype=dt)
    self.post_attention_layernorm = RMSNorm(d, eps, rngs=rngs, dtype=dt)
    self.self_attn = MLA(cfg, rngs=rngs) if self.kind == "mla" else KDA(cfg, rngs=rngs)
    self.mlp = LatentMoE(cfg, rngs=rngs) if self.moe else GLU(cfg, cfg.dense_intermediate, rngs=rngs)
    if self.attn_res_on:
      impl = cfg.attn_res.implementation
      self.self_attention_res = AttnRes(d, eps, rngs=rngs, dtype=dt, implementation=impl)
      self.mlp_res = AttnRes(d, eps, rngs=rngs, dtype=dt, implementation=impl)

  def _mlp(self, x, valid, call):
    if self.moe:
      return call(self.mlp, x, valid=valid)
    return call(self.mlp, x), None

  def __call__(self, prefix, blocks, *, segment_ids=None, valid=None, cache=None, decode=False,
               lengths=None, idx=None):
    """One decoder layer.

    With AttnRes, ``prefix`` is the current block's partial sum and ``blocks`` the committed
    block summaries (a tuple of ``[B, T, d]``, or inside a layer scan a
    :class:`~k3jax.attn_res.BlockBuffer` and ``idx`` the layer's traced index); without it
    ``prefix`` is the residual stream and ``blocks`` stays empty. Returns (prefix, blocks, new
    cache, router stats or None).
    """
    attn_kw = dict(segment_ids=segment_ids, valid=valid, cache=cache)
    if self.kind == "mla":
      attn_kw["lengths"] = lengths
    call = functools.partial(_call_once, decoding=cache is not None)
    mixer = jax.named_scope(self.kind)  # profile scopes: kda / mla, moe / mlp, attn_res
    ffn = jax.named_scope("moe" if self.moe else "mlp")
    if not self.attn_res_on:
      with mixer:
        a, cache = call(self.self_attn, self.input_layernorm(prefix), static={"decode": decode},
                       **attn_kw)
      x = shard(prefix + a, _ACT)
      with ffn:
        m, stats = self._mlp(self.post_attention_layernorm(x), valid, call)
      return shard(x + m, _ACT), blocks, cache, stats
    with jax.named_scope("attn_res"):
      if isinstance(blocks, BlockBuffer):
        h = blocks.mix(self.self_attention_res, prefix)
        blocks, prefix = blocks.commit(prefix, idx % self.block_size == 0)
      else:
        h = call(self.self_attention_res, blocks + (prefix,)) if blocks else prefix
        if self.idx % self.block_size == 0:
          blocks, prefix = blocks + (prefix,), None
    with mixer:
      a, cache = call(self.self_attn, self.input_layernorm(h), static={"decode": decode}, **attn_kw)
    prefix = a if prefix is None else prefix + a
    with jax.named_scope("attn_res"):
      if isinstance(blocks, BlockBuffer):
        h = blocks.mix(self.mlp_res, prefix)
      else:
        h = call(self.mlp_res, blocks + (prefix,))
    with ffn:
      m, stats = self._mlp(self.post_attention_layernorm(h), valid, call)
    return shard(prefix + m, _ACT), blocks, cache, stats


def _apply_layer(layer, x, blocks, segment_ids, valid, cache, decode, lengths, idx=None):
  return layer(x, blocks, segment_ids=segment_ids, valid=valid, cache=cache, decode=decode,
               lengths=lengths, idx=idx)


def _tie_cotangents(f):
  """``f`` (pytrees of arrays in and out) whose backward hands out all its input cotangents at
  once (``lax.optimization_barrier``); the same values as ``f``'s own VJP."""
  g = jax.custom_vjp(f)

  def bwd(vjp, ct):
    leaves, tree = jax.tree.flatten(vjp(ct))
    real = [i for i, v in enumerate(leaves) if v.dtype != jax.dtypes.float0]
    for i, v in zip(real, jax.lax.optimization_barrier([leaves[i] for i in real])):
      leaves[i] = v
    return tree.unflatten(leaves)

  g.defvjp(lambda *args: jax.vjp(f, *args), bwd)
  return g


def _tied(fn):
  """``fn`` (an :func:`_apply_layer`) whose backward yields the layer's parameter gradients with
  its input gradients (``model.layer_grad_barrier``): the layer below starts its backward only
  once this layer's weight gradients (the grouped matmuls' ``tgmm``, the per-channel gradients
  summed over tokens, their reductions over the mesh) are done, so none of their operands
  stays live into it."""
  def call(layer, x, blocks, segment_ids, valid, cache, decode, lengths, idx=None):
    graphdef, state = nnx.split(layer)
    pure = lambda state, x, blocks, segment_ids, valid, idx: fn(
        nnx.merge(graphdef, state), x, blocks, segment_ids, valid, cache, decode, lengths, idx)
    return _tie_cotangents(pure)(state, x, blocks, segment_ids, valid, idx)
  return call


def layer_call(cfg: ModelConfig, i: int, cache=None):
  """What :meth:`K3Model.hidden` calls for layer ``i``: ``f(layer, x, blocks, segment_ids, valid,
  cache, decode, lengths, idx=None)``, under ``cfg.remat``'s policy when layer ``i`` is a remat layer and
  there is no decode cache."""
  fn = _apply_layer
  if cfg.is_remat(i) and cache is None:
    fn = nnx.remat(_apply_layer, policy=_REMAT_POLICIES[cfg.remat], static_argnums=(6,))
  if cfg.layer_grad_barrier and cache is None:
    fn = _tied(fn)
  return fn


class K3Model(nnx.Module):
  """Kimi K3 (``arch: kimi_k3``) or Kimi Linear (``arch: kimi_linear``) language model."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, dt = cfg.hidden_size, cfg.pdtype
    self.embed_tokens = Embed(cfg.vocab_size, d, rngs=rngs, dtype=dt, std=cfg.init_std)
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    if cfg.attn_res.enabled:
      self.output_attn_res = AttnRes(d, cfg.rms_norm_eps, rngs=rngs, dtype=dt,
                                     implementation=cfg.attn_res.implementation)
    self.norm = RMSNorm(d, cfg.rms_norm_eps, rngs=rngs, dtype=dt)
    self.lm_head = Linear(d, cfg.vocab_size, ("embed", "vocab"), rngs=rngs, dtype=dt,
                          std=cfg.init_std)
    if cfg.vision is not None:
      self.vision_tower = VisionTower(cfg, rngs=rngs)
      self.mm_projector = Projector(cfg, rngs=rngs)

  def encode_images(self, arrays: dict) -> jax.Array:
    """:func:`k3jax.vision.batch`'s arrays -> the rows' visual tokens ``[B, M, d]`` in the
    embedding width (rows past a row's ``num_tokens`` are padding)."""
    if self.cfg.vision is None:
      raise ValueError("encode_images: the model has no vision tower (model.vision is null)")
    with jax.named_scope("vision"):
      return self.mm_projector(self.vision_tower(arrays, self.cfg.cdtype))

  def hidden(self, input_ids, *, segment_ids=None, valid=None, cache=None, decode=False,
             lengths=None, vision=None, stacked=None):
    """input_ids ``[B, T]`` int32 -> (h ``[B, T, d]`` after the final norm, aux).

    vision: None (text only) or a dict with ``num_tokens`` ``[B]`` and either
    :func:`k3jax.vision.batch`'s arrays (encoded here) or ``visual_tokens`` ``[B, M, d]`` from
    :meth:`encode_images`; optional ``token_offset`` ``[B]`` (placeholders before this window).
    Each row's ``image_token_id`` positions take its visual tokens in order. ``stacked``: the
    scanned layers' parameters stacked by position, in place of the layers' own
    (:func:`k3jax.layer_stacks.merge`).

    aux: ``{"moe": {layer index (str): {"load": [E], "bias_stat": ...}}}`` (empty with a cache:
    decoding computes no router statistics) and, with a cache, ``{"cache": [per-layer caches]}``. ``valid`` ``[B, T]`` marks real tokens (defaults to
    ``segment_ids > 0`` when segment ids are given).
    """
    cfg = self.cfg
    if stacked is not None and cache is not None:
      raise ValueError("hidden: decoding runs the layers unrolled; merge the model with one entry "
                       "per layer (TrainState.model()), not with stacked parameters")
    if valid is None and segment_ids is not None:
      valid = segment_ids > 0
    with jax.named_scope("embed"):
      x = shard(self.embed_tokens(input_ids, cfg.cdtype), _ACT)
    if vision is not None:
      visual = vision.get("visual_tokens")
      visual = self.encode_images(vision) if visual is None else visual
      x = shard(merge_visual(x, input_ids, visual, vision["num_tokens"], cfg.vision.image_token_id,
                             vision.get("token_offset")), _ACT)
    blocks: tuple = ()
    moe_stats, caches = {}, []
    scanned = cfg.scan_layers and cache is None  # decoding runs every layer unrolled
    start, period, groups = cfg.layer_groups() if scanned else (0, 1, 0)
    runs = dict(cfg.layer_runs()) if scanned else {}
    done = 0  # the layers before this one that ran in a scan (k3jax/scan.py)
    for i, layer in enumerate(self.layers):
      if i < done:
        continue
      if groups and i == start:
        x, blocks, stats = run_groups(cfg, self.layers, layer_call, x, blocks, segment_ids,
                                      valid, stacked)
        moe_stats.update(stats)
        done = start + period * groups
        continue
      if runs.get(i, 1) > 1:
        done = i + runs[i]
        x, blocks, stats = run_layers(layer_call(cfg, i), [self.layers[j] for j in range(i, done)],
                                      x, blocks, segment_ids, valid, i)
        moe_stats.update(stats)
        continue
      layer_cache = None if cache is None else cache[i]
      x, blocks, c, stats = layer_call(cfg, i, layer_cache)(layer, x, blocks, segment_ids, valid,
                                                            layer_cache, decode, lengths)
      caches.append(c)
      if stats is not None:
        if cache is None:
          x, stats = balance_barrier(x, stats)
        moe_stats[str(i)] = stats
    with jax.named_scope("attn_res"):
      if cfg.attn_res.enabled:
        x = self.output_attn_res(blocks + (x,))
    aux = {"moe": moe_stats}
    if cache is not None:
      aux["cache"] = caches
    return self.norm(x), aux

  def logits(self, h: jax.Array) -> jax.Array:
    """``[..., d]`` -> ``[..., V]`` float32 (for few tokens; training uses losses.cross_entropy)."""
    acc = jnp.promote_types(h.dtype, jnp.float32)
    # bf16 x bf16 products accumulate in float32 without an f32 copy of the head (decode reads it
    # every step)
    return jnp.dot(h, self.lm_head.kernel[...], preferred_element_type=acc)

  def __call__(self, input_ids, *, segment_ids=None, vision=None):
    """input_ids ``[B, T]`` int32 -> logits ``[B, T, V]`` float32 (vision: see :meth:`hidden`)."""
    h, _ = self.hidden(input_ids, segment_ids=segment_ids, vision=vision)
    return self.logits(h)

  def init_cache(self, batch: int, max_len: int) -> list:
    """Per-layer decode caches for ``batch`` requests of up to ``max_len`` tokens."""
    from k3jax.mla import PAGE_SIZE
    max_len = -(-max_len // PAGE_SIZE) * PAGE_SIZE
    return [layer.self_attn.init_cache(batch, max_len) if layer.kind == "mla"
            else layer.self_attn.init_cache(batch) for layer in self.layers]
