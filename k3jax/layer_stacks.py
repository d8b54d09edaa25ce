"""Per-layer trees with the scanned layers stacked: the layout a scanned run trains in.

Under ``model.scan_layers`` the layers at position ``j`` of the scanned groups
(:meth:`ModelConfig.layer_groups`; K3: 4 positions of 22 layers each) have one structure and
shapes. A ``layer_stacks`` tree holds each such position as one ``layer_stacks[j]`` entry whose
leaves are the layers' leaves stacked on a leading ``layers`` axis, in the scan's group order.

A scanned run's :class:`~k3jax.train_state.TrainState` keeps its parameters and optimizer state
in this layout from step to step: the scan consumes the stacked parameters as they are
(:func:`merge`), its gradients come out stacked, and the optimizer updates the stacked leaves in
place, so the compiled step neither stacks nor slices a parameter or a moment (XLA compiles one op
per position and parameter instead of one per layer). The model itself keeps one module per
layer (decoding, conversion and ``from_pretrained`` see it unchanged), and the tree is unstacked
only where one entry per layer is read: checkpoints (whose layout on disk is per layer, so either
setting restores the other's), initialising from pretrained weights and anything handed the
model's state.

Every dict holding a ``layers`` entry is stacked, wherever it sits in the tree: the parameter
tree and the parts of an optimizer state that mirror it alike.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.config.model import group_positions

STACKS = "layer_stacks"


def positions(m: ModelConfig) -> list[list[int]]:
  """The layer indices stacked together, one list per position of the scanned groups, in the
  scan's group order; [] when the decoder is not scanned."""
  if not m.scan_layers:
    return []
  if m.layer_groups()[2] < 2:
    return []
  return m.scan_positions()


def stack(tree, stacks: list[list[int]], join: Callable = lambda *xs: jnp.stack(xs),
          is_leaf: Callable | None = None) -> Any:
  """``tree`` with, in every dict holding ``layers``, the layers of ``stacks[j]`` taken out of
  ``layers`` and joined leaf by leaf by ``join`` (default: stacked on a new leading axis) into
  ``layer_stacks[j]``. ``is_leaf``: the leaves of the layers' subtrees, for trees of static
  values (tuples of names). A dict stacked already is left as it is."""
  if not stacks:
    return tree

  def one(d):
    if not (isinstance(d, dict) and "layers" in d) or STACKS in d:
      return d
    layers = dict(d["layers"])
    joined = {j: jax.tree.map(join, *[layers.pop(i) for i in idx], is_leaf=is_leaf)
              for j, idx in enumerate(stacks)}
    return {**d, "layers": layers, STACKS: joined}

  return jax.tree.map(one, tree, is_leaf=lambda d: isinstance(d, dict) and "layers" in d)


def _take(x, k: int):
  """Layer ``k`` of a stacked leaf: ``x[k]``, or for a ``ShapeDtypeStruct`` the layer's shape
  laid out as the stack is behind its (unsplit) ``layers`` axis."""
  if not isinstance(x, jax.ShapeDtypeStruct):
    return x[k]
  s = x.sharding
  if isinstance(s, jax.sharding.NamedSharding):
    s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]))
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)


def unstack(tree, stacks: list[list[int]]) -> Any:
  """The inverse of :func:`stack` (arrays or ``ShapeDtypeStruct``s): every ``layer_stacks``
  entry split back into its layers."""
  if not stacks:
    return tree

  def one(d):
    if not (isinstance(d, dict) and STACKS in d):
      return d
    layers = dict(d["layers"])
    for j, idx in enumerate(stacks):
      for k, i in enumerate(idx):
        layers[i] = jax.tree.map(lambda x, k=k: _take(x, k), d[STACKS][j])
    rest = {key: v for key, v in d.items() if key != STACKS}
    return {**rest, "layers": dict(sorted(layers.items()))}

  return jax.tree.map(one, tree, is_leaf=lambda d: isinstance(d, dict) and STACKS in d)


def is_names(x) -> bool:
  """A leaf of a logical axis names tree: a tuple of names, or None."""
  return x is None or (isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x))


def stack_names(names, stacks: list[list[int]]) -> Any:
  """The logical axis names (:func:`sharding.names_tree`) of the parameters stacked by
  ``stacks``: each stacked leaf's names behind ``layers``."""
  return stack(names, stacks, join=lambda n, *_: None if n is None else ("layers",) + n,
               is_leaf=is_names)


def held(params) -> list[list[int]]:
  """The ``stacks`` a parameter tree (the model's pure dict) is stacked by; [] when it holds every
  layer. The stacked layers are the ones missing from ``layers``, from the first missing one on
  (:meth:`ModelConfig.scan_positions`)."""
  if not (isinstance(params, dict) and STACKS in params):
    return []
  p = len(params[STACKS])
  g = jax.tree.leaves(params[STACKS][0])[0].shape[0]
  start = next(i for i in range(len(params["layers"]) + 1) if i not in params["layers"])
  return group_positions(start, p, g)


def merge(graphdef, params, *states):
  """(the model of ``graphdef`` merged with the pure dicts ``params`` and ``states``, the scanned
  layers' stacked parameters ``(layer_stacks[j], ...)`` or None). ``params`` may be stacked
  (:func:`held`): the model's scanned layers then hold their parameters as shapes only, and
  :meth:`~k3jax.model.K3Model.hidden` takes the stacked ones as its ``stacked`` argument."""
  stacks = held(params)
  if not stacks:
    return nnx.merge(graphdef, params, *states), None
  shapes = unstack(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), stacks)
  layers = {i: params["layers"].get(i, x) for i, x in shapes["layers"].items()}
  per_layer = {**{k: v for k, v in params.items() if k != STACKS}, "layers": layers}
  stacked = tuple(params[STACKS][j] for j in range(len(stacks)))
  return nnx.merge(graphdef, per_layer, *states), stacked
