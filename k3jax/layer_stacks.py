"""Per-layer trees with the scanned layers stacked, for the work done once per step on them.

Under ``model.scan_layers`` the layers at position ``j`` of the scanned groups
(:meth:`ModelConfig.layer_groups`; K3: 4 positions of 22 layers each) have one structure and
shapes. The training step's gradient norm and the optimizer see each such position as one
``layer_stacks`` entry whose leaves are the layers' leaves stacked on a leading axis, so XLA
compiles one op per position and parameter instead of one per layer (the scan's own gradients
come out stacked in this order). The parameter tree, the optimizer state and checkpoints keep one
entry per layer: trees are stacked where the step needs them and unstacked at its end.

Every dict holding a ``layers`` entry is stacked, wherever it sits in the tree: the parameter
tree and the parts of an optimizer state that mirror it alike.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig

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


def unstack(tree, stacks: list[list[int]]) -> Any:
  """The inverse of :func:`stack` (arrays): every ``layer_stacks`` entry split back into its
  layers."""
  if not stacks:
    return tree

  def one(d):
    if not (isinstance(d, dict) and STACKS in d):
      return d
    layers = dict(d["layers"])
    for j, idx in enumerate(stacks):
      for k, i in enumerate(idx):
        layers[i] = jax.tree.map(lambda x, k=k: x[k], d[STACKS][j])
    rest = {key: v for key, v in d.items() if key != STACKS}
    return {**rest, "layers": dict(sorted(layers.items()))}

  return jax.tree.map(one, tree, is_leaf=lambda d: isinstance(d, dict) and STACKS in d)

