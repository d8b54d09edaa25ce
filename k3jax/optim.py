"""Optimizers and learning-rate schedules for the parameter tree of ``K3Model``.

``make_optimizer(cfg, params)`` returns an optax transformation for a pure-dict parameter tree
(``nnx.to_pure_dict`` of the ``nnx.Param`` state): gradient clipping by global norm, then

- ``adamw``: AdamW on every parameter;
- ``muon``: ``optax.contrib.muon`` on the weight matrices, update RMS matched to AdamW
  (``0.2 * sqrt(max(fan_in, fan_out))``), Nesterov momentum; AdamW on everything that is not a
  hidden-layer matrix: norms, biases, ``A_log``, ``dt_bias``, Block AttnRes vectors, the embedding,
  ``lm_head`` and the short-conv kernels. The Newton-Schulz matmuls take bf16 operands with
  float32 accumulation (``optimizer.muon_ns_precision``), as in Moonlight and Keller Jordan's
  Muon. Expert weights ``[E, L, 2F]`` / ``[E, F, L]`` are orthogonalised per expert (and
  gate/up separately); with ``optimizer.muon_per_head`` the attention projections are
  orthogonalised per head (``[d, H*K]`` viewed as ``[d, H, K]``).

Weight decay (decoupled, scaled by the learning rate) applies to matrices only: never to norms,
biases, ``A_log``, ``dt_bias`` or the AttnRes vectors.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from k3jax.config import Config, OptimizerConfig

NO_DECAY_NAMES = ("A_log", "dt_bias", "bias")
ADAM_MATRIX_NAMES = ("embedding", "lm_head", "q_conv1d", "k_conv1d", "v_conv1d")


# ---------------------------------------------------------------------------------------------
# Schedules.


def total_steps(cfg: Config) -> int:
  """The run length: ``train.steps``."""
  return cfg.train.steps


def make_schedule(o: OptimizerConfig, steps: int) -> optax.Schedule:
  """Linear warmup to ``o.lr`` over ``o.warmup_steps`` (``lr * (step + 1) / warmup``), then:
  ``wsd``: constant, with a linear decay to ``lr * min_lr_ratio`` over the last
  ``decay_fraction`` of ``steps``; ``cosine``: cosine decay to ``lr * min_lr_ratio`` at ``steps``;
  ``constant``: constant."""
  lr, floor, warm = o.lr, o.lr * o.min_lr_ratio, max(o.warmup_steps, 0)

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warmup = lr * jnp.minimum(1.0, (step + 1.0) / max(warm, 1))
    if o.schedule == "constant":
      return warmup
    if o.schedule == "cosine":
      frac = jnp.clip((step - warm) / max(steps - warm, 1), 0.0, 1.0)
      decayed = floor + (lr - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    else:  # wsd
      decay_steps = max(int(round(o.decay_fraction * steps)), 1)
      start = steps - decay_steps
      frac = jnp.clip((step - start) / decay_steps, 0.0, 1.0)
      decayed = lr + (floor - lr) * frac
    return jnp.where(step < warm, warmup, decayed)

  return schedule


# ---------------------------------------------------------------------------------------------
# Parameter roles, from the NNX attribute path of each leaf.


def _names(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def decay_mask(params) -> Any:
  """True for the leaves that get weight decay: matrices (ndim >= 2) other than norms/biases."""
  def decays(path, x):
    names = _names(path)
    return x.ndim >= 2 and not any(n in NO_DECAY_NAMES or "norm" in str(n) for n in names)
  return jax.tree_util.tree_map_with_path(decays, params)


@dataclasses.dataclass(frozen=True)
class _Role:
  """How one leaf is optimised: ``dims`` None means AdamW; ``view`` is the shape Muon sees."""
  view: tuple[int, ...]
  dims: MuonDimensionNumbers | None


def _head_split(cfg: Config, names: tuple, shape: tuple[int, ...]) -> tuple | None:
  """Per-head view of an attention projection: ``(view shape, dims)`` or None."""
  if len(names) < 5 or names[0] != "layers" or names[2] != "self_attn" or names[-1] != "kernel":
    return None
  layer, proj = int(names[1]), names[3]
  m = cfg.model
  if m.layer_kind(layer) == "kda":
    k = m.kda
    out_heads = {"q_proj": k.num_heads, "k_proj": k.num_heads, "v_proj": k.value_heads,
                 "g_proj": k.value_heads, "g_b_proj": k.value_heads, "f_b_proj": k.value_heads}
    in_heads = {"o_proj": k.value_heads}
  else:
    a = m.mla.num_heads
    out_heads = {"q_proj": a, "q_b_proj": a, "kv_b_proj": a, "g_proj": a}
    in_heads = {"o_proj": a}
  d_in, d_out = shape
  if proj in out_heads and d_out % out_heads[proj] == 0:
    h = out_heads[proj]
    return (d_in, h, d_out // h), MuonDimensionNumbers(reduction_axis=0, output_axis=2)
  if proj in in_heads and d_in % in_heads[proj] == 0:
    h = in_heads[proj]
    return (h, d_in // h, d_out), MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  return None


def muon_roles(cfg: Config, params) -> Any:
  """A ``_Role`` per leaf: which leaves Muon orthogonalises, and in which view."""
  def role(path, x):
    names, shape = _names(path), tuple(x.shape)
    if x.ndim < 2 or any(n in ADAM_MATRIX_NAMES for n in names):
      return _Role(shape, None)
    if names[-1] == "w_gate_up" and x.ndim == 3:  # [E, L, 2F]: gate and up separately
      e, l, f2 = shape
      return _Role((e, l, 2, f2 // 2), MuonDimensionNumbers(reduction_axis=1, output_axis=3))
    if x.ndim == 3:  # [E, in, out]
      return _Role(shape, MuonDimensionNumbers(reduction_axis=1, output_axis=2))
    if x.ndim == 2 and cfg.optimizer.muon_per_head:
      split = _head_split(cfg, names, shape)
      if split is not None:
        return _Role(*split)
    if x.ndim == 2:
      return _Role(shape, MuonDimensionNumbers(reduction_axis=0, output_axis=1))
    return _Role(shape, None)
  return jax.tree_util.tree_map_with_path(role, params)


def _viewed(inner: optax.GradientTransformation, roles) -> optax.GradientTransformation:
  """Runs ``inner`` on the leaves reshaped to their role's view, and reshapes updates back."""
  is_role = lambda r: isinstance(r, _Role)

  def to_view(tree):
    return jax.tree.map(lambda r, x: x.reshape(r.view), roles, tree, is_leaf=is_role)

  def init(params):
    return inner.init(to_view(params))

  def update(updates, state, params=None):
    shapes = jax.tree.map(jnp.shape, updates)
    new, state = inner.update(to_view(updates), state, None if params is None else to_view(params))
    new = jax.tree.map(lambda u, s: u.reshape(s), new, shapes, is_leaf=lambda s: isinstance(s, tuple))
    return new, state

  return optax.GradientTransformation(init, update)


_NS_PRECISION = {"bf16": "BF16_BF16_F32", "f32": None}


def _with_matmul_precision(inner: optax.GradientTransformation, precision: str | None
                           ) -> optax.GradientTransformation:
  """``inner`` with its update traced under ``jax.default_matmul_precision(precision)``."""
  if precision is None:
    return inner

  def update(updates, state, params=None):
    with jax.default_matmul_precision(precision):
      return inner.update(updates, state, params)

  return optax.GradientTransformation(inner.init, update)


def make_optimizer(cfg: Config, params) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(transformation, schedule) for the pure-dict parameter tree ``params`` (arrays or
  ShapeDtypeStructs)."""
  o = cfg.optimizer
  schedule = make_schedule(o, total_steps(cfg))
  if o.name == "adamw":
    base = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=decay_mask)
  else:
    roles = muon_roles(cfg, params)
    is_role = lambda r: isinstance(r, _Role)
    labels = jax.tree.map(lambda r: "adam" if r.dims is None else "muon", roles, is_leaf=is_role)
    dims = jax.tree.map(lambda r: r.dims, roles, is_leaf=is_role)
    muon_dims = lambda p: jax.tree.map(lambda d, _: d, dims, p, is_leaf=lambda d: d is None or
                                       isinstance(d, MuonDimensionNumbers))
    muon = optax.contrib.muon(
        schedule, beta=o.muon_beta, eps=o.eps, weight_decay=o.weight_decay,
        muon_weight_dimension_numbers=muon_dims, consistent_rms=0.2, nesterov=True)
    muon = _with_matmul_precision(muon, _NS_PRECISION[o.muon_ns_precision])
    adam = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=decay_mask)
    base = _viewed(optax.partition({"muon": muon, "adam": adam}, labels), roles)
  parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  return optax.chain(*parts, base), schedule


def update_rms(updates) -> jax.Array:
  """Root mean square over all elements of an update tree."""
  leaves = jax.tree.leaves(updates)
  n = sum(math.prod(x.shape) for x in leaves)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves) / n)
