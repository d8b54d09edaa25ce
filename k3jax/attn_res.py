"""Block Attention Residuals (SPEC section 4).

A sublayer reads its input as a softmax mixture over depth sources (committed block summaries
plus the current block's partial sum) instead of the plain residual sum:

    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i,   w = norm * proj   (float32)

The keys are the sources after an RMSNorm without gain (the gain is folded into the query).
Zero-initialised ``proj`` gives uniform weights: the mean of the sources. The op is
:func:`pallas_kernels.attn_res.attn_res` (XLA, or fused Triton kernels on GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels.attn_res as attn_res_ops
from k3jax.nn import constant, param
from sharding.rules import logical_spec, per_device, shard


def attn_res(sources: Sequence[jax.Array], proj: jax.Array, norm: jax.Array | None, eps: float,
             implementation: str | None = None) -> jax.Array:
  """Mixes ``sources`` (each ``[B, T, d]``) with query ``norm * proj`` (each ``[d]``; norm None:
  proj is the whole query, :meth:`AttnRes.fold`).

  Returns ``[B, T, d]`` in the sources' dtype; the softmax and the sum run in float32 (or wider
  in the XLA form). ``implementation``: see :mod:`pallas_kernels.attn_res`. Under a device mesh
  the kernels run on each device's share of the tokens (the op is per token); with d split over
  devices it keeps the XLA form, whose sums over d cross the pieces.
  """
  xs = logical_spec(("batch", "length", "embed"))
  impl = "xla" if xs[2] is not None else attn_res_ops.resolve(implementation)
  if impl == "xla":
    return attn_res_ops.attn_res(sources, proj, norm, eps, implementation=impl)
  weights = (proj,) if norm is None else (proj, norm)
  fn = per_device(lambda s, p, n=None: attn_res_ops.attn_res(s, p, n, eps, implementation=impl),
                  ((xs,) * len(sources),) + (None,) * len(weights), xs)
  return fn(tuple(sources), *weights)


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
    return attn_res(sources, self.proj[...], None if self.norm is None else self.norm[...],
                    self.eps, self.implementation)

  def fold(self) -> None:
    """Turns this query into the serving layout: ``proj`` becomes the whole query ``norm *
    proj`` in float32 and ``norm`` None, so that a decoding step forms no product of two
    parameters (one small kernel per AttnRes and step otherwise). The serving engine calls this
    on its own copy of the model; checkpoints and training keep both parameters."""
    w = self.norm[...].astype(jnp.float32) * self.proj[...].astype(jnp.float32)
    self.proj = self.proj.replace(w)
    self.norm = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockBuffer:
  """The committed block summaries as a fixed-shape carry of a layer scan (k3jax/scan.py):
  ``buf [NB, B, T, d]`` holds the ``count`` (int32 scalar, at least 1) blocks first and zeros
  after. Mixing and committing give what the tuple of blocks gives, bit for bit."""
  buf: jax.Array
  count: jax.Array

  @classmethod
  def of(cls, blocks: tuple, size: int) -> "BlockBuffer":
    """The buffer of ``size`` slots holding ``blocks`` (a non-empty tuple of ``[B, T, d]``)."""
    pad = (jnp.zeros_like(blocks[0]),) * (size - len(blocks))
    return cls(shard(jnp.stack(blocks + pad), _BUF), jnp.int32(len(blocks)))

  def blocks(self, count: int) -> tuple:
    """The first ``count`` blocks as a tuple (``count``: what ``self.count`` holds, known)."""
    return tuple(self.buf[i] for i in range(count))

  def mix(self, res: AttnRes, prefix: jax.Array) -> jax.Array:
    """``res(blocks + (prefix,))``: one branch per block count, each the op on that many
    sources (:func:`switch_vjp`)."""
    def branch(k):
      return lambda buf, x, proj, norm: attn_res(tuple(buf[i] for i in range(k)) + (x,), proj,
                                                 norm, res.eps, res.implementation)
    return switch_vjp(self.count - 1, [branch(k) for k in range(1, len(self.buf) + 1)],
                      self.buf, prefix, res.proj[...], res.norm[...])

  def commit(self, prefix: jax.Array, now: jax.Array) -> tuple["BlockBuffer", jax.Array]:
    """Where ``now`` (a traced bool): (the buffer with ``prefix`` appended, zeros to start the
    next block's partial sum); else (the same buffer, ``prefix``)."""
    slot = jnp.where(now, prefix, self.buf[self.count])
    buf = jax.lax.dynamic_update_index_in_dim(self.buf, slot, self.count, 0)
    return (BlockBuffer(shard(buf, _BUF), self.count + now.astype(jnp.int32)),
            jnp.where(now, jnp.zeros_like(prefix), prefix))


def switch_vjp(index: jax.Array, branches: Sequence, *args):
  """``jax.lax.switch(index, branches, *args)`` (``args`` arrays, all differentiable) whose VJP
  keeps only ``args`` and runs the taken branch's own VJP inside a switch. Autodiff of a switch
  instead returns the residuals of every branch from its forward, all live until the backward:
  for a layer scan's AttnRes mixes in the XLA form (TPU) the branches' float32 copies of their
  sources, 18 ``[B, T, d]`` float32 arrays per mix for K3's 8 block slots. The taken branch's
  forward runs again in the backward."""
  @jax.custom_vjp
  def run(index, *args):
    return jax.lax.switch(index, branches, *args)

  def fwd(index, *args):
    return run(index, *args), (index, args)

  def bwd(saved, ct):
    index, args = saved
    vjps = [lambda ct, *a, f=f: jax.vjp(f, *a)[1](ct) for f in branches]
    return (np.zeros(index.shape, jax.dtypes.float0), *jax.lax.switch(index, vjps, ct, *args))

  run.defvjp(fwd, bwd)
  return run(index, *args)


_BUF = ("blocks", "batch", "length", "embed")
