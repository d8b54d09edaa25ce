"""The device mesh from ``MeshConfig``, multi-host start-up and parameter shardings.

Mesh axes, outermost first: ``data, fsdp, expert, context, tensor`` (tensor innermost: the axis
with the most traffic gets the closest devices). All axes are ``Auto``: the model places
activations with ``with_sharding_constraint`` (:func:`sharding.rules.shard`) and GSPMD inserts the
collectives; expert and context parallelism run inside ``jax.shard_map``. The same code path
serves one device (every axis of size 1) and N.
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from k3jax.config import ConfigError, MeshConfig
from sharding.rules import DEFAULT_RULES, TOKEN_AXES, logical_spec

AXES = ("data", "fsdp", "expert", "context", "tensor")


def axis_sizes(mc: MeshConfig, num_devices: int) -> dict[str, int]:
  """``{axis: size}`` for ``num_devices`` devices; the one ``-1`` axis takes the rest."""
  sizes = {a: getattr(mc, a) for a in AXES}
  known = math.prod(s for s in sizes.values() if s != -1)
  free = [a for a, s in sizes.items() if s == -1]
  if free:
    if num_devices % known:
      raise ConfigError(f"mesh: {num_devices} devices are not divisible by the fixed axes "
                        f"{ {a: s for a, s in sizes.items() if s != -1} } (product {known})")
    sizes[free[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(f"mesh: axis sizes {sizes} multiply to {math.prod(sizes.values())}, but "
                      f"there are {num_devices} devices (set one axis to -1 for the rest)")
  return sizes


def make_mesh(mc: MeshConfig, devices=None) -> jax.sharding.Mesh:
  """A mesh of ``devices`` (default: all) with the five named axes, all ``AxisType.Auto``."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = axis_sizes(mc, len(devices))
  shape, types = tuple(sizes[a] for a in AXES), (AxisType.Auto,) * len(AXES)
  try:
    return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
  except NotImplementedError:
    # A TPU slice whose torus dimensions no axis size is a product of (expert=32, context=64 on
    # a v5p 8x16x16): split physical dimensions between mesh axes.
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, AXES, axis_types=types)


def abstract_mesh(mc: MeshConfig, num_devices: int,
                  device: jax.sharding.AbstractDevice | None = None) -> jax.sharding.AbstractMesh:
  """The same mesh without devices, for lowering a program that is never run; ``device`` names
  the kind of device (the GPU kernels' lowering asks it for the compute capability)."""
  sizes = axis_sizes(mc, num_devices)
  return jax.sharding.AbstractMesh(tuple(sizes[a] for a in AXES), AXES,
                                   axis_types=(AxisType.Auto,) * len(AXES), abstract_device=device)


def initialize_distributed() -> bool:
  """Calls ``jax.distributed.initialize()`` once when the environment describes several processes.

  Recognised: ``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``),
  SLURM (``SLURM_NTASKS`` > 1), Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1), TPU pods on GKE
  (``TPU_WORKER_HOSTNAMES`` with several hosts), for which JAX auto-detects the rest, and
  ``K3JAX_DISTRIBUTED=1``, which calls it with no arguments wherever JAX detects the cluster
  itself (a Cloud TPU VM slice asks the VM's metadata server; ``scripts/launch_tpu_pod.sh`` sets
  it). ``K3JAX_DISTRIBUTED=0`` never initialises. Returns whether it initialised.
  """
  env = os.environ
  if jax.distributed.is_initialized() or env.get("K3JAX_DISTRIBUTED") == "0":
    return False
  if env.get("K3JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
    return True
  kwargs: dict[str, Any] = {}
  if env.get("JAX_COORDINATOR_ADDRESS"):
    kwargs = {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"]}
    if "JAX_NUM_PROCESSES" in env:
      kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if "JAX_PROCESS_ID" in env:
      kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
  elif not (int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
            or len(env.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1):
    return False
  jax.distributed.initialize(**kwargs)
  return True


def var_names(var) -> tuple | None:
  """The logical axis names of an ``nnx.Variable`` (``sharding_names`` metadata), or None."""
  md = var.get_metadata() if hasattr(var, "get_metadata") else {}
  return md.get("sharding_names") or md.get("out_sharding") or getattr(var, "sharding_names", None)


def _is_var(x) -> bool:
  return hasattr(x, "get_metadata")


def spec_tree(state, mesh, rules=None):
  """PartitionSpecs for a tree of ``nnx.Variable`` (or a ``nnx.State``) from their names; leaves
  without names are replicated. Returns a tree of the same structure with PartitionSpec leaves
  (variables are replaced by their spec)."""
  def one(x):
    names = var_names(x) if _is_var(x) else None
    ndim = len(getattr(x, "shape", ()) if not _is_var(x) else x.shape)
    if not names:
      return P(*([None] * ndim))
    return param_spec(names, x.shape, mesh, rules)

  return jax.tree.map(one, state, is_leaf=_is_var)


def param_spec(names, shape, mesh, rules=None) -> P:
  """The PartitionSpec of a parameter of ``shape`` with logical ``names`` on ``mesh`` (concrete
  or abstract): the rules' axes that the mesh splits, fitted to the shape (:func:`fit_spec`)."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return fit_spec(logical_spec(names, rules, [a for a in mesh.axis_names if sizes[a] > 1]), shape,
                  sizes)


def fit_spec(spec: P, shape, sizes) -> P:
  """Makes ``spec`` valid for ``shape``: a mesh axis that does not divide its dimension moves to
  the first other dimension it divides (K3's d = 7168 takes 64 ways but not 2048), else it is
  dropped (small configs on big meshes)."""
  dims = [[] for _ in shape]
  left = []
  for i, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    for a in () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry):
      if shape[i] % (math.prod(sizes[x] for x in dims[i]) * sizes[a]) == 0:
        dims[i].append(a)
      else:
        left.append(a)
  for a in left:
    for i in range(len(shape)):
      if shape[i] % (math.prod(sizes[x] for x in dims[i]) * sizes[a]) == 0:
        dims[i].append(a)
        break
  return P(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


def path_key(path) -> tuple[str, ...]:
  """A tree path (``jax.tree_util.tree_flatten_with_path``) as a tuple of strings."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def spec_axes(spec: P) -> tuple[str, ...]:
  """The mesh axes a PartitionSpec uses, in order."""
  out: list[str] = []
  for entry in spec:
    out += [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
  return tuple(out)


def unsplit_params(params, names, sizes: dict[str, int], rules=None) -> list[dict]:
  """Parameters that the rules ask to split over a mesh axis none of whose dimensions it divides,
  so they are whole on every device of that axis (:func:`fit_spec` drops it): for ``params`` (a
  pure dict of arrays or ShapeDtypeStructs), its ``names`` tree (:func:`names_tree`) and mesh
  axis ``sizes``, one ``{"leaf", "shape", "axes", "count", "bytes"}`` per leaf pattern (layer
  index as ``*``), the most bytes first; ``bytes`` is the count's total on one device."""
  axes = [a for a in AXES if sizes.get(a, 1) > 1]
  by_path = {path_key(p): n.names for p, n in jax.tree_util.tree_flatten_with_path(
      _wrap(names), is_leaf=lambda v: isinstance(v, _Names))[0]}
  groups: dict[tuple, dict] = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = path_key(path)
    n = by_path.get(key)
    if not n:
      continue
    want = logical_spec(n, rules, axes)
    lost = [a for a in spec_axes(want) if a not in spec_axes(fit_spec(want, x.shape, sizes))]
    if not lost:
      continue
    leaf = ".".join("*" if k.isdigit() else k for k in key)
    g = groups.setdefault((leaf, tuple(x.shape), tuple(lost)), {
        "leaf": leaf, "shape": list(x.shape), "axes": lost, "count": 0, "bytes": 0})
    g["count"] += 1
    g["bytes"] += math.prod(x.shape) * x.dtype.itemsize
  return sorted(groups.values(), key=lambda g: -g["bytes"])


def unsplit_warning(unsplit: list[dict], sizes: dict[str, int], total_bytes: int) -> str | None:
  """One line naming the parameters :func:`unsplit_params` found, when they hold more than 1% of
  ``total_bytes`` (the whole model); None otherwise."""
  lost = sum(g["bytes"] for g in unsplit)
  if not unsplit or lost <= 0.01 * total_bytes:
    return None
  parts = [f"{g['leaf']} {g['shape']} x{g['count']} ({g['bytes'] / 1e9:.2f} GB) on "
           + ", ".join(f"{a}={sizes[a]}" for a in g["axes"]) for g in unsplit[:3]]
  more = f" and {len(unsplit) - 3} more" if len(unsplit) > 3 else ""
  return (f"warning: {lost / 1e9:.2f} GB of parameters are whole on every device of a mesh axis "
          f"that divides none of their dimensions: {'; '.join(parts)}{more}. A mesh axis size "
          "that divides them (or a rule in sharding.rules) splits them.")


def param_shardings(state, mesh, rules=None):
  """``NamedSharding`` for every variable of ``state`` (same tree, sharding leaves)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree(state, mesh, rules),
                      is_leaf=lambda x: isinstance(x, P))


def names_tree(model, *filters):
  """Logical axis names of the variables of ``model`` (an NNX module, typically abstract:
  ``nnx.eval_shape``) as a pure dict (the structure of ``nnx.to_pure_dict`` of
  ``nnx.split(model, *filters)``). With several filters, one tree per filter; none: ``nnx.Param``."""
  from flax import nnx
  filters = filters or (nnx.Param,)
  states = nnx.split(model, *filters, ...)[1:1 + len(filters)]
  trees = [nnx.to_pure_dict(jax.tree.map(lambda v: v.replace(_Names(var_names(v))), st,
                                         is_leaf=_is_var)) for st in states]
  trees = [jax.tree.map(lambda n: n.names, t, is_leaf=lambda x: isinstance(x, _Names))
           for t in trees]
  return trees[0] if len(trees) == 1 else tuple(trees)


class _Names:
  """A leaf holding a names tuple (tuples would otherwise be taken apart by tree maps)."""

  def __init__(self, names):
    self.names = tuple(names) if names else None


def _from_names(names, x, mesh, rules):
  names = names.names if isinstance(names, _Names) else names
  if not names:
    return NamedSharding(mesh, P(*([None] * x.ndim)))
  return NamedSharding(mesh, param_spec(names, x.shape, mesh, rules))


def shard_params(state, mesh, names=None, rules=None):
  """Places every leaf of ``state`` on ``mesh`` by its logical axis names.

  state: an ``nnx.State`` / tree of ``nnx.Variable`` (names from their metadata), or a pure dict
  (``nnx.to_pure_dict``) with ``names`` the matching tree from :func:`names_tree`. Returns the
  same tree, placed.
  """
  if names is None:
    shardings = param_shardings(state, mesh, rules)
    return jax.tree.map(lambda x, s: jax.device_put(x, s), state, shardings, is_leaf=_is_var)
  return jax.tree.map(lambda x, n: jax.device_put(x, _from_names(n, x, mesh, rules)), state,
                      _wrap(names))


def pure_shardings(state, mesh, names, rules=None):
  """``NamedSharding`` tree for a pure-dict ``state`` (arrays or ShapeDtypeStructs) and the
  matching ``names`` tree from :func:`names_tree`."""
  return jax.tree.map(lambda x, n: _from_names(n, x, mesh, rules), state, _wrap(names))


def _wrap(names):
  """Names tree with each tuple as one leaf, structured like the state it describes."""
  return jax.tree.map(lambda n: _Names(n), names,
                      is_leaf=lambda x: x is None or (isinstance(x, tuple)
                                                      and all(isinstance(a, (str, type(None))) for a in x)))


def optimizer_shardings(opt_state, params):
  """``NamedSharding`` tree for an optimizer state (arrays or ShapeDtypeStructs) laid out like
  ``params`` (leaves with a ``NamedSharding``): a leaf under a parameter's path (optax's moments,
  Muon's momentum) takes that parameter's spec on the leading dimensions the two shapes share
  (Muon's packed ``w_gate_up`` momentum ``[E, L, 2, F]`` keeps the ``[E, L]`` split of
  ``[E, L, 2F]``); the rest (counters, coefficients) is replicated. ``jit(tx.init)`` alone
  replicates it all: zeros carry no layout from the parameters. None when the parameters are not
  laid out on a mesh."""
  flat = jax.tree_util.tree_leaves_with_path(params)
  if not all(isinstance(getattr(x, "sharding", None), NamedSharding) for _, x in flat):
    return None
  mesh = flat[0][1].sharding.mesh
  by_path = {path_key(p): x for p, x in flat}

  def place(path, x):
    key = path_key(path)
    for i in range(len(key)):
      p = by_path.get(key[i:])
      if p is not None:
        spec = list(p.sharding.spec) + [None] * (len(p.shape) - len(p.sharding.spec))
        same = 0
        while same < min(len(x.shape), len(p.shape)) and x.shape[same] == p.shape[same]:
          same += 1
        return NamedSharding(mesh, P(*spec[:same], *([None] * (len(x.shape) - same))))
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(place, opt_state)


def batch_sharding(mesh, ndim: int = 2) -> NamedSharding:
  """Sharding of a ``[B, T, ...]`` batch array: B over the batch axes, T over ``context``."""
  return NamedSharding(mesh, logical_spec(("batch", "length") + (None,) * (ndim - 2), None,
                                          [a for a, s in zip(mesh.axis_names, mesh.axis_sizes) if s > 1]))


__all__ = ["AXES", "TOKEN_AXES", "axis_sizes", "make_mesh", "abstract_mesh", "initialize_distributed",
           "spec_tree", "fit_spec", "path_key", "spec_axes", "unsplit_params", "unsplit_warning",
           "param_shardings", "shard_params", "names_tree",
           "pure_shardings", "optimizer_shardings", "batch_sharding", "var_names",
           "DEFAULT_RULES"]
