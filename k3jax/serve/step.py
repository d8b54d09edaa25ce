"""Device side of the serving engine: the cache pools, the forward-and-sample step and slot copies.

The steps run the model in its serving layout (:func:`serving_model`: each attention layer's
input projections one matmul, a KDA layer's short convs one conv tail). Pools, one entry per
decoder layer, then one more: an MLA layer's ``{"pages": [P, page_size, R + Dr]}`` latent pages,
a KDA layer's ``{"state": [S, HV, V, K] float32}`` slots, and last ``{"conv": [S, L, W-1, C]}``,
the conv tails of all ``L`` KDA layers per slot (:meth:`k3jax.kda.KDA.init_cache` of S rows in the
serving layout): a step gathers its rows' tails once and writes them back once, not per layer.
Page 0 and slot 0 are scratch.

A step runs ``N`` rows of ``T`` tokens each: row ``b`` continues a request whose first
``starts[b]`` tokens are cached, with ``nvalid[b] <= T`` real tokens (the rest is padding that
changes no cached state), its pages in ``page_table[b]`` and its KDA entry ``slots[b]``. Decode
steps (``T = 1``) take the token recurrence kernel on the slot pool in place; prefill steps take
the chunked KDA kernel from the slot's state and the paged MLA attention over the cached pages and
the chunk. Sampling runs on device with per-row parameters and per-request random streams, in a
program of its own after the step's (:func:`sample`): greedy rows that ask for no alternatives
take the argmax alone, which the host decides, so no program branches on the device.

A step's sampled tokens also come out padded to a fixed width (its kind's largest row count), so
that the next decode step can take a row's input token straight from the previous steps' outputs
(``fed``) while the host has not read them yet: the engine dispatches step ``s + 1`` before it
reads step ``s``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import K3Model
from k3jax.serve.types import TOP_LOGPROBS

_ROW_KEYS = ("page_table", "slots", "tail")


def serving_model(model: K3Model, shards: int) -> K3Model:
  """``model``, changed in place, in the serving layout for ``shards`` head shards (the mesh's
  ``tensor`` size): every attention layer's input projections one matmul, a KDA layer's short
  convs one (:meth:`k3jax.kda.KDA.fuse_inputs`, :meth:`k3jax.mla.MLA.fuse_inputs`), a MoE
  layer's shared experts' and latent input projections one
  (:meth:`k3jax.latent_moe.LatentMoE.fuse_inputs`), every AttnRes query one float32 vector
  (:meth:`k3jax.attn_res.AttnRes.fold`). Built once per set of weights, not per step."""
  for layer in model.layers:
    layer.self_attn.fuse_inputs(shards)
    if layer.moe:
      layer.mlp.fuse_inputs(shards)
    if layer.attn_res_on:
      layer.self_attention_res.fold()
      layer.mlp_res.fold()
  if model.cfg.attn_res.enabled:
    model.output_attn_res.fold()
  return model


def init_pools(model: K3Model, *, num_pages: int, page_size: int, num_slots: int) -> list[dict]:
  """Zeroed pools for every layer of ``model`` (in the serving layout; see the module
  docstring)."""
  cfg = model.cfg
  width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
  pools = [{"pages": jnp.zeros((num_pages, page_size, width), cfg.cdtype)} if layer.kind == "mla"
           else layer.self_attn.init_cache(num_slots) for layer in model.layers]
  tails = [p.pop("conv") for p in pools if "conv" in p]
  return pools + ([{"conv": jnp.stack(tails, axis=1)}] if tails else [])


def filter_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array,
                  top_k: jax.Array) -> jax.Array:
  """``[N, V]`` logits -> the temperature-scaled logits with what top-k (the ``top_k[n]``
  likeliest tokens; 0 keeps all) and nucleus sampling (the smallest set reaching mass
  ``top_p[n]``, at least the top token) leave, ``-inf`` elsewhere. ``temperature [N] > 0``."""
  x = logits.astype(jnp.float32) / temperature[:, None]
  v = x.shape[-1]
  srt = -jnp.sort(-x, axis=-1)
  k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
  srt = jnp.where(jnp.arange(v)[None, :] < k[:, None], srt, -jnp.inf)
  probs = jax.nn.softmax(srt, axis=-1)
  keep = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1.0)
  keep &= srt > -jnp.inf
  cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(x >= cutoff, x, -jnp.inf)


def sample_rows(logits: jax.Array, seeds: jax.Array, counters: jax.Array, temperature: jax.Array,
                top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """``[N, V]`` logits -> ``[N]`` int32 tokens: greedy where ``temperature <= 0``, else drawn with
  key ``fold_in(key(seeds[n]), counters[n])`` from :func:`filter_logits`."""
  greedy = temperature <= 0.0
  best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
  x = filter_logits(logits, jnp.where(greedy, 1.0, temperature), top_p, top_k)
  return jnp.where(greedy, best, jax.vmap(jax.random.categorical)(keys, x)).astype(jnp.int32)


def forward(model: K3Model, pools: list[dict], tokens, starts, nvalid, page_table, slots, *,
            decode: bool, vision: dict | None = None):
  """tokens ``[N, T]`` continuing the cached requests -> (float32 logits ``[N, V]`` after each
  row's last real token, updated pools). ``vision``: the rows' visual tokens for the image
  placeholders among ``tokens``, in order (:meth:`K3Model.hidden`'s ``visual_tokens`` and
  ``num_tokens``; :func:`visual_window`)."""
  t = tokens.shape[1]
  # conv: [] without KDA layers in the serving layout
  layers, conv = pools[:len(model.layers)], pools[len(model.layers):]
  cache = [dict(p, page_table=page_table) if "pages" in p else dict(p, slots=slots) for p in layers]
  if conv:  # every KDA layer's rows' tails [N, W-1, C]
    tails = jnp.unstack(conv[0]["conv"][slots], axis=1)
    for c, tail in zip([c for c in cache if "slots" in c], tails):
      c["tail"] = tail
  # padding rows (scratch slot 0) and tails: the MoE routes them as the first row's first token
  valid = (slots > 0)[:, None] & (jnp.arange(t)[None, :] < nvalid[:, None])
  h, aux = model.hidden(tokens, valid=valid, cache=cache, decode=decode, lengths=starts + t,
                        vision=vision)
  last = jnp.take_along_axis(h, (nvalid - 1)[:, None, None], axis=1)[:, 0]
  pools = [{k: v for k, v in c.items() if k not in _ROW_KEYS} for c in aux["cache"]]
  if conv:
    new = jnp.stack([c["tail"] for c in aux["cache"] if "tail" in c], axis=1)
    pools.append({"conv": conv[0]["conv"].at[slots].set(new)})
  return model.logits(last), pools


def step(graphdef, treedef, decode: bool, leaves, pools, tokens, starts, nvalid, page_table,
         slots, fed=None, vision=None):
  """One engine step's model (jit with ``graphdef``, ``treedef`` and ``decode`` bound, pools
  donated). ``leaves``: the parameters as ``jax.tree.leaves`` of the model's state (``treedef``
  its structure; a flat list costs the host no state flattening per step). ``fed`` (decode
  steps): (``feed_decode [M]``, ``feed_prefill [P]``, ``src [N]``) int32, the previous decode and
  prefill steps' padded tokens and, per row, the index into their concatenation of its input
  token (``-1``: ``tokens`` has it). ``vision`` as :func:`forward`'s (prefill steps of a model
  with a vision tower). Returns (pools, float32 logits ``[N, V]``, on every device under a
  mesh). The tokens come from :func:`sample`, a program of its own: the host knows whether any
  row draws, where a branch on the device would make an XLA GPU program copy its predicate to
  the host and wait for it mid-step, so that nothing after it is dispatched ahead."""
  model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
  if fed is not None:
    feed_d, feed_p, src = fed
    prev = jnp.concatenate([feed_d, feed_p])[jnp.maximum(src, 0)]
    tokens = jnp.where(src[:, None] >= 0, prev[:, None], tokens)
  logits, pools = forward(model, pools, tokens, starts, nvalid, page_table, slots, decode=decode,
                          vision=vision)
  return pools, _everywhere(logits)


def sample(width: int, draw: bool, logits, seeds, counters, temperature, top_p, top_k):
  """A step's tokens from its logits ``[N, V]`` (jit with ``width`` and ``draw`` bound):
  (tokens ``[width]`` (the ``N`` sampled, then zeros), their logprobs ``[N]``, top ids ``[N,
  TOP_LOGPROBS]`` and their logprobs), logprobs of the model's distribution, before temperature
  and filtering. ``draw`` False, for rows that are all greedy and ask for no alternatives: the
  argmax, with no vocabulary sort or top-k (top ids and logprobs zeros)."""
  lp = jax.nn.log_softmax(logits, axis=-1)
  if draw:
    tok = sample_rows(logits, seeds, counters, temperature, top_p, top_k)
    top_lp, top_ids = jax.lax.top_k(lp, TOP_LOGPROBS)
  else:
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    top_lp = jnp.zeros((logits.shape[0], TOP_LOGPROBS), jnp.float32)
    top_ids = jnp.zeros((logits.shape[0], TOP_LOGPROBS), jnp.int32)
  chosen = jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
  padded = jnp.zeros((width,), jnp.int32).at[:tok.shape[0]].set(tok)
  return _everywhere(padded), chosen, top_ids.astype(jnp.int32), top_lp


def _everywhere(x: jax.Array) -> jax.Array:
  """``x`` on every device of the current mesh (as the next program takes it); ``x`` as it is
  without a mesh."""
  if jax.sharding.get_abstract_mesh().empty:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def _spec(tree):
  """Arrays (or specs) -> ``ShapeDtypeStruct`` s with their shardings."""
  return jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), tree)


def _placed(sharding):
  """``(dtype, *shape) ->`` an abstract input of that shape placed by ``sharding``."""
  return lambda dt, *s: jax.ShapeDtypeStruct(s, dt, sharding=sharding)


def lower(graphdef, params, pools, *, decode: bool, rows: int, tokens: int, table_width: int,
          feed: tuple[int, int], row_sharding=None, visual: tuple | None = None):
  """:func:`step` for ``rows`` rows of ``tokens`` tokens, jitted (pools donated) and lowered for
  ``params`` (the model's state) and ``pools`` as they are laid out (arrays or
  ``ShapeDtypeStruct``s with shardings: compile-only devices too) and per-row inputs placed by
  ``row_sharding``. ``feed``: (M, P), the widths of the decode and prefill steps' padded tokens
  (their largest row counts). ``visual``: (width ``d``, dtype) of the visual tokens ``[rows,
  tokens, d]`` that the prefill steps of a model with a vision tower take
  (:func:`visual_window`). Call the result with ``jax.tree.leaves(params)``."""
  row = _placed(row_sharding)
  i32, n = jnp.int32, rows
  leaves, treedef = jax.tree.flatten(params)
  fn = jax.jit(functools.partial(step, graphdef, treedef, decode), donate_argnums=1)
  extra = ()
  if decode:
    extra = ((row(i32, feed[0]), row(i32, feed[1]), row(i32, n)),)
  elif visual is not None:
    d, dtype = visual
    extra = (None, {"visual_tokens": row(dtype, n, tokens, d), "num_tokens": row(i32, n)})
  return fn.lower(_spec(leaves), _spec(pools), row(i32, n, tokens), row(i32, n), row(i32, n),
                  row(i32, n, table_width), row(i32, n), *extra)


def lower_sample(rows: int, vocab: int, width: int, draw: bool, row_sharding=None):
  """:func:`sample` for ``rows`` rows of ``vocab`` logits, jitted and lowered with every input
  placed by ``row_sharding`` (as :func:`step` leaves its logits)."""
  row = _placed(row_sharding)
  i32, f32, n = jnp.int32, jnp.float32, rows
  fn = jax.jit(functools.partial(sample, width, draw))
  return fn.lower(row(f32, n, vocab), row(jnp.uint32, n), row(i32, n), row(f32, n), row(f32, n),
                  row(i32, n))


@functools.partial(jax.jit, static_argnums=2)
def visual_window(visual: jax.Array, first, tokens: int) -> jax.Array:
  """Rows ``first .. first + tokens - 1`` of a request's visual tokens ``[M, d]``, zeros past its
  end: what the placeholders of a prefill chunk that follows ``first`` placeholders take. A step
  so carries ``[rows, chunk, d]``, not every row's whole ``[M, d]``."""
  return jnp.take(visual, first + jnp.arange(tokens), axis=0, mode="fill", fill_value=0)


def encode_images(graphdef, params, arrays: dict) -> jax.Array:
  """The vision tower and projector over :func:`k3jax.vision.batch`'s arrays -> visual tokens
  ``[B, M, d]`` (jit with ``graphdef`` bound)."""
  return nnx.merge(graphdef, params).encode_images(arrays)


def lower_encoder(graphdef, params, arrays: dict, row_sharding=None):
  """:func:`encode_images` jitted and lowered for ``params`` as laid out and ``arrays`` shaped
  as the example given (one request's images: ``B = 1``)."""
  rows = {k: _placed(row_sharding)(v.dtype, *v.shape) for k, v in arrays.items()}
  return jax.jit(functools.partial(encode_images, graphdef)).lower(_spec(params), rows)


def copy_slots(pools: list[dict], src: jax.Array, dst: jax.Array, zero: jax.Array) -> list[dict]:
  """Copies KDA slot ``src[m]`` to ``dst[m]`` (zeros where ``zero[m]``) in every KDA layer's pool:
  checkpoints taken and restored, fresh states. ``src``, ``dst``, ``zero``: ``[M]`` (unused pairs
  ``0 -> 0``)."""
  def copy(a):
    rows = a[src]
    return a.at[dst].set(jnp.where(zero.reshape((-1,) + (1,) * (a.ndim - 1)), 0, rows))
  return [p if "pages" in p else {k: copy(a) for k, a in p.items()} for p in pools]
