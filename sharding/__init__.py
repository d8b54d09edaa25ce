"""Mesh sharding: logical axis names for parameters and activations and their mesh rules
(:mod:`sharding.rules`), the mesh and parameter placement (:mod:`sharding.mesh`), expert
parallelism with MoonEP (:mod:`sharding.expert_parallel`, :mod:`sharding.moonep`), KDA and MLA
context parallelism (:mod:`sharding.context_parallel`) and Quantile Balancing across ranks
(:mod:`sharding.balance`).

Training: ``mesh = sharding.setup(cfg)`` (multi-host start-up, the mesh of ``cfg.mesh``
installed with ``jax.set_mesh``, the expert axes and the MoonEP switch), then
``params = sharding.shard_params(params, mesh, sharding.names_tree(cfg.model))`` for the pure-dict
parameters (or ``sharding.shard_params(state, mesh)`` for an ``nnx.State``) and
``sharding.batch_sharding(mesh)`` for the ``[B, T]`` batch arrays.
"""

from sharding.rules import DEFAULT_RULES, logical_spec, named_sharding, per_device, shard  # first: the model needs these
from sharding import rules as _rules
from sharding.mesh import (AXES, abstract_mesh, batch_sharding, make_mesh, names_tree,
                           param_shardings, pure_shardings, shard_params, spec_tree)
from sharding import mesh as _mesh


def configure(mesh_cfg) -> None:
  """The layout choices of ``MeshConfig`` that are not axis sizes: the axes the routed experts
  are split over (``expert_axes``, the ``expert`` rule) and the MoonEP switch (``moonep``)."""
  from sharding import expert_parallel
  _rules.configure(expert_axes=mesh_cfg.expert_axes)
  expert_parallel.configure(moonep=mesh_cfg.moonep)


def setup(cfg):
  """Multi-host start-up, the mesh of ``cfg.mesh`` over all devices (installed with
  ``jax.set_mesh``) and :func:`configure`. Returns the mesh."""
  configure(cfg.mesh)
  return _mesh.setup(cfg)


__all__ = ["DEFAULT_RULES", "logical_spec", "shard", "named_sharding", "per_device", "AXES",
           "abstract_mesh", "batch_sharding", "make_mesh", "names_tree", "param_shardings",
           "pure_shardings", "shard_params", "spec_tree", "configure", "setup"]
