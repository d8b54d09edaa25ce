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

from k3jax.nn import constant, param


def attn_res(sources: Sequence[jax.Array], proj: jax.Array, norm: jax.Array, eps: float) -> jax.Array:
  """Mixes ``sources`` (each ``[B, T, d]``) with query ``norm * proj`` (each ``[d]``).

  Returns ``[B, T, d]`` in the sources' dtype; the softmax and the sum run in float32 (or wider).
  Each source is read as it is (no stacked float32 copy): one pass per source for its logit,
  one pass over all of them for the mixture.
  """
  acc = jnp.promote_types(sources[0].dtype, jnp.float32)
  w = norm.astype(acc) * proj.astype(acc)

  def logit(x):  # w . RMSNorm(x) over d, [B, T]
    xf = x.astype(acc)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    return jnp.sum(xf * w, axis=-1) * r

  p = jax.nn.softmax(jnp.stack([logit(x) for x in sources]), axis=0)  # [S, B, T]
  out = sum(p[i][..., None] * x.astype(acc) for i, x in enumerate(sources))
  return out.astype(sources[0].dtype)


class AttnRes(nnx.Module):
  """One AttnRes query: ``proj [d]`` (zero init) and ``norm [d]`` (one init)."""

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype):
    self.proj = param(rngs, constant(0.0), (dim,), ("embed",), dtype)
    self.norm = param(rngs, constant(1.0), (dim,), ("embed",), dtype)
    self.eps = eps

  def __call__(self, sources: Sequence[jax.Array]) -> jax.Array:
    return attn_res(sources, self.proj[...], self.norm[...], self.eps)
