"""Builds the model and training state in one place for ``train.py``, ``k3jax.plan``,
``k3jax.aot``, the benchmarks and the converter.

``init_train_state(cfg, mesh)`` creates the state of a run (parameters, router biases, optimizer
state, rng) laid out on ``mesh``; ``abstract_train_state(cfg, mesh)`` is the same tree of
``ShapeDtypeStruct``s with the same shardings, without allocating: what a restore, a plan or an
ahead-of-time compile of the step needs. Under ``model.scan_layers`` the state holds the scanned
layers' parameters and optimizer state stacked by position (:mod:`k3jax.layer_stacks`), the layout
the step takes and returns; :meth:`TrainState.arrays` and :meth:`TrainState.with_arrays` convert
from and to the one entry per layer that checkpoints and pretrained weights hold.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import optax
from flax import nnx

import sharding
from k3jax import layer_stacks
from k3jax.config import Config, ModelConfig

# The fields of the checkpointed tree (Checkpointer's ``state`` item), in this order.
ARRAY_FIELDS = ("params", "opt_state", "biases", "rng")
# The fields a scanned run holds stacked by scan position (router biases stay per layer).
STACKED_FIELDS = ("params", "opt_state")


@functools.lru_cache(maxsize=8)
def _unstacker(stacks: tuple) -> Callable:
  """:func:`k3jax.layer_stacks.unstack` by ``stacks`` jitted once, so that every checkpoint save
  of a run reuses one compiled program."""
  return jax.jit(functools.partial(layer_stacks.unstack, stacks=[list(s) for s in stacks]))


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(ARRAY_FIELDS),
                   meta_fields=["graphdef", "tx", "schedule"])
@dataclasses.dataclass(frozen=True)
class TrainState:
  """What a training run carries from step to step.

  Leaves: ``params`` and ``biases`` (pure dicts, ``nnx.to_pure_dict``, of the model's
  ``nnx.Param`` and ``RouterBias`` state; the scanned layers' parameters stacked by position,
  :mod:`k3jax.layer_stacks`), ``opt_state`` (``tx.init(params)``) and ``rng`` (the key data
  ``uint32[2]`` of ``train.seed``). Static: ``graphdef`` (the model's graph, merged with
  ``params`` and ``biases`` inside the step), ``tx`` and ``schedule``
  (:func:`k3jax.optim.make_optimizer`)."""
  params: Any
  opt_state: Any
  biases: Any
  rng: Any
  graphdef: Any
  tx: optax.GradientTransformation
  schedule: Callable

  def arrays(self, *fields: str) -> dict:
    """The leaves as the dict a checkpoint holds, one entry per layer: ``{"params", "opt_state",
    "biases", "rng"}``, or only ``fields`` (of a state of ``ShapeDtypeStruct``s: their shapes and
    layouts)."""
    stacks = layer_stacks.held(self.params)
    tree = {k: getattr(self, k) for k in fields or ARRAY_FIELDS}
    if not stacks or all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
      return layer_stacks.unstack(tree, stacks)
    return _unstacker(tuple(map(tuple, stacks)))(tree)

  def with_arrays(self, **arrays) -> TrainState:
    """This state with the fields ``arrays`` (one entry per layer, as :meth:`arrays` gives
    them: a restored checkpoint, pretrained weights) in its own layout."""
    stacks = layer_stacks.held(self.params)
    if not stacks:
      return self.replace(**arrays)
    shardings = {k: jax.tree.map(lambda x: x.sharding, getattr(self, k)) for k in arrays}
    stack = jax.jit(lambda a: {k: layer_stacks.stack(v, stacks) if k in STACKED_FIELDS else v
                               for k, v in a.items()}, out_shardings=shardings)
    return self.replace(**stack(arrays))

  def shapes(self) -> TrainState:
    """This state as ``ShapeDtypeStruct``s with its arrays' shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self)

  def model(self):
    """The :class:`~k3jax.model.K3Model` of the state's parameters and router biases, one module
    per layer (decoding, serving)."""
    arrays = self.arrays("params", "biases")
    return nnx.merge(self.graphdef, arrays["params"], arrays["biases"])

  def replace(self, **fields) -> TrainState:
    return dataclasses.replace(self, **fields)


def abstract_model(cfg: Config | ModelConfig):
  """The :class:`~k3jax.model.K3Model` of ``cfg`` (a whole config or its ``model`` part) as
  shapes only (``nnx.eval_shape``): nothing is allocated. Built outside any mesh, so its
  variables keep their logical axis names unplaced."""
  from k3jax.model import K3Model
  model_cfg = cfg.model if isinstance(cfg, Config) else cfg
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
    return nnx.eval_shape(lambda: K3Model(model_cfg, rngs=nnx.Rngs(0)))


def state_names(model) -> tuple[Any, Any]:
  """(params, biases) logical axis names of ``model`` (:func:`sharding.names_tree`)."""
  from k3jax.latent_moe import RouterBias
  return sharding.names_tree(model, nnx.Param, RouterBias)


def _builder(cfg: Config, mesh, model) -> tuple[TrainState, Callable[[], TrainState]]:
  """(the abstract state, with shardings on ``mesh`` when given; the function creating it)."""
  from k3jax.latent_moe import RouterBias
  from k3jax.model import K3Model
  from k3jax.optim import make_optimizer
  model = abstract_model(cfg) if model is None else model
  graphdef, params, biases = nnx.split(model, nnx.Param, RouterBias)
  params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
  names = state_names(model)
  tx, schedule = make_optimizer(cfg, params, names[0])
  stacks = layer_stacks.positions(cfg.model)

  def create() -> TrainState:
    _, p, b = nnx.split(K3Model(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), nnx.Param, RouterBias)
    p = layer_stacks.stack(nnx.to_pure_dict(p), stacks)
    return TrainState(p, tx.init(p), nnx.to_pure_dict(b),
                      jax.random.key_data(jax.random.key(cfg.train.seed)), graphdef, tx, schedule)

  abstract = jax.eval_shape(create)
  if mesh is None:
    return abstract, create
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  params = abstract.params
  params = jax.tree.map(sds, params, sharding.pure_shardings(
      params, mesh, layer_stacks.stack_names(names[0], stacks)))
  biases = jax.tree.map(sds, biases, sharding.pure_shardings(biases, mesh, names[1]))
  opt_state = jax.tree.map(sds, abstract.opt_state,
                           sharding.mesh.optimizer_shardings(abstract.opt_state, params))
  rng = sds(abstract.rng, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return abstract.replace(params=params, opt_state=opt_state, biases=biases, rng=rng), create


def abstract_train_state(cfg: Config, mesh=None, *, model=None) -> TrainState:
  """The :class:`TrainState` of ``cfg`` as ``ShapeDtypeStruct``s, laid out on ``mesh`` (a
  ``Mesh`` or an ``AbstractMesh``; None: no shardings) as :func:`init_train_state` lays it out;
  nothing is allocated. ``model``: :func:`abstract_model` of ``cfg`` when the caller has it."""
  with sharding.layout(cfg.mesh):
    return _builder(cfg, mesh, model)[0]


def init_train_state(cfg: Config, mesh=None, *, threefry_kernel: bool = True) -> TrainState:
  """The initial :class:`TrainState` of ``cfg``, created by one jitted call directly in its
  layout on ``mesh`` (the parameters split by their logical axis names, each optimizer moment
  as its parameter, the rest replicated; None: the default device). Call it outside the mesh
  context: the model's logical names are not mesh axes.

  XLA expands every parameter's threefry draw into a fusion of its own, and a model of a few
  hundred parameters then takes minutes to compile for GPU; ``threefry_kernel`` draws the same
  bits with the CUDA threefry kernel instead (``jax_threefry_gpu_kernel_lowering``; GPU only)."""
  with sharding.layout(cfg.mesh):
    abstract, create = _builder(cfg, mesh, None)
  out_shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, abstract)
  previous = jax.config.jax_threefry_gpu_kernel_lowering
  jax.config.update("jax_threefry_gpu_kernel_lowering", threefry_kernel)
  try:
    return jax.jit(create, out_shardings=out_shardings)()
  finally:
    jax.config.update("jax_threefry_gpu_kernel_lowering", previous)
