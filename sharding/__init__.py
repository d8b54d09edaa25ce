"""Mesh sharding: logical axis names for parameters and activations and their mesh rules
(:mod:`sharding.rules`), the mesh and parameter placement (:mod:`sharding.mesh`), expert
parallelism with MoonEP (:mod:`sharding.expert_parallel`, :mod:`sharding.moonep`), KDA and MLA
context parallelism (:mod:`sharding.context_parallel`) and Quantile Balancing across ranks
(:mod:`sharding.balance`).

Training: ``mesh = sharding.setup(cfg)`` (multi-host start-up, the mesh of ``cfg.mesh``
installed with ``jax.set_mesh``, the MoonEP switch), then
``params = sharding.shard_params(params, mesh, sharding.names_tree(cfg.model))`` for the pure-dict
parameters (or ``sharding.shard_params(state, mesh)`` for an ``nnx.State``) and
``sharding.batch_sharding(mesh)`` for the ``[B, T]`` batch arrays.
"""

from sharding.rules import DEFAULT_RULES, logical_spec, shard, named_sharding  # first: the model needs these
from sharding.mesh import (AXES, abstract_mesh, batch_sharding, make_mesh, names_tree,
                           param_shardings, pure_shardings, shard_params, spec_tree)
from sharding import mesh as _mesh


def setup(cfg):
  """Multi-host start-up, the mesh of ``cfg.mesh`` over all devices (installed with
  ``jax.set_mesh``) and the MoonEP switch ``cfg.mesh.moonep``. Returns the mesh."""
  from sharding import expert_parallel
  expert_parallel.configure(moonep=cfg.mesh.moonep)
  return _mesh.setup(cfg)


__all__ = ["DEFAULT_RULES", "logical_spec", "shard", "named_sharding", "AXES", "abstract_mesh",
           "batch_sharding", "make_mesh", "names_tree", "param_shardings", "pure_shardings",
           "shard_params", "spec_tree", "setup"]
