"""The projector (``mm_projector``): a visual token's ``merge`` patch vectors, concatenated, into
the language model's embedding width.

- "patchmerger" (K2.5): ``proj.2(gelu(proj.0(flatten(LayerNorm(x)))))``, the LayerNorm over
  each patch vector (``pre_norm``), biases on both linears;
- "patchmerger_v2" (K3): ``post_norm(proj.2(gelu(proj.0(flatten(x)))))``, no biases, an RMSNorm
  in the text width. GELU is the exact (erf) one in both.
"""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.vision.layers import Dense, Norm


class Projector(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v, dt, std = cfg.vision, cfg.pdtype, cfg.init_std
    width = v.hidden_size * v.merge
    v2 = v.projector == "patchmerger_v2"
    kw = dict(bias=not v2, rngs=rngs, dtype=dt, std=std)
    self.pre_norm = None if v2 else Norm(v.hidden_size, "layernorm", v.projector_eps, rngs=rngs,
                                         dtype=dt)
    self.proj_in = Dense(width, width, ("vision_merge", "mlp"), **kw)
    self.proj_out = Dense(width, cfg.hidden_size, ("mlp", "embed"), **kw)
    self.post_norm = Norm(cfg.hidden_size, "rmsnorm", v.projector_eps, rngs=rngs,
                          dtype=dt) if v2 else None

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens ``[B, M, merge, D]`` -> ``[B, M, d]``."""
    if self.pre_norm is not None:
      tokens = self.pre_norm(tokens)
    x = tokens.reshape(*tokens.shape[:-2], -1)
    x = self.proj_out(jax.nn.gelu(self.proj_in(x), approximate=False))
    return x if self.post_norm is None else self.post_norm(x)
