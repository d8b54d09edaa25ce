"""A scanned run keeps its parameters and optimizer state stacked by scan position
(k3jax/layer_stacks.py): the optimizer gives the same updates and state as leaf by leaf, in
float64 on fresh random values; the train state holds stacked leaves, its step matches the
unrolled one, and its checkpoints keep one entry per layer (either setting restores the other's)."""

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


@pytest.fixture(scope="module")
def train_states():
  """{scan_layers: (config, initial train state)} in float32, unscanned and scanned: the two
  train-state tests share them (each initialisation is a compile of its own)."""
  from k3jax.train_state import init_train_state
  out = {}
  with jax.enable_x64(False):
    for scan in ("false", "true"):
      cfg = tiny_config(*SMALL, "model.remat=full", f"model.scan_layers={scan}",
                        "optimizer.name=muon", "optimizer.muon_ns_precision=f32")
      out[scan] = cfg, init_train_state(cfg)
  return out


def _random_params(cfg, seed):
  """The model's per-layer parameter tree (pure dict) of fresh float64 normals."""
  shapes = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape)), shapes)


def _steps(cfg, params, grads):
  """Two updates of ``cfg``'s optimizer from its initial state, on the trees stacked as ``cfg``'s
  train state holds them: (updates of each, final state, jaxpr equations of one update), one
  entry per layer."""
  stacks = layer_stacks.positions(cfg.model)
  tx, _ = optim.make_optimizer(cfg, params)
  params, grads = layer_stacks.stack((params, grads), stacks)
  state = tx.init(params)
  out = []
  for g in grads:
    u, state = jax.jit(tx.update)(g, state, params)
    out.append(u)
    params = jax.tree.map(jnp.add, params, u)
  eqns = len(jax.make_jaxpr(tx.update)(grads[0], tx.init(params), params).eqns)
  return layer_stacks.unstack((out, state), stacks), eqns


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
  want, want_eqns = _steps(plain, params, grads)
  got, got_eqns = _steps(scanned, params, grads)
  _assert_close(got, want)
  assert got_eqns < want_eqns  # one op per scan position, not per layer


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


@pytest.mark.slow
def test_scanned_train_step_equals_unrolled(train_states):
  """Two train steps (Muon, clipping, router biases) of the scanned model, whose train state
  holds the scanned layers' parameters and moments stacked, against the unrolled one: same
  losses, norms and parameters to float32 rounding, and the same per-layer trees once
  unstacked."""
  from k3jax import train_step as ts
  rng = np.random.default_rng(3)
  ids = jnp.asarray(rng.integers(0, 256, (2, 16)), jnp.int32)
  batch = {"input_ids": ids, "targets": jnp.roll(ids, -1, 1),
           "segment_ids": jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(16), (2, 16)),
           "weights": jnp.ones((2, 16), jnp.float32)}
  out = []
  with jax.enable_x64(False):
    for cfg, st in train_states.values():
      step = jax.jit(ts.make_train_step(cfg, st.graphdef, st.tx, st.schedule))
      p, o, b, metrics = step(st.params, st.opt_state, st.biases, jnp.int32(0), st.rng, batch)
      p, o, b, m = step(p, o, b, jnp.int32(1), st.rng, batch)
      new = st.replace(params=p, opt_state=o).arrays()  # one entry per layer
      moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                           new["params"], st.arrays()["params"])
      out.append((st, moved, new["opt_state"],
                  [metrics["loss"], m["loss"], metrics["grad_norm"], m["grad_norm"]]))
  (st0, d0, o0, m0), (st1, d1, o1, m1) = out
  # the scanned run's state holds layers 1-6 as two stacks of three, its moments alike
  assert layer_stacks.STACKS not in st0.params
  assert sorted(st1.params["layers"]) == [0]
  assert {x.shape[0] for x in jax.tree.leaves(st1.params[layer_stacks.STACKS])} == {3}
  moments = [jax.tree_util.keystr(k) for k, x in
             jax.tree_util.tree_flatten_with_path(st1.opt_state)[0] if x.ndim]
  assert any(layer_stacks.STACKS in k for k in moments)
  assert not any("['layers'][3]" in k for k in moments)
  np.testing.assert_allclose(m1, m0, rtol=1e-5)
  assert jax.tree.structure(o1) == jax.tree.structure(o0)
  for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d0)):  # what the two updates moved
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * float(np.max(np.abs(b))))


def _saved_and_restored(src, dst, directory):
  """``src``'s checkpoint (a :class:`~k3jax.train_state.TrainState`) restored into ``dst``'s
  layout, through :class:`~k3jax.checkpoint.Checkpointer`."""
  import grain
  from k3jax import checkpoint
  data = lambda step: iter(grain.MapDataset.range(4).to_iter_dataset())
  ckpt = checkpoint.Checkpointer(directory, async_save=False)
  ckpt.save(1, src.arrays(), data(0), {"step": 1}, wait=True)
  step, arrays, _, _ = ckpt.restore_latest(dst.shapes().arrays(), data)
  ckpt.close()
  assert step == 1
  return dst.with_arrays(**arrays)


@pytest.mark.slow
def test_checkpoints_keep_one_entry_per_layer(train_states, tmp_path):
  """A scanned run's stacked state saves one entry per layer, as an unscanned run's: each
  setting restores the other's checkpoint, values exact (fresh random ones in every leaf)."""
  (_, plain), (_, scanned) = train_states["false"], train_states["true"]
  with jax.enable_x64(False):
    rng = np.random.default_rng(4)
    fresh = lambda tree: jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
    scanned = scanned.replace(params=fresh(scanned.params), opt_state=fresh(scanned.opt_state))
    assert layer_stacks.STACKS in scanned.params
    want = scanned.arrays()
    assert jax.tree.structure(want) == jax.tree.structure(plain.arrays())  # the layout on disk
    as_plain = _saved_and_restored(scanned, plain, tmp_path / "a")
    back = _saved_and_restored(as_plain, scanned, tmp_path / "b")
  for state in (as_plain, back):
    got = state.arrays()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert jax.tree.structure(back.params) == jax.tree.structure(scanned.params)
