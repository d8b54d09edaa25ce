"""Block Attention Residuals (SPEC section 4).

A sublayer reads its input as a softmax mixture over depth sources (committed block summaries
plus the current block's partial sum) instead of the plain residual sum:

    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i,   w = norm * proj   (float32)

The keys are the sources after an RMSNorm without gain (the gain is folded into the query).
Zero-initialised ``proj`` gives uniform weights: the mean of the sources.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.nn import constant, param, rms_norm


def attn_res(sources: Sequence[jax.Array], proj: jax.Array, norm: jax.Array, eps: float) -> jax.Array:
  """Mixes ``sources`` (each ``[B, T, d]``) with query ``norm * proj`` (each ``[d]``).

  Returns ``[B, T, d]`` in the sources' dtype; the softmax and the sum run in float32 (or wider).
  """
  acc = jnp.promote_types(sources[0].dtype, jnp.float32)
  v = jnp.stack([s.astype(acc) for s in sources])  # [S, B, T, d]
  w = (norm.astype(acc) * proj.astype(acc))
  logits = jnp.einsum("sbtd,d->sbt", rms_norm(v, None, eps), w)
  p = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("sbt,sbtd->btd", p, v).astype(sources[0].dtype)


class AttnRes(nnx.Module):
  """One AttnRes query: ``proj [d]`` (zero init) and ``norm [d]`` (one init)."""

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype):
    self.proj = param(rngs, constant(0.0), (dim,), ("embed",), dtype)
    self.norm = param(rngs, constant(1.0), (dim,), ("embed",), dtype)
    self.eps = eps

  def __call__(self, sources: Sequence[jax.Array]) -> jax.Array:
    return attn_res(sources, self.proj[...], self.norm[...], self.eps)
