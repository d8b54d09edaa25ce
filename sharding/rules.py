"""Logical axis names and the rules that map them to mesh axes.

Every parameter carries ``sharding_names`` (a tuple of logical names, one per dimension) and every
large activation passes through :func:`shard`. The logical names are:

  batch, length, embed, vocab, heads, kv_heads, head_dim, kv (latent / key dims), mlp,
  expert, latent, conv, blocks, state_k, state_v, layers (the stacked leading axis of scanned
  layer groups' parameters, k3jax/scan.py); the vision tower's patch (a flattened pixel patch),
  grid (its learned positional grid) and vision_merge (a visual token's concatenated patches)

With no mesh set (``jax.set_mesh``) everything runs unchanged on one device. A name without a rule
is replicated; a rule naming a mesh axis the current mesh lacks is dropped, so one rule table
serves every layout.

The layout choices of ``MeshConfig`` that are not axis sizes (the axes the routed experts are split
over, MoonEP) hold inside ``with layout(cfg.mesh): ...`` and are restored on exit; they are part of
JAX's tracing and compilation cache keys, so a function traced under one layout is traced again
under another.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

TOKEN_AXES = ("data", "fsdp", "expert", "context")  # the mesh axes a batch's tokens are split over

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
    "layers": (),
    "state_k": (),
    "state_v": (),
  "patch": (),
  "grid": (),
  "vision_merge": ("fsdp", "context", "expert"),  # like "embed": ZeRO-3 over the token axes
}


# Serving keeps no ZeRO-3 split: a decode step would all-gather every dense weight, each step
# (benchmarks/RESULTS.md, Serving: the serving engine on a mesh). Heads and mlp columns go over
# ``tensor`` only; the routed experts keep their ``expert`` rule.
SERVING_RULES: dict[str, tuple[str, ...]] = {
    "embed": (), "kv": (), "latent": (), "vision_merge": (), "heads": ("tensor",)}


@dataclasses.dataclass(frozen=True)
class Layout:
  """The layout choices of ``MeshConfig`` beyond the axis sizes: the mesh axes the routed experts
  are split over (``mesh.expert_axes``: the ``expert`` rule), MoonEP (``mesh.moonep``), and
  whether it serves (:data:`SERVING_RULES`, no MoonEP)."""
  expert_axes: tuple[str, ...] = ("expert",)
  moonep: bool = True
  serving: bool = False

  @property
  def rules(self) -> dict[str, tuple[str, ...]]:
    """:data:`DEFAULT_RULES` with the ``expert`` rule of this layout (and, serving,
    :data:`SERVING_RULES`)."""
    return {**DEFAULT_RULES, **(SERVING_RULES if self.serving else {}), "expert": self.expert_axes}


_LAYOUT = jax.make_user_context(Layout())


@contextlib.contextmanager
def layout(mesh_cfg, serving: bool = False):
  """``with layout(cfg.mesh): ...``: the layout of ``MeshConfig`` ``mesh_cfg`` (see
  :class:`Layout`) for the rules used when none are passed and for expert parallelism; the one
  before is restored on exit. ``serving``: the serving engine's (no ZeRO-3 split, and no MoonEP,
  whose per-step fetch of hot experts' weights is a training device that would copy them at
  every decode step: benchmarks/RESULTS.md, Serving: the serving engine on a mesh)."""
  with _LAYOUT(Layout(tuple(mesh_cfg.expert_axes), bool(mesh_cfg.moonep) and not serving,
                      serving)):
    yield


def active_layout() -> Layout:
  """The :class:`Layout` of the innermost :func:`layout` (the defaults outside any)."""
  return _LAYOUT.value


def logical_spec(names: Sequence[str | None], rules: dict[str, tuple[str, ...]] | None = None,
                 mesh_axes: Sequence[str] | None = None) -> P:
  """PartitionSpec for logical ``names`` under ``rules``, keeping only axes the mesh has.

  A mesh axis is used at most once per spec (the first dimension that asks for it gets it).
  """
  rules = active_layout().rules if rules is None else rules
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


def token_spec() -> P:
  """PartitionSpec of a flat ``[N, ...]`` token array: N over every token axis of the mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
  axes = tuple(a for a in TOKEN_AXES if sizes.get(a, 1) > 1)
  return P(axes if axes else None, None)


def token_sum(fn, tokens: Sequence[jax.Array], replicated: Sequence[jax.Array] = ()):
  """``fn(*tokens, *replicated)`` summed over the devices: each applies ``fn`` to its share of
  ``tokens`` (arrays ``[N, ...]`` whose N is split over the token axes of the current mesh, as
  :func:`token_spec` says) and the whole ``replicated`` arrays, and one ``psum`` over the token
  axes adds the results (replicated on every device). Without a mesh splitting N: ``fn`` on the
  whole arrays."""
  axes = token_spec()[0]
  if axes is None:
    return fn(*tokens, *replicated)
  specs = tuple(P(axes, *([None] * (x.ndim - 1))) for x in tokens) + (P(),) * len(replicated)
  body = lambda *a: jax.lax.psum(fn(*a), axes)
  return jax.shard_map(body, in_specs=specs, out_specs=P(), check_vma=False)(*tokens, *replicated)


def per_device(fn, in_names, out_names):
  """``fn`` run on each device's share of its arguments: a ``jax.shard_map`` whose specs are the
  logical layouts ``in_names`` (one per argument, a pytree for a pytree argument: a tuple of
  logical names, a ``PartitionSpec``, or None for a replicated argument such as a small
  parameter) and ``out_names`` (the same for the outputs). Kernels (Pallas' Triton, Mosaic GPU
  and Mosaic TPU custom calls) need this: the SPMD partitioner cannot split a custom call, so on
  GPU it gathers every operand and runs the whole batch on every device, and on TPU it refuses.
  Without a mesh, or on one device, ``fn`` itself."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn
  spec = lambda n: n if isinstance(n, P) else P() if n is None else logical_spec(n)
  is_names = lambda x: x is None or isinstance(x, P) or (
      isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))
  specs = lambda tree: jax.tree.map(spec, tree, is_leaf=is_names)
  return jax.shard_map(fn, in_specs=specs(tuple(in_names)), out_specs=specs(out_names),
                       check_vma=False)
