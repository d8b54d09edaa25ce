"""Logical axis names and the rules that map them to mesh axes.

Every parameter carries ``sharding_names`` (a tuple of logical names, one per dimension) and every
large activation passes through :func:`shard`. The logical names are:

  batch, length, embed, vocab, heads, kv_heads, head_dim, kv (latent / key dims), mlp,
  expert, latent, conv, blocks, state_k, state_v

With no mesh set (``jax.set_mesh``) everything runs unchanged on one device. A name without a rule
is replicated; a rule naming a mesh axis the current mesh lacks is dropped, so one rule table
serves every layout.
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# logical name -> mesh axes (a tuple: the dimension is split over their product)
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("context",),
    # Parameters are ZeRO-3 sharded over every axis that splits tokens except "data" (pure
    # replication). Activations give those axes to "batch" / "length" first, so in an
    # activation spec these names only ever get what is left ("tensor").
    "embed": ("fsdp", "context", "expert"),
    "kv": ("fsdp", "context", "expert"),
    "heads": ("tensor", "fsdp", "context", "expert"),
    "vocab": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "expert": ("expert",),
    "latent": ("fsdp", "context"),  # routed expert weights: E on "expert", latent like "embed"
    "head_dim": (),
    "conv": (),
    "blocks": (),
    "state_k": (),
    "state_v": (),
}


_ACTIVE: dict[str, tuple[str, ...]] = dict(DEFAULT_RULES)


def configure(*, expert_axes=("expert",)) -> None:
  """Sets the rules used when none are passed: :data:`DEFAULT_RULES` with the routed experts
  split over ``expert_axes`` (``mesh.expert_axes``)."""
  _ACTIVE.clear()
  _ACTIVE.update(DEFAULT_RULES, expert=tuple(expert_axes))


def logical_spec(names: Sequence[str | None], rules: dict[str, tuple[str, ...]] | None = None,
                 mesh_axes: Sequence[str] | None = None) -> P:
  """PartitionSpec for logical ``names`` under ``rules``, keeping only axes the mesh has.

  A mesh axis is used at most once per spec (the first dimension that asks for it gets it).
  """
  rules = _ACTIVE if rules is None else rules
  if mesh_axes is None:
    mesh = jax.sharding.get_abstract_mesh()
    mesh_axes = () if mesh.empty else mesh.axis_names
    sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
  else:
    sizes = {a: 2 for a in mesh_axes}
  used: set[str] = set()
  out = []
  for name in names:
    axes = tuple(a for a in rules.get(name, ()) if name is not None and a in mesh_axes
                 and a not in used and sizes.get(a, 1) > 1)
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def named_sharding(mesh: jax.sharding.Mesh, names: Sequence[str | None],
                   rules: dict[str, tuple[str, ...]] | None = None) -> NamedSharding:
  return NamedSharding(mesh, logical_spec(names, rules, mesh.axis_names))


def shard(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Constrains activation ``x`` to its logical layout on the current mesh (no-op without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  if len(names) != x.ndim:
    raise ValueError(f"shard: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
  return jax.lax.with_sharding_constraint(x, logical_spec(names))
