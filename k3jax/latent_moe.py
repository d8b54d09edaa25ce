"""Stable LatentMoE (SPEC section 5): sigmoid router with a selection-only bias, routed experts
working in a latent space (``d -> latent``, experts, RMSNorm, ``latent -> d``), shared experts at
full width. With ``latent_dim = 0`` the routed experts work at full width (Kimi Linear).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax import router
from k3jax.config import ModelConfig
from k3jax.glu import GLU, glu_activation
from k3jax.nn import Linear, RMSNorm, head_major, normal, param
from sharding import expert_parallel
from sharding.rules import shard, token_spec


class RouterBias(nnx.Variable):
  """The router's selection bias ``[E]``: non-trainable, updated by the train step."""


class Router(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    e = cfg.moe.num_experts
    self.kernel = param(rngs, normal(cfg.init_std), (cfg.hidden_size, e), ("embed", None),
                        cfg.pdtype)
    self.bias = RouterBias(jnp.zeros((e,), jnp.float32), sharding_names=(None,), eager_sharding=False)

  def scores(self, x: jax.Array) -> jax.Array:
    """``[N, E]`` float32 sigmoid scores of tokens ``x [N, d]`` (the product in float32)."""
    return jax.nn.sigmoid(wide_dot(x, self.kernel[...]))


@jax.custom_vjp
def wide_dot(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x [N, d] @ w [d, E]`` with both operands widened to float32 (at least), as the router's
  logits are specified; the backward keeps x in its own dtype rather than autodiff's float32 copy
  (k3_1b: 256 MiB per MoE layer outside the remat) and widens it again. Gradients as autodiff's
  of the widened product, each in its operand's dtype."""
  return _wide_dot_fwd(x, w)[0]


def _wide(x, w):
  acc = jnp.promote_types(jnp.promote_types(x.dtype, w.dtype), jnp.float32)
  return x.astype(acc), w.astype(acc)


def _wide_dot_fwd(x, w):
  xa, wa = _wide(x, w)
  return jnp.dot(xa, wa), (x, w)


def _wide_dot_bwd(res, g):
  x, w = res
  xa, wa = _wide(x, w)
  g = g.astype(xa.dtype)
  return jnp.dot(g, wa.T).astype(x.dtype), jnp.dot(xa.T, g).astype(w.dtype)


wide_dot.defvjp(_wide_dot_fwd, _wide_dot_bwd)


class Experts(nnx.Module):
  """Routed expert weights: ``w_gate_up [E, L, 2F]`` (gate then up), ``w_down [E, F, L]``."""

  def __init__(self, cfg: ModelConfig, width: int, *, rngs: nnx.Rngs):
    m, dt, std = cfg.moe, cfg.pdtype, cfg.init_std
    e, f = m.num_experts, m.expert_intermediate
    self.w_gate_up = param(rngs, normal(std), (e, width, 2 * f), ("expert", "latent", "mlp"), dt)
    self.w_down = param(rngs, normal(std), (e, f, width), ("expert", "mlp", "latent"), dt)


def all_experts(x, expert_ids, weights, w_gate_up, w_down, activation):
  """The routed experts of few tokens computed densely: every expert on every token, then each
  token's ``k`` outputs weighted and summed (float32, as
  ``pallas_kernels.moe.expert_mlp``). ``x [N, D]``, expert_ids and weights ``[N, k]``,
  ``w_gate_up [E, D, 2F]``, ``w_down [E, F, D]``, activation ``[M, 2F] -> [M, F]`` -> ``[N, D]``."""
  n = x.shape[0]
  e, _, f2 = w_gate_up.shape
  acc = jnp.promote_types(x.dtype, jnp.float32)
  gu = jnp.einsum("nd,edf->enf", x, w_gate_up, preferred_element_type=acc)
  h = activation(gu.astype(x.dtype).reshape(e * n, f2)).astype(x.dtype).reshape(e, n, -1)
  y = jnp.einsum("enf,efd->end", h, w_down, preferred_element_type=acc)
  picked = y[expert_ids, jnp.arange(n)[:, None]]  # [N, k, D]
  return jnp.einsum("nkd,nk->nd", picked, weights.astype(acc)).astype(x.dtype)


class LatentMoE(nnx.Module):
  """x ``[B, T, d]`` -> (``[B, T, d]``, router stats)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    m, d, dt, std = cfg.moe, cfg.hidden_size, cfg.pdtype, cfg.init_std
    self.cfg = cfg
    self.gate = Router(cfg, rngs=rngs)
    width = m.latent_dim or d
    if m.latent_dim:
      self.routed_expert_down_proj = Linear(d, m.latent_dim, ("embed", "latent"), rngs=rngs,
                                            dtype=dt, std=std)
      self.routed_expert_norm = RMSNorm(m.latent_dim, cfg.rms_norm_eps, rngs=rngs, dtype=dt,
                                        name="latent")
      self.routed_expert_up_proj = Linear(m.latent_dim, d, ("latent", "embed"), rngs=rngs,
                                          dtype=dt, std=std)
    self.experts = Experts(cfg, width, rngs=rngs)
    if m.num_shared_experts:
      self.shared_experts = GLU(cfg, m.num_shared_experts * m.expert_intermediate, rngs=rngs)

  @property
  def act(self):
    # built per call, not stored (as GLU's): MoE layers of one config share one graphdef
    return glu_activation(self.cfg, packed=True)

  @property
  def fused(self) -> bool:
    """Whether this layer is in the serving layout (:meth:`fuse_inputs`)."""
    return "in_proj" in vars(self)

  def fuse_inputs(self, shards: int) -> None:
    """The serving layout for ``shards`` head shards (the mesh's ``tensor`` size), as the
    attention layers' (:meth:`k3jax.kda.KDA.fuse_inputs`): the shared experts' gate and up
    projections and (with a latent) the routed experts' projection into the latent become one
    weight ``in_proj [d, shards, P]`` (:func:`k3jax.nn.head_major`: each shard's mlp columns of
    gate and up, then the latent projection repeated), one matmul per layer and step in place of
    three (two without a latent: Kimi Linear). The router keeps its own float32 product. A layer
    without shared experts stays as it is."""
    m = self.cfg.moe
    if not m.num_shared_experts:
      return
    f = m.num_shared_experts * m.expert_intermediate
    if f % shards:
      raise ValueError(f"LatentMoE.fuse_inputs: shared experts of width {f} do not split into "
                       f"{shards} shards")
    g = self.shared_experts
    latent = [self.routed_expert_down_proj.kernel[...]] if m.latent_dim else []
    self.in_proj = head_major([g.gate_proj.kernel[...], g.up_proj.kernel[...]], latent, shards)
    self.shards = shards
    if m.latent_dim:
      del self.routed_expert_down_proj
    del g.gate_proj, g.up_proj

  def _fused_inputs(self, x):
    """The serving layout's (:meth:`fuse_inputs`) routed experts' input (the latent ``[N,
    latent]``, or the tokens ``[N, d]`` without one) and shared experts' output ``[N, d]`` from
    x ``[B, T, d]``."""
    b, t, d = x.shape
    f = self.cfg.moe.num_shared_experts * self.cfg.moe.expert_intermediate // self.shards
    y = jnp.einsum("btd,dsp->btsp", x, self.in_proj[...].astype(x.dtype))
    y = shard(y, ("batch", "length", "heads", None))
    with jax.named_scope("shared_experts"):
      shared = self.shared_experts.down_fused(y.reshape(b * t, *y.shape[2:]), f)
    if not self.cfg.moe.latent_dim:
      return x.reshape(b * t, d), shared
    return y[:, :, 0, 2 * f:].reshape(b * t, -1), shared  # every shard holds the latent: shard 0's

  def dense(self, tokens: int) -> bool:
    """Whether a decoding call on ``tokens`` tokens runs the routed experts densely
    (:func:`all_experts`): ``moe.dense_decode_tokens`` at most, whose pairs leave at most
    ``moe.dense_decode_unpicked_mb`` of expert weights unpicked (the bytes of the experts beyond
    their ``tokens * top_k`` pairs: what the dense path reads for nothing; below ``tokens`` ~ the
    card's FLOPs per byte the extra products stay within the read), on one device's experts and
    tokens (where ``expert_parallel.routed_experts`` runs ``pallas_kernels.moe.expert_mlp``)."""
    m = self.cfg.moe
    weights = (self.experts.w_gate_up, self.experts.w_down)  # the bytes held, as served
    expert = sum(w.size * w.dtype.itemsize for w in weights) // m.num_experts
    unpicked = max(m.num_experts - tokens * m.top_k, 0) * expert
    return (tokens <= m.dense_decode_tokens and unpicked <= m.dense_decode_unpicked_mb * 2**20
            and not expert_parallel.active() and token_spec()[0] is None)

  def __call__(self, x: jax.Array, *, valid: jax.Array | None = None, decoding: bool = False):
    """valid: ``[B, T]`` bool, tokens that count for balancing (padding excluded). decoding: no
    router statistics (then None), few tokens may run every expert (:meth:`dense`), and padding
    (``valid`` false) takes the first token's experts, which must be real, where the experts are
    not split: a serving step's padding rows and tails then read no expert weights of their
    own."""
    m = self.cfg.moe
    b, t, d = x.shape
    xf = x.reshape(b * t, d)
    vf = None if valid is None else valid.reshape(b * t)
    with jax.named_scope("router"):
      scores = self.gate.scores(xf)
      bias = self.gate.bias[...]
      ids, weights = router.route(scores, bias, m)
    if decoding and vf is not None and not expert_parallel.active():
      # (split experts keep their routing: a capacity would drop real tokens' slots)
      ids = jnp.where(vf[:, None], ids, ids[:1])
    if self.fused:
      xe, shared = self._fused_inputs(x)
    else:
      xe = self.routed_expert_down_proj(xf) if m.latent_dim else xf
    w1, w2 = self.experts.w_gate_up[...].astype(x.dtype), self.experts.w_down[...].astype(x.dtype)
    per_row = lambda a: a.reshape(b, t, a.shape[-1])
    if decoding and self.dense(b * t):
      y = all_experts(xe, ids, weights, w1, w2, self.act)
    else:
      y = expert_parallel.routed_experts(per_row(xe), per_row(ids), per_row(weights), w1, w2,
                                         self.act, capacity_factor=m.capacity_factor,
                                         implementation=m.implementation).reshape(b * t, -1)
    if m.latent_dim:
      y = self.routed_expert_up_proj(self.routed_expert_norm(y))
    if m.num_shared_experts:
      with jax.named_scope("shared_experts"):
        y = y + (shared if self.fused else self.shared_experts(xf))
    y = shard(y.reshape(b, t, d), ("batch", "length", "embed"))
    if decoding:
      return y, None
    with jax.named_scope("balance"):
      return y, {
          "load": router.expert_load(ids, m.num_experts, vf),
          "bias_stat": jax.lax.stop_gradient(router.sharded_bias_stat(scores, bias, ids, m, vf)),
      }
