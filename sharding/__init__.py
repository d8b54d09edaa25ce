"""Mesh sharding: logical axis names for parameters and activations, their mesh rules and the
scoped layout (:mod:`sharding.rules`), the mesh and parameter placement (:mod:`sharding.mesh`),
expert parallelism with MoonEP (:mod:`sharding.expert_parallel`, :mod:`sharding.moonep`) and KDA
and MLA context parallelism (:mod:`sharding.context_parallel`). It knows no model: from
:mod:`k3jax` it imports only :mod:`k3jax.config`.

Training: ``mesh = sharding.make_mesh(cfg.mesh)`` (after
``sharding.mesh.initialize_distributed()`` on several hosts), then everything that builds or
traces the model inside ``with sharding.layout(cfg.mesh): ...``; parameters are placed with
``sharding.shard_params(params, mesh, names)`` (``names = sharding.names_tree(abstract_model)``
for a pure dict, none for an ``nnx.State``) and batches with ``sharding.batch_sharding(mesh)``.
"""

from sharding.mesh import (AXES, abstract_mesh, batch_sharding, make_mesh, names_tree,
                           param_shardings, pure_shardings, shard_params, spec_tree)
from sharding.rules import (DEFAULT_RULES, Layout, active_layout, layout, logical_spec,
                            named_sharding, per_device, shard)

__all__ = ["DEFAULT_RULES", "Layout", "active_layout", "layout", "logical_spec", "shard",
           "named_sharding", "per_device", "AXES", "abstract_mesh", "batch_sharding", "make_mesh",
           "names_tree", "param_shardings", "pure_shardings", "shard_params", "spec_tree"]
