"""Block AttnRes mixing in plain jnp (the reference of :mod:`pallas_kernels.attn_res`)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def attn_res(sources: Sequence[jax.Array], proj: jax.Array, norm: jax.Array | None,
             eps: float) -> jax.Array:
  """``sum_i softmax_i((norm * proj) . RMSNorm(v_i)) v_i`` over the sources ``v_i`` (each
  ``[B, T, d]``; proj and norm ``[d]``; norm None: proj is the whole query).

  Returns ``[B, T, d]`` in the sources' dtype; the softmax and the sum run in float32 (float64
  for float64 sources). Each source is read as it is (no stacked float32 copy): one pass per
  source for its logit, one pass over all of them for the mixture.
  """
  acc = jnp.promote_types(sources[0].dtype, jnp.float32)
  w = proj.astype(acc) if norm is None else norm.astype(acc) * proj.astype(acc)

  def logit(x):  # w . RMSNorm(x) over d, [B, T]
    xf = x.astype(acc)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    return jnp.sum(xf * w, axis=-1) * r

  p = jax.nn.softmax(jnp.stack([logit(x) for x in sources]), axis=0)  # [S, B, T]
  out = sum(p[i][..., None] * x.astype(acc) for i, x in enumerate(sources))
  return out.astype(sources[0].dtype)
