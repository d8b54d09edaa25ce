"""Kimi Delta Attention layer (SPEC section 2): projections, short convs, gates, the KDA op and
the gated per-head RMSNorm output.

Decoding keeps, per request, the last ``conv_size - 1`` inputs of each short conv and the
float32 recurrent state, stored K-last as ``[HV, V, K]`` (the decode kernel's pool layout; the
chunked op's states are ``[HV, K, V]``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels.conv as conv_ops
import pallas_kernels.kda as kda_ops
from k3jax.config import ModelConfig
from k3jax.nn import Linear, RMSNorm, constant, head_major, param, per_shard
from sharding import context_parallel
from sharding.rules import logical_spec, per_device, shard


def short_conv(x: jax.Array, w: jax.Array, segment_ids: jax.Array | None = None,
               tail: jax.Array | None = None, implementation: str | None = None,
               lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise conv followed by SiLU.

  x: ``[B, T, C]``; w: ``[W, C]`` (tap ``W-1`` multiplies the current token); tail: ``[B, W-1, C]``
  inputs preceding x (zeros when None). With segment ids, taps never reach into another
  document (nor into the tail). Returns (y ``[B, T, C]``, new tail ``[B, W-1, C]``: the last W-1
  inputs, or with ``lengths [B]`` the W-1 inputs before position ``lengths[b]`` of x, for
  right-padded rows whose padding must not enter the tail). Without a tail (training, prefill
  from scratch) it is the fused op :func:`pallas_kernels.conv.causal_conv_silu`
  (``implementation``: its kernels); with one, its XLA form over the tail and x.
  """
  width = w.shape[0]
  if tail is None:
    xp = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    y = _fused_conv(x, w, segment_ids, implementation)
  else:
    xp = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    seg = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (width - 1, 0)),
                                                   constant_values=-1)
    y = conv_ops.causal_conv_silu(xp, w, seg, implementation="xla")[:, width - 1:]
  if lengths is None:
    return y, xp[:, xp.shape[1] - (width - 1):]
  idx = lengths[:, None] + np.arange(width - 1)[None, :]  # positions in xp
  return y, jnp.take_along_axis(xp, idx[..., None], axis=1)


def _fused_conv(x, w, segment_ids, implementation):
  """:func:`pallas_kernels.conv.causal_conv_silu` on each device's share of the batch and
  channels. A sequence split over devices (context parallelism) keeps the XLA form, whose taps
  reach across the pieces."""
  xs = logical_spec(("batch", "length", "heads"))
  impl = "xla" if xs[1] is not None else conv_ops.resolve(implementation)
  if impl == "xla":
    return conv_ops.causal_conv_silu(x, w, segment_ids, implementation=impl)
  fn = per_device(lambda x, w, s: conv_ops.causal_conv_silu(x, w, s, implementation=impl),
                  (xs, P(None, xs[2]), P(xs[0], None)), xs)
  return fn(x, w, segment_ids)


def _kda_per_device(q, k, v, g, beta, *, segment_ids, initial_state, A_log, dt_bias,
                    output_final_state, **kw):
  """:func:`pallas_kernels.kda.kda` on each device's rows and heads (the recurrence is per row
  and head; a sequence split takes :func:`sharding.context_parallel.kda` instead). q, k
  ``[B, T, H, K]``, v, g ``[B, T, HV, *]``, beta ``[B, T, HV]``, segment_ids ``[B, T]``,
  initial_state ``[B, HV, K, V]`` or None."""
  tok = logical_spec(("batch", "length", "heads", None))
  state = P(tok[0], tok[2], None, None)

  def local(q, k, v, g, beta, seg, s0, a_log, dt):
    return kda_ops.kda(q, k, v, g, beta, segment_ids=seg, initial_state=s0, A_log=a_log,
                       dt_bias=dt, output_final_state=output_final_state, **kw)

  fn = per_device(local, (tok, tok, tok, tok, P(*tok[:3]), P(*tok[:2]), state, P(tok[2]),
                          P(tok[2])), (tok, state if output_final_state else None))
  return fn(q, k, v, g, beta, segment_ids, initial_state, A_log, dt_bias)


# A gate input or beta logit no gate reaches back from: g = 0 and beta = 0 exactly.
_OFF = -1e30


def _dt_bias_init(key, shape, dtype, dt_min=1e-3, dt_max=0.1):
  """``inverse_softplus(dt)`` with dt log-uniform in [dt_min, dt_max]."""
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDA(nnx.Module):
  """x ``[B, T, d]`` -> ``[B, T, d]``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    k = cfg.kda
    self.cfg = cfg
    d, dt, std = cfg.hidden_size, cfg.pdtype, cfg.init_std
    h, hv, kd, vd = k.num_heads, k.value_heads, k.head_dim, k.v_head_dim
    self.q_proj = Linear(d, h * kd, ("embed", "heads"), rngs=rngs, dtype=dt, std=std)
    self.k_proj = Linear(d, h * kd, ("embed", "heads"), rngs=rngs, dtype=dt, std=std)
    self.v_proj = Linear(d, hv * vd, ("embed", "heads"), rngs=rngs, dtype=dt, std=std)
    conv_std = 1.0 / math.sqrt(k.conv_size)
    self.q_conv1d = Linear(k.conv_size, h * kd, ("conv", "heads"), rngs=rngs, dtype=dt, std=conv_std)
    self.k_conv1d = Linear(k.conv_size, h * kd, ("conv", "heads"), rngs=rngs, dtype=dt, std=conv_std)
    self.v_conv1d = Linear(k.conv_size, hv * vd, ("conv", "heads"), rngs=rngs, dtype=dt, std=conv_std)
    self.f_a_proj = Linear(d, k.f_rank, ("embed", None), rngs=rngs, dtype=dt, std=std)
    self.f_b_proj = Linear(k.f_rank, hv * kd, (None, "heads"), rngs=rngs, dtype=dt, std=std)
    if k.gate == "bounded":
      a_init = constant(0.0)
    else:  # Mamba-style A in [1, 16]
      a_init = lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, jnp.float32, 1, 16)).astype(dtype)
    self.A_log = param(rngs, a_init, (hv,), ("heads",), jnp.float32)
    self.dt_bias = param(rngs, _dt_bias_init, (hv * kd,), ("heads",), jnp.float32)
    self.b_proj = Linear(d, hv, ("embed", "heads"), rngs=rngs, dtype=dt, std=std)
    if k.output_gate == "full":
      self.g_proj = Linear(d, hv * vd, ("embed", "heads"), rngs=rngs, dtype=dt, std=std)
    else:
      self.g_a_proj = Linear(d, k.output_gate_rank, ("embed", None), rngs=rngs, dtype=dt, std=std)
      self.g_b_proj = Linear(k.output_gate_rank, hv * vd, (None, "heads"), rngs=rngs, dtype=dt, std=std)
    self.o_norm = RMSNorm(vd, cfg.rms_norm_eps, rngs=rngs, dtype=dt, name="head_dim")
    self.o_proj = Linear(hv * vd, d, ("heads", "embed"), rngs=rngs, dtype=dt,
                         std=std / math.sqrt(2 * cfg.num_layers))

  def init_cache(self, batch: int) -> dict:
    """Decode cache of ``batch`` rows (one per request, or the serving engine's slot pool): conv
    tails ``[batch, W-1, C]`` (in the serving layout (:meth:`fuse_inputs`) one ``conv`` of every
    shard's q, k and v channels, which the engine keeps for all layers in one array) and the
    float32 recurrent state, stored as the decode kernel's K-last pool ``[batch, HV, V, K]``
    (``kda_ops.to_pool``)."""
    k = self.cfg.kda
    cd = self.cfg.cdtype
    w = k.conv_size - 1
    qc, vc = k.num_heads * k.head_dim, k.value_heads * k.v_head_dim
    conv = ({"conv": jnp.zeros((batch, w, 2 * qc + vc), cd)} if self.fused else
            {"conv_q": jnp.zeros((batch, w, qc), cd), "conv_k": jnp.zeros((batch, w, qc), cd),
             "conv_v": jnp.zeros((batch, w, vc), cd)})
    return {**conv, "state": jnp.zeros((batch, k.value_heads, k.v_head_dim, k.head_dim),  # K-last
                                       jnp.promote_types(cd, jnp.float32))}

  @property
  def fused(self) -> bool:
    """Whether this layer is in the serving layout (:meth:`fuse_inputs`)."""
    return "in_proj" in vars(self)

  def fuse_inputs(self, shards: int) -> None:
    """Turns this layer into the serving layout for ``shards`` head shards (the mesh's ``tensor``
    size; 1 on one device): the six projections of x become one weight ``in_proj [d, shards,
    P]`` and the three short convs one ``conv1d [W, shards * C]``, so a decode step runs one
    matmul and keeps one conv tail per layer. Head-major: shard ``s`` holds its own heads of q,
    k, v (the conv channels, ``C``), beta and the full output gate, then the unsharded low ranks
    (f_a and a low-rank gate's g_a) repeated. The serving engine calls this on its own copy of
    the model (checkpoints and training keep the separate parameters). The layer then takes its
    rows' conv tails already gathered (the cache's ``"tail" [B, W-1, shards * C]`` beside the
    state pool and ``"slots"``) and returns their new ones the same way: the engine reads and
    writes every layer's tails at once."""
    k = self.cfg.kda
    if k.num_heads % shards or k.value_heads % shards:
      raise ValueError(f"KDA.fuse_inputs: {k.num_heads} heads and {k.value_heads} value heads "
                       f"do not split into {shards} shards")
    kernel = lambda name: getattr(self, name).kernel[...]
    full = k.output_gate == "full"
    sharded = ("q_proj", "k_proj", "v_proj", "b_proj") + (("g_proj",) if full else ())
    low = ("f_a_proj",) + (() if full else ("g_a_proj",))
    self.in_proj = head_major([kernel(n) for n in sharded], [kernel(n) for n in low], shards)
    convs = ("q_conv1d", "k_conv1d", "v_conv1d")
    w_conv = head_major([kernel(n) for n in convs], [], shards)[...]  # [W, shards, C]
    self.conv1d = nnx.Param(w_conv.reshape(k.conv_size, -1), sharding_names=("conv", "heads"),
                            eager_sharding=False)
    self.shards = shards
    for n in sharded + low + convs:
      delattr(self, n)

  def _fused_inputs(self, x, cache, segment_ids, lengths):
    """The serving layout's (:meth:`fuse_inputs`) inputs of the KDA op from x ``[B, T, d]`` and
    the rows' conv tails ``cache["tail"]``: (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` after the
    short convs, f ``[B, T, HV, K]``, beta logits ``[B, T, HV]``, the output gate's logits
    ``[B, T, HV * V]``, the new conv tails ``[B, W-1, shards * C]``)."""
    k = self.cfg.kda
    b, t, _ = x.shape
    s, h, hv, kd, vd = self.shards, k.num_heads, k.value_heads, k.head_dim, k.v_head_dim
    y = jnp.einsum("btd,dsp->btsp", x, self.in_proj[...].astype(x.dtype))
    y = shard(y, ("batch", "length", "heads", None))
    # the barrier keeps the projection out of the conv's concatenation with the tail (see the
    # separate layout's)
    y = jax.lax.optimization_barrier(y)
    qs, vs = h * kd // s, hv * vd // s
    c = 2 * qs + vs
    conv, tail = short_conv(y[..., :c].reshape(b, t, s * c), self.conv1d[...], segment_ids,
                            cache["tail"], k.conv_implementation, lengths=lengths)
    conv = conv.reshape(b, t, s, c)
    names = ("batch", "length", "heads", None)
    q = shard(conv[..., :qs].reshape(b, t, h, kd), names)
    kk = shard(conv[..., qs:2 * qs].reshape(b, t, h, kd), names)
    v = shard(conv[..., 2 * qs:].reshape(b, t, hv, vd), names)
    beta = y[..., c:c + hv // s].reshape(b, t, hv)
    rest = y[..., c + hv // s:]

    if k.output_gate == "full":
      gate, fa = rest[..., :vs].reshape(b, t, hv * vd), rest[..., vs:]
    else:
      fa, ga = rest[..., :k.f_rank], rest[..., k.f_rank:]
      gate = per_shard(ga, self.g_b_proj.kernel[...])
    f = per_shard(fa, self.f_b_proj.kernel[...]).reshape(b, t, hv, kd)
    return q, kk, v, f, beta, gate, tail

  def _inputs(self, x, cache, rows, segment_ids, lengths):
    """q, k, v after the short convs, f, beta logits and the new conv tails (by name) of the
    separate layout, as :meth:`_fused_inputs`."""
    k = self.cfg.kda
    b, t, _ = x.shape
    h, hv, kd, vd = k.num_heads, k.value_heads, k.head_dim, k.v_head_dim
    proj = {"q": self.q_proj(x), "k": self.k_proj(x), "v": self.v_proj(x)}
    if cache is not None:
      # Decoding a few tokens, XLA computes a projection as a reduction and fuses it into the
      # concatenation with the conv tail, one kernel 100x slower than both apart (serving, H100):
      # the barrier keeps them apart.
      proj = jax.lax.optimization_barrier(proj)
    convs = {"q": self.q_conv1d, "k": self.k_conv1d, "v": self.v_conv1d}
    out, tails = {}, {}
    for n in ("q", "k", "v"):
      tail = None if cache is None else rows(cache["conv_" + n])
      out[n], tails[n] = short_conv(proj[n], convs[n].kernel[...], segment_ids, tail,
                                    k.conv_implementation, lengths=lengths)
    names = ("batch", "length", "heads", None)
    q = shard(out["q"].reshape(b, t, h, kd), names)
    kk = shard(out["k"].reshape(b, t, h, kd), names)
    v = shard(out["v"].reshape(b, t, hv, vd), names)
    f = self.f_b_proj(self.f_a_proj(x)).reshape(b, t, hv, kd)
    beta = self.b_proj(x)  # logits [B, T, HV]
    return q, kk, v, f, beta, tails

  def _output_gate(self, x):
    if self.cfg.kda.output_gate == "full":
      return self.g_proj(x)
    return self.g_b_proj(self.g_a_proj(x))

  def __call__(self, x: jax.Array, *, segment_ids=None, valid=None, cache=None, decode=False):
    """x: ``[B, T, d]``; segment_ids ``[B, T]`` (packed documents); valid ``[B, T]`` bool, a
    prefix of each row (prefill of right-padded prompts: padding leaves state and conv tails
    unchanged; ignored when decoding, where a padding row runs on a scratch slot); cache: this
    layer's decode cache (:meth:`init_cache` of B rows), the same of a slot pool plus ``"slots"
    [B]`` int32 (row b continues pool entry ``slots[b]``; the serving engine's cache), or None;
    decode: x holds new tokens that continue the cache. Returns (y ``[B, T, d]``, new cache or
    None)."""
    k = self.cfg.kda
    b, t, _ = x.shape
    h, hv, kd, vd = k.num_heads, k.value_heads, k.head_dim, k.v_head_dim
    slots = None if cache is None else cache.get("slots")
    valid = None if decode else valid
    rows = (lambda a: a) if slots is None else (lambda a: a[slots])
    lengths = None if valid is None else valid.sum(1)
    if self.fused:
      q, kk, v, f, beta, gate, tails = self._fused_inputs(x, cache, segment_ids, lengths)
    else:
      q, kk, v, f, beta, tails = self._inputs(x, cache, rows, segment_ids, lengths)
      gate = self._output_gate(x)
    gate_kw = dict(use_qk_l2norm=True, A_log=self.A_log[...], dt_bias=self.dt_bias[...],
                   gate=k.gate, lower_bound=k.gate_lower_bound, beta_is_logit=True)
    if valid is not None and cache is not None:
      # Padding must leave the carried state alone: no decay (g = 0), no write (beta = 0). Both
      # gates and the beta sigmoid reach exactly 0 at a hugely negative input, so the gate stays
      # fused into the kernel (the bounded gate's fast path). Without a cache nothing reads the
      # state past the padding (a document restarts it).
      f = jnp.where(valid[..., None, None], f, _OFF)
      beta = jnp.where(valid[..., None], beta, _OFF)
    if decode:
      o, state = kda_ops.kda_decode(q, kk, v, f, beta, cache["state"], slots=slots,
                                    implementation=k.implementation, **gate_kw)
    else:
      kda_fn = context_parallel.kda if context_parallel.active() else _kda_per_device
      s0 = None if cache is None else kda_ops.from_pool(rows(cache["state"]))
      o, state = kda_fn(q, kk, v, f, beta, segment_ids=segment_ids, initial_state=s0,
                        output_final_state=cache is not None, chunk_size=k.chunk_size,
                        save_residuals=k.save_residuals,
                        implementation=k.implementation, **gate_kw)
      if state is not None:
        state = kda_ops.to_pool(state).astype(cache["state"].dtype)
        if slots is not None:
          state = cache["state"].at[slots].set(state)
    o = self.o_norm(o) * jax.nn.sigmoid(gate).reshape(b, t, hv, vd).astype(o.dtype)
    y = self.o_proj(o.reshape(b, t, hv * vd))
    if cache is None:
      return y, None
    if self.fused:
      new = {"tail": tails}
    else:
      new = {"conv_" + n: tails[n] if slots is None else cache["conv_" + n].at[slots].set(tails[n])
             for n in ("q", "k", "v")}
    new["state"] = state
    if slots is not None:
      new["slots"] = slots
    return y, new
