"""The serving layout of a KDA layer (:meth:`k3jax.kda.KDA.fuse_inputs`: one input matmul, one
conv tail) against the separate parameters it is built from: decode and prefill outputs, recurrent
states and conv tails, float32, both gates (the bounded gate with the full output gate; the
softplus gate with the low-rank output gate and grouped values), on one device here and on 8
simulated devices with heads over ``tensor`` (tests/test_sharding_workers.py ``serve_layout``)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.kda import KDA
from tests.conftest import tiny_config

CASES = {
    "bounded": (),
    "softplus_low_rank": ("model.kda.gate=softplus", "model.kda.output_gate=low_rank",
                          "model.kda.output_gate_rank=48", "model.kda.num_v_heads=8",
                          "model.kda.forget_rank=32"),
}
SLOTS = 7


def _max_rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


def fused_pool(pool: dict, shards: int) -> dict:
  """A separate-layout slot pool in the serving layout: per shard its q, k, v tail channels."""
  split = lambda a: a.reshape(*a.shape[:2], shards, -1)
  conv = jnp.concatenate([split(pool["conv_" + n]) for n in "qkv"], -1)
  return {"conv": conv.reshape(*conv.shape[:2], -1), "state": pool["state"]}


def _inputs(cfg, rng):
  """The layer (random parameters), a random slot pool, decode and prefill inputs."""
  layer = KDA(cfg, rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(layer)
  state = jax.tree.map(lambda a: a + 0.2 * jnp.asarray(rng.normal(size=a.shape), a.dtype), state)
  pool = {k: jnp.asarray(rng.normal(size=a.shape), a.dtype)
          for k, a in layer.init_cache(SLOTS).items()}
  d = cfg.hidden_size
  steps = {
      "decode": dict(x=rng.normal(size=(4, 1, d)), slots=[4, 1, 5, 3], valid=None, decode=True),
      # right-padded prompts of 5, 2, 1 and 4 tokens (4 rows: the meshes' batch axes split them)
      "prefill": dict(x=rng.normal(size=(4, 5, d)), slots=[2, 6, 1, 3],
                      valid=np.arange(5)[None, :] < np.array([[5], [2], [1], [4]]), decode=False),
  }
  return graphdef, state, pool, steps


def _run(graphdef, state, pool, step):
  def call(state, pool, x, slots, valid):
    y, new = nnx.merge(graphdef, state)(x, valid=valid, cache=dict(pool, slots=slots),
                                        decode=step["decode"])
    return y, {k: v for k, v in new.items() if k != "slots"}
  valid = None if step["valid"] is None else jnp.asarray(step["valid"])
  return jax.jit(call)(state, pool, jnp.asarray(step["x"], jnp.float32),
                       jnp.asarray(step["slots"], jnp.int32), valid)


def fused_vs_separate(mesh_cfg=None) -> dict:
  """Largest relative error of the serving layout (on ``mesh_cfg``'s mesh, or one device) against
  the separate layout on one device, per case and step: outputs, states, conv tails."""
  import sharding
  from sharding import mesh as mesh_lib
  out = {}
  for case, overrides in CASES.items():
    cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32", *overrides).model
    graphdef, state, pool, steps = _inputs(cfg, np.random.default_rng(0))
    mesh = None if mesh_cfg is None else mesh_lib.make_mesh(mesh_cfg)
    shards = 1 if mesh is None else mesh.shape["tensor"]
    fused = nnx.merge(graphdef, state)
    fused.fuse_inputs(shards)
    f_graphdef, f_state = nnx.split(fused)
    f_pool = fused_pool(pool, shards)
    for name, step in steps.items():
      y, new = _run(graphdef, state, pool, step)
      if mesh is None:
        fy, fnew = _run(f_graphdef, f_state, f_pool, step)
      else:
        names = {"conv": (None, None, "kv_heads"), "state": (None, "kv_heads", None, None)}
        with sharding.layout(mesh_cfg), jax.set_mesh(mesh):
          placed = jax.device_put(f_pool, mesh_lib.pure_shardings(f_pool, mesh, names))
          fy, fnew = _run(f_graphdef, mesh_lib.shard_params(f_state, mesh), placed, step)
      out[f"{case}/{name}"] = {"y": _max_rel(y, fy), "state": _max_rel(new["state"], fnew["state"]),
                               "conv": _max_rel(fused_pool(new, shards)["conv"], fnew["conv"])}
  return out


def test_fused_layout_matches_separate():
  out = fused_vs_separate()
  assert len(out) == 4
  for case, err in out.items():
    assert max(err.values()) < 2e-5, (case, err)


def test_fused_layout_drops_the_separate_weights():
  """The serving layout holds one input weight and one conv weight in place of nine, laid out
  head-major over the shards, and its cache one conv tail."""
  cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32").model
  layer = KDA(cfg, rngs=nnx.Rngs(0))
  q = layer.q_proj.kernel[...]
  layer.fuse_inputs(2)
  names = set(nnx.to_pure_dict(nnx.state(layer)))
  assert {"in_proj", "conv1d", "f_b_proj", "o_proj"} <= names
  assert not names & {"q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "f_a_proj", "q_conv1d"}
  k = cfg.kda
  half = k.num_heads * k.head_dim // 2
  np.testing.assert_array_equal(layer.in_proj[...][:, 1, :half], q[:, half:])
  assert set(layer.init_cache(3)) == {"conv", "state"}
