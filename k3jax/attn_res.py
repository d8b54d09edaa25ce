"""Block Attention Residuals (SPEC section 4).

A sublayer reads its input as a softmax mixture over depth sources (committed block summaries
plus the current block's partial sum) instead of the plain residual sum:

    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i,   w = norm * proj   (float32)

The keys are the sources after an RMSNorm without gain (the gain is folded into the query).
Zero-initialised ``proj`` gives uniform weights: the mean of the sources. The op is
:func:`pallas_kernels.attn_res.attn_res` (XLA, or fused Triton kernels on GPU).
"""

from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx

import pallas_kernels.attn_res as attn_res_ops
from k3jax.nn import constant, param
from sharding.rules import logical_spec, per_device


def attn_res(sources: Sequence[jax.Array], proj: jax.Array, norm: jax.Array, eps: float,
             implementation: str | None = None) -> jax.Array:
  """Mixes ``sources`` (each ``[B, T, d]``) with query ``norm * proj`` (each ``[d]``).

  Returns ``[B, T, d]`` in the sources' dtype; the softmax and the sum run in float32 (or wider
  in the XLA form). ``implementation``: see :mod:`pallas_kernels.attn_res`. Under a device mesh
  the kernels run on each device's share of the tokens (the op is per token); with d split over
  devices it keeps the XLA form, whose sums over d cross the pieces.
  """
  xs = logical_spec(("batch", "length", "embed"))
  impl = "xla" if xs[2] is not None else attn_res_ops.resolve(implementation)
  if impl == "xla":
    return attn_res_ops.attn_res(sources, proj, norm, eps, implementation=impl)
  fn = per_device(lambda s, p, n: attn_res_ops.attn_res(s, p, n, eps, implementation=impl),
                  ((xs,) * len(sources), None, None), xs)
  return fn(tuple(sources), proj, norm)


class AttnRes(nnx.Module):
  """One AttnRes query: ``proj [d]`` (zero init) and ``norm [d]`` (one init); ``implementation``
  picks the op's kernels (``model.attn_res.implementation``)."""

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype,
               implementation: str | None = None):
    self.proj = param(rngs, constant(0.0), (dim,), ("embed",), dtype)
    self.norm = param(rngs, constant(1.0), (dim,), ("embed",), dtype)
    self.eps = eps
    self.implementation = implementation

  def __call__(self, sources: Sequence[jax.Array]) -> jax.Array:
    return attn_res(sources, self.proj[...], self.norm[...], self.eps, self.implementation)
