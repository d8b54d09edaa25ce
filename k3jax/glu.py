"""Gated MLPs: the dense GLU block and the config's activation (SiTU-GLU for K3, SiLU-GLU for
Kimi Linear; the maths and kernels live in :mod:`pallas_kernels.glu`)."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from k3jax.config import ModelConfig
from k3jax.nn import Linear
from pallas_kernels.glu import glu, glu_packed
from sharding.rules import logical_spec, per_device, shard, token_spec


def situ_glu(a: jax.Array, b: jax.Array, beta: float = 4.0, beta_lin: float = 25.0) -> jax.Array:
  """SiTU-GLU of gate ``a`` and up ``b`` (see :func:`pallas_kernels.glu.glu`)."""
  return glu(a, b, "situ", beta, beta_lin)


def glu_activation(cfg: ModelConfig, *, packed: bool = False, width: int | None = None):
  """The config's activation: ``(gate, up) -> h`` with ``model.glu_implementation``, ``gu
  [..., 2F] -> h`` when ``packed`` (the routed experts' form, with the MoE's
  ``implementation``), or ``y [..., W] -> h`` reading the gate and up columns ``[0, 2 width)`` of
  a fused input projection's rows when ``width`` is given (``model.glu_implementation``)."""
  kw = dict(kind=cfg.activation, beta=cfg.situ_beta, beta_lin=cfg.situ_linear_beta)
  if width is not None:
    return functools.partial(glu_packed, width=width, implementation=cfg.glu_implementation, **kw)
  if packed:
    return functools.partial(glu_packed, implementation=cfg.moe.implementation, **kw)
  return functools.partial(glu, implementation=cfg.glu_implementation, **kw)


class GLU(nnx.Module):
  """``down(act(gate(x), up(x)))``: x ``[B, T, d]`` -> ``[B, T, d]``; under a mesh each device
  runs the activation on its share of the tokens and mlp columns."""

  def __init__(self, cfg: ModelConfig, intermediate: int, *, rngs: nnx.Rngs):
    dt, d, std = cfg.pdtype, cfg.hidden_size, cfg.init_std
    self.gate_proj = Linear(d, intermediate, ("embed", "mlp"), rngs=rngs, dtype=dt, std=std)
    self.up_proj = Linear(d, intermediate, ("embed", "mlp"), rngs=rngs, dtype=dt, std=std)
    self.down_proj = Linear(intermediate, d, ("mlp", "embed"), rngs=rngs, dtype=dt, std=std)
    self.cfg = cfg

  @property
  def act(self):
    # built per call, not stored: layers of one config then share one graphdef (their calls in
    # a decode step trace and lower once, k3jax.model)
    return glu_activation(self.cfg)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: ``[B, T, d]`` or flat tokens ``[N, d]``."""
    return self.down(self.gate_proj(x), self.up_proj(x))

  def down_fused(self, y: jax.Array, width: int) -> jax.Array:
    """The activation and the down projection of a fused input weight's output ``y [N, S, P]``
    (:meth:`k3jax.latent_moe.LatentMoE.fuse_inputs`: per head shard ``S``, its ``width`` gate
    columns, then as many up columns, then others) -> ``[N, d]``: the kernel reads the gate and
    up columns where they lie, no slice of them is made."""
    names = P(token_spec()[0], logical_spec(("mlp",))[0], None)  # S: the mlp columns' shards
    h = per_device(glu_activation(self.cfg, width=width), (names,), names)(y)
    return self.down_proj(h.reshape(h.shape[0], -1))

  def down(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The activation and the down projection of the gate and up projections ``[B, T, F]`` or
    ``[N, F]``."""
    names = (("batch", "length", "mlp") if gate.ndim == 3
             else P(token_spec()[0], logical_spec(("mlp",))[0]))
    h = per_device(self.act, (names, names), names)(gate, up)
    if h.ndim == 3:
      h = shard(h, names)
    return self.down_proj(h)
