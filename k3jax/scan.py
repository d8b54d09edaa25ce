"""Scanned decoder layer groups (``model.scan_layers``).

The decoder layers ``start .. start + G*P - 1`` of :meth:`ModelConfig.layer_groups` (K3: layers
3-90, 22 groups of 1 MLA + 3 KDA) run as one ``lax.scan`` over the G groups: XLA compiles one
group instead of every layer. Under full remat the like layers of a group
(:meth:`ModelConfig.group_runs`; K3: the three KDA layers) run as an inner ``lax.scan`` over their
parameters stacked in the step, so one of them is compiled, and so do the runs of like layers
outside the groups (:meth:`ModelConfig.layer_runs`, :func:`run_layers`; K3: layers 1-2 and
91-92). The parameters of the layers at position ``j`` of the groups are
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
  runs = cfg.group_runs()
  if cfg.remat == "full" and cfg.attn_res.enabled:
    fns = [_pure_layer(graphdefs[j], segment_ids, valid) for j in range(p)]
    x, blocks, stats = _recompute_scan(fns, runs, start, params, x, blocks, cfg.layer_grad_barrier)
  else:
    fns = [_called_layer(layer_call(cfg, row[0]), graphdefs[j], segment_ids, valid)
           for j, row in enumerate(index)]

    def body(carry, xs):
      k, states = xs
      stats = []
      for j, r in runs:
        carry, s = _run(fns[j], _stack(states[j:j + r]), carry, start + k * p + j)
        stats += _unstack(s, r)
      return carry, tuple(stats)

    (x, blocks), stats = jax.lax.scan(body, (x, blocks), (jnp.arange(g), params))
  at = {i: (j, k) for j, row in enumerate(index) for k, i in enumerate(row)}
  moe_stats = {str(i): jax.tree.map(lambda v, k=at[i][1]: v[k], stats[at[i][0]])
               for i in range(start, end) if stats[at[i][0]] is not None}
  if cfg.attn_res.enabled:
    blocks = blocks.blocks(n_blocks)
  return x, blocks, moe_stats


def run_layers(call, layers: list, x, blocks, segment_ids, valid, first: int):
  """A run of back-to-back like layers outside the scanned groups, none committing an AttnRes
  block (:meth:`ModelConfig.layer_runs`): ``call`` (:func:`k3jax.model.layer_call` of the
  first) over their states stacked here, as one ``lax.scan``; ``blocks`` a tuple (it does not
  grow, so the scan closes over it rather than carrying it: a carry would be saved for every
  layer's backward). Returns (x, blocks, {layer index (str): router stats})."""
  f = _called_layer(call, nnx.split(layers[0])[0], segment_ids, valid)

  def step(x, state, idx):
    (x, _), s = f((x, blocks), state, idx)
    return x, s

  x, stats = _run(step, _stack([nnx.split(layer)[1] for layer in layers]), x, first)
  return x, blocks, {str(first + i): s for i, s in enumerate(_unstack(stats, len(layers)))
                     if s is not None}


def _called_layer(call, graphdef, segment_ids, valid):
  """``call`` (:func:`k3jax.model.layer_call`'s) as :func:`_run`'s ``f((x, blocks), state,
  idx) -> ((x, blocks), router stats)``, the stats taken behind :func:`balance_barrier`."""
  def f(carry, state, idx):
    x, blocks, _, s = call(nnx.merge(graphdef, state), *carry, segment_ids, valid, None, False,
                           None, idx)
    if s is not None:
      x, s = balance_barrier(x, s)
    return (x, blocks), s
  return f


def _run(f, xs, carry, first, reverse=False):
  """``r`` layers of one structure carried through in turn: ``f(carry, x, idx) -> (carry,
  out)`` with ``x`` layer ``i``'s slice of ``xs`` (leaves ``[r, ...]``) and ``idx`` ``first +
  i`` (``reverse``: the last layer first). More than one layer runs as a ``lax.scan``: XLA
  compiles one of them. Returns (carry, outs stacked ``[r, ...]``)."""
  r = jax.tree.leaves(xs)[0].shape[0]
  if r == 1:
    carry, out = f(carry, jax.tree.map(lambda v: v[0], xs), first)
    return carry, jax.tree.map(lambda v: v[None], out)
  return jax.lax.scan(lambda c, ix: f(c, ix[1], first + ix[0]), carry, (jnp.arange(r), xs),
                      reverse=reverse)


def _unstack(tree, r: int) -> list:
  """``tree``'s leaves ``[r, ...]`` -> the ``r`` trees of their slices."""
  return [jax.tree.map(lambda v, i=i: v[i], tree) for i in range(r)]


def _pure_layer(graphdef, segment_ids, valid):
  """A scanned position's layer as ``f(params, x, blocks, idx) -> (x, blocks, stats)`` (no
  remat, no cache), ``idx`` the layer's traced index."""
  def f(state, x, blocks, idx):
    layer = nnx.merge(graphdef, state)
    x, blocks, _, stats = layer(x, blocks, segment_ids=segment_ids, valid=valid, idx=idx)
    return x, blocks, stats
  return f


def _recompute_scan(fns, runs, start, params, x, blocks: BlockBuffer, barrier: bool):
  """``lax.scan`` over groups of the layers ``fns`` (``f(params, x, blocks, idx) -> (x, blocks,
  stats)``, one per position, ``params`` a tuple of their stacked parameters; ``runs`` the
  group's runs of like positions, :meth:`ModelConfig.group_runs`; the first group's first layer
  is ``start``) whose backward reruns one layer at a time from its saved input ``x`` and the
  block buffer rebuilt from the final one. ``barrier``: each layer's parameter gradients are done
  before the layer below starts (``model.layer_grad_barrier``). Returns (x, blocks, stats per
  position)."""
  g = jax.tree.leaves(params[0])[0].shape[0]
  p = len(fns)
  slots = blocks.buf.shape[0]

  def forward(params, x, blocks):
    def body(carry, xs):
      k, states = xs
      saved, stats = [], []
      for j, r in runs:
        def layer(carry, state, idx, f=fns[j]):
          x, blocks, s = f(state, *carry, idx)
          if s is not None:
            x, s = balance_barrier(x, s)
          return (x, blocks), ((carry[0], carry[1].count), s)
        carry, (saved_run, s) = _run(layer, _stack(states[j:j + r]), carry, start + k * p + j)
        saved.append(saved_run)
        stats += _unstack(s, r)
      return carry, (tuple(saved), tuple(stats))
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
      k, states, saved_k = xs
      grads = [None] * p
      for (j, r), saved_run in reversed(list(zip(runs, saved_k))):
        def layer(carry, xs, idx, f=fns[j]):
          state, saved_i = xs
          # the layer's recompute waits for the cotangent from above: XLA would otherwise run the
          # group's recomputes first and hold all their residuals at once
          (x_j, count), dx, dbuf = jax.lax.optimization_barrier((saved_i, *carry))
          buf = jnp.where(slot < count, final, jnp.zeros_like(final))
          pure = lambda state, x, buf: _x_buf(f(state, x, BlockBuffer(buf, count), idx)[:2])
          _, vjp = jax.vjp(pure, state, x_j, buf)
          grad, dx, dbuf = vjp((dx, dbuf))
          if barrier:
            grad, dx, dbuf = jax.lax.optimization_barrier((grad, dx, dbuf))
          return (dx, dbuf), grad
        carry, grad = _run(layer, (_stack(states[j:j + r]), saved_run), carry,
                           start + k * p + j, reverse=True)
        grads[j:j + r] = _unstack(grad, r)
      return carry, tuple(grads)

    (dx, dbuf), grads = jax.lax.scan(body, (dx, dblocks.buf), (jnp.arange(g), params, saved),
                                     reverse=True)
    return grads, dx, BlockBuffer(dbuf, np.zeros((), jax.dtypes.float0))

  run.defvjp(forward, backward)
  return run(params, x, blocks)


def _x_buf(out):
  x, blocks = out
  return x, blocks.buf
