"""Scanned decoder layer groups (``model.scan_layers``).

The decoder layers ``start .. start + G*P - 1`` of :meth:`ModelConfig.layer_groups` (K3: layers
1-88, 22 groups of 3 KDA + 1 MLA) run as one ``lax.scan`` over the G groups: XLA compiles one
group instead of every layer. The parameters of the layers at position ``j`` of the groups are
stacked on a leading ``layers`` axis (unsharded): a scanned run's train state holds them so
(:mod:`k3jax.layer_stacks`) and hands them in as they are; a model holding one entry per layer
(evaluation, scoring, tests) has them stacked here. Conversion and checkpoints keep one entry per
layer, so either setting reads the other's files.
Block AttnRes sources cross the scan as a :class:`~k3jax.attn_res.BlockBuffer` and the router
statistics come out per layer index as in the unrolled decoder. Calls with a decode cache run the
layers unrolled: stacking the caches would copy every layer's cache pools at each step, and the
parameters are the same either way.

Under ``remat: full`` with AttnRes the scan keeps each layer's input (as the unrolled decoder
does) and its backward rebuilds the block buffer a layer saw from the scan's final one (blocks are
only appended, so the first ``count`` slots are the same and the rest zeros): autodiff of a scan
would instead keep the whole buffer for every layer. Every other setting is a plain ``lax.scan``
whose layers run under the same remat policy and gradient barrier as unrolled ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding.mesh as mesh_lib
from k3jax.attn_res import BlockBuffer
from sharding.rules import logical_spec


def balance_barrier(x, stats):
  """(x, stats) once a layer's balancing statistics are taken: otherwise XLA computes every
  layer's histogram bins in one fusion after the last layer, keeping each layer's router scores
  [tokens, E] live until then."""
  return jax.lax.optimization_barrier((x, stats))


def _stack(states: list):
  """The layers' states ``states`` (of one structure) stacked on a new leading axis; under a mesh
  a parameter keeps its layer's layout behind the ``layers`` axis."""
  mesh = jax.sharding.get_abstract_mesh()

  def stack(*vs):
    v, names = jnp.stack([x[...] for x in vs]), mesh_lib.var_names(vs[0])
    if names and not mesh.empty:
      spec = mesh_lib.param_spec(names, vs[0].shape, mesh)
      v = jax.lax.with_sharding_constraint(v, P(*logical_spec(("layers",)), *spec))
    return vs[0].replace(v)
  return jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _held(layers, row: list[int], stacked):
  """(graphdef, state) of the layers ``row`` of one position, their parameters the pure dict
  ``stacked`` (stacked already) and their other state (router biases) stacked here."""
  split = [nnx.split(layers[i], nnx.Param, ...) for i in row]
  graphdef, params, _ = split[0]
  nnx.replace_by_pure_dict(params, stacked)
  return graphdef, nnx.merge_state(params, _stack([rest for _, _, rest in split]))


def run_groups(cfg, layers, layer_call, x, blocks, segment_ids, valid, stacked=None):
  """The scanned layers of :meth:`K3Model.hidden` (training and scoring: no cache): ``layers``
  its ``nnx.List``, ``layer_call`` :func:`k3jax.model.layer_call`, x ``[B, T, d]``, blocks the
  committed AttnRes blocks (a tuple), ``stacked`` the parameters of each position stacked
  (:func:`k3jax.layer_stacks.merge`; None: stacked here from ``layers``). Returns (x, blocks,
  {layer index (str): router stats})."""
  start, p, g = cfg.layer_groups()
  end = start + p * g
  index = cfg.scan_positions()  # [position][group]
  if stacked is None:
    split = [[nnx.split(layers[i]) for i in row] for row in index]
    graphdefs = [row[0][0] for row in split]
    params = tuple(_stack([state for _, state in row]) for row in split)
  else:
    graphdefs, params = zip(*[_held(layers, row, s) for row, s in zip(index, stacked)])
  n_blocks = -(-end // cfg.attn_res.block_size)  # blocks committed once the scan is done
  if cfg.attn_res.enabled:
    blocks = BlockBuffer.of(blocks, n_blocks)
  if cfg.remat == "full" and cfg.attn_res.enabled:
    fns = [_pure_layer(graphdefs[j], start + j, p, segment_ids, valid) for j in range(p)]
    x, blocks, stats = _recompute_scan(fns, params, x, blocks, cfg.layer_grad_barrier)
  else:
    calls = [layer_call(cfg, row[0]) for row in index]

    def body(carry, xs):
      x, blocks = carry
      k, states = xs
      stats = []
      for j, call in enumerate(calls):
        x, blocks, _, s = call(nnx.merge(graphdefs[j], states[j]), x, blocks, segment_ids, valid,
                               None, False, None, start + k * p + j)
        if s is not None:
          x, s = balance_barrier(x, s)
        stats.append(s)
      return (x, blocks), tuple(stats)

    (x, blocks), stats = jax.lax.scan(body, (x, blocks), (jnp.arange(g), params))
  at = {i: (j, k) for j, row in enumerate(index) for k, i in enumerate(row)}
  moe_stats = {str(i): jax.tree.map(lambda v, k=at[i][1]: v[k], stats[at[i][0]])
               for i in range(start, end) if stats[at[i][0]] is not None}
  if cfg.attn_res.enabled:
    blocks = blocks.blocks(n_blocks)
  return x, blocks, moe_stats


def _pure_layer(graphdef, first: int, p: int, segment_ids, valid):
  """A scanned position's layer as ``f(params, x, blocks, group) -> (x, blocks, stats)`` (no
  remat, no cache): layer ``first + group * p``."""
  def f(state, x, blocks, k):
    layer = nnx.merge(graphdef, state)
    x, blocks, _, stats = layer(x, blocks, segment_ids=segment_ids, valid=valid,
                                idx=first + k * p)
    return x, blocks, stats
  return f


def _recompute_scan(fns, params, x, blocks: BlockBuffer, barrier: bool):
  """``lax.scan`` over groups of the layers ``fns`` (``f(params, x, blocks, group) -> (x, blocks,
  stats)``, one per position, ``params`` a tuple of their stacked parameters) whose backward
  reruns one layer at a time from its saved input ``x`` and the block buffer rebuilt from the
  final one. ``barrier``: each layer's parameter gradients are done before the layer below
  starts (``model.layer_grad_barrier``). Returns (x, blocks, stats per position)."""
  g = jax.tree.leaves(params[0])[0].shape[0]
  slots = blocks.buf.shape[0]

  def forward(params, x, blocks):
    def body(carry, xs):
      x, blocks = carry
      k, states = xs
      saved, stats = [], []
      for j, f in enumerate(fns):
        saved.append((x, blocks.count))
        x, blocks, s = f(states[j], x, blocks, k)
        if s is not None:
          x, s = balance_barrier(x, s)
        stats.append(s)
      return (x, blocks), (tuple(saved), tuple(stats))
    (x, blocks), (saved, stats) = jax.lax.scan(body, (x, blocks), (jnp.arange(g), params))
    return (x, blocks, stats), (params, saved, blocks.buf)

  @jax.custom_vjp
  def run(params, x, blocks):
    return forward(params, x, blocks)[0]

  def backward(res, ct):
    params, saved, final = res
    dx, dblocks, _ = ct
    slot = jnp.arange(slots).reshape(-1, 1, 1, 1)

    def body(carry, xs):
      dx, dbuf = carry
      k, states, saved_k = xs
      grads = [None] * len(fns)
      for j in reversed(range(len(fns))):
        # the layer's recompute waits for the cotangent from above: XLA would otherwise run the
        # group's recomputes first and hold all their residuals at once
        (x_j, count), dx, dbuf = jax.lax.optimization_barrier((saved_k[j], dx, dbuf))
        buf = jnp.where(slot < count, final, jnp.zeros_like(final))
        pure = lambda state, x, buf, j=j, count=count: fns[j](
            state, x, BlockBuffer(buf, count), k)[:2]
        _, vjp = jax.vjp(lambda state, x, buf: _x_buf(pure(state, x, buf)), states[j], x_j, buf)
        grads[j], dx, dbuf = vjp((dx, dbuf))
        if barrier:
          grads[j], dx, dbuf = jax.lax.optimization_barrier((grads[j], dx, dbuf))
      return (dx, dbuf), tuple(grads)

    (dx, dbuf), grads = jax.lax.scan(body, (dx, dblocks.buf), (jnp.arange(g), params, saved),
                                     reverse=True)
    return grads, dx, BlockBuffer(dbuf, np.zeros((), jax.dtypes.float0))

  run.defvjp(forward, backward)
  return run(params, x, blocks)


def _x_buf(out):
  x, blocks = out
  return x, blocks.buf
