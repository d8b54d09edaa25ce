"""The optimizer of a scanned model runs on the layers stacked by scan position
(k3jax/layer_stacks.py): the same updates and state as leaf by leaf, in float64 on fresh random
values, and the state still one entry per layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from k3jax import layer_stacks, optim
from k3jax.train_state import abstract_model
from conftest import tiny_config
from test_scan import SMALL


@pytest.fixture(autouse=True)
def x64():
  with jax.enable_x64(True):
    yield


def _random_params(cfg, seed):
  """The model's per-layer parameter tree (pure dict) of fresh float64 normals."""
  shapes = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape)), shapes)


def _steps(cfg, params, grads):
  """Two updates of ``cfg``'s optimizer from its initial state: (updates of each, final state,
  jaxpr equations of one update)."""
  tx, _ = optim.make_optimizer(cfg, params)
  state = tx.init(params)
  out = []
  for g in grads:
    u, state = jax.jit(tx.update)(g, state, params)
    out.append(u)
    params = jax.tree.map(jnp.add, params, u)
  eqns = len(jax.make_jaxpr(tx.update)(grads[0], tx.init(params), params).eqns)
  return out, state, eqns


def _assert_close(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6,
                               atol=1e-6 * float(np.max(np.abs(b), initial=1e-30)))


@pytest.mark.slow
def test_stacked_optimizer_equals_per_leaf():
  """Muon (AdamW on its other leaves, with the weight-decay mask) with per-head views, clipping and
  weight decay, over three scanned groups of KDA + MLA."""
  overrides = [*SMALL, "optimizer.name=muon", "optimizer.muon_ns_precision=f32",
               "optimizer.muon_per_head=true", "optimizer.weight_decay=0.1",
               "optimizer.grad_clip=0.5", "optimizer.warmup_steps=0"]
  plain = tiny_config(*overrides, "model.scan_layers=false")
  scanned = tiny_config(*overrides, "model.scan_layers=true")
  assert layer_stacks.positions(scanned.model) == [[1, 3, 5], [2, 4, 6]]
  params = _random_params(plain, 0)
  grads = [_random_params(plain, 1), _random_params(plain, 2)]
  want, want_state, want_eqns = _steps(plain, params, grads)
  got, got_state, got_eqns = _steps(scanned, params, grads)
  # the state keeps one entry per layer: checkpoints of either setting restore into the other
  assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
  _assert_close((got, got_state), (want, want_state))
  assert got_eqns < want_eqns  # one op per scan position, not per layer
  # the step hands the optimizer its gradients stacked as the scan produced them
  tx, _ = optim.make_optimizer(scanned, params)
  stacked = layer_stacks.stack(grads[0], layer_stacks.positions(scanned.model))
  _assert_close(jax.jit(tx.update)(stacked, tx.init(params), params)[0], want[0])


def test_stack_round_trip():
  stacks = [[1, 3], [2, 4]]
  tree = {"state": ({"layers": {i: {"w": jnp.full((2,), float(i))} for i in range(5)},
                     "head": jnp.ones(3)},)}
  s = layer_stacks.stack(tree, stacks)
  assert sorted(s["state"][0]["layers"]) == [0]
  np.testing.assert_array_equal(s["state"][0][layer_stacks.STACKS][1]["w"], [[2, 2], [4, 4]])
  back = layer_stacks.unstack(s, stacks)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(a, b)
