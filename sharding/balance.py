"""Quantile Balancing at scale (SPEC section 5): the router-bias statistic of a micro-batch
whose tokens are split over the mesh.

With ``balancing: quantile_hist`` each device builds the per-expert histogram ``[E, bins]`` of
its own tokens (:func:`k3jax.router.quantile_histogram`) and one ``psum`` over every token axis
(``data, fsdp, expert, context``) sums them: traffic ``E * bins`` int32 per step and layer,
independent of the batch. The bins depend only on the current bias, which is replicated, so
every rank reads the same counts and computes the same next bias. Other balancing modes use
:func:`k3jax.router.bias_stat` on the global arrays (GSPMD inserts their collectives; exact QB
then selects with XLA's reductions rather than the one-device Pallas kernel).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from k3jax import router
from k3jax.config import MoEConfig
from sharding.rules import token_spec


def bias_stat(scores, bias, ids, cfg: MoEConfig, valid=None):
  """:func:`k3jax.router.bias_stat` for scores ``[N, E]``, ids ``[N, k]``, valid ``[N]`` whose N
  is split over the token axes of the current mesh."""
  spec = token_spec()
  if cfg.balancing != "quantile_hist" or spec[0] is None:
    # Tokens split over the mesh: exact QB's select stays in XLA, whose count reductions GSPMD
    # splits too (the Pallas select would gather every rank's margins first).
    select = None if spec[0] is None else "xla"
    return router.bias_stat(scores, bias, ids, cfg, valid, implementation=select)
  axes = spec[0]

  def body(s, b, *v):
    hist = router.quantile_histogram(s, b, cfg, v[0] if v else None)
    return jax.lax.psum(hist, axes)

  args = (scores, bias) + (() if valid is None else (valid,))
  specs = (spec, P()) + (() if valid is None else (P(axes),))
  return jax.shard_map(body, in_specs=specs, out_specs=P(), check_vma=False)(*args)


__all__ = ["bias_stat"]
