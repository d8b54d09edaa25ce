"""The serving layout of the attention layers (:meth:`k3jax.kda.KDA.fuse_inputs`: one input
matmul, one conv tail; :meth:`k3jax.mla.MLA.fuse_inputs`: one input matmul) against the separate
parameters it is built from: decode and prefill outputs and what they write to the cache (KDA
recurrent states and conv tails, MLA latent pages), float32. KDA with both gates (the bounded gate
with the full output gate; the softplus gate with the low-rank output gate and grouped values),
MLA with q LoRA and the output gate and with neither; on one device here and on 8 simulated
devices with heads over ``tensor`` (tests/test_sharding_workers.py ``serve_layout``)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.kda import KDA
from k3jax.mla import MLA
from tests.conftest import tiny_config

CASES = {
    "kda_bounded": (KDA, ()),
    "kda_softplus_low_rank": (KDA, ("model.kda.gate=softplus", "model.kda.output_gate=low_rank",
                                    "model.kda.output_gate_rank=48", "model.kda.num_v_heads=8",
                                    "model.kda.forget_rank=32")),
    "mla_lora_gate": (MLA, ()),
    "mla_plain": (MLA, ("model.mla.q_lora_rank=0", "model.mla.output_gate=false")),
}
SLOTS = 7
PAGES, PAGE_SIZE = 12, 4


def _max_rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


def fused_pool(pool: dict, shards: int) -> dict:
  """A separate-layout slot pool in the serving layout: per shard its q, k, v tail channels."""
  split = lambda a: a.reshape(*a.shape[:2], shards, -1)
  conv = jnp.concatenate([split(pool["conv_" + n]) for n in "qkv"], -1)
  return {"conv": conv.reshape(*conv.shape[:2], -1), "state": pool["state"]}


def _inputs(kind, cfg, rng):
  """The layer (random parameters), a random cache (KDA: a slot pool; MLA: latent pages),
  decode and prefill inputs (4 rows: the meshes' batch axes split them)."""
  layer = kind(cfg, rngs=nnx.Rngs(1))
  graphdef, state = nnx.split(layer)
  state = jax.tree.map(lambda a: a + 0.2 * jnp.asarray(rng.normal(size=a.shape), a.dtype), state)
  d = cfg.hidden_size
  if kind is KDA:
    pool = {k: jnp.asarray(rng.normal(size=a.shape), a.dtype)
            for k, a in layer.init_cache(SLOTS).items()}
    rows = lambda slots: {"slots": jnp.asarray(slots, jnp.int32)}
    decode_rows, prefill_rows = rows([4, 1, 5, 3]), rows([2, 6, 1, 3])
  else:
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    pool = {"pages": jnp.asarray(rng.normal(size=(PAGES, PAGE_SIZE, width)), jnp.float32)}
    table = jnp.asarray(rng.permutation(np.arange(1, PAGES))[:8].reshape(4, 2), jnp.int32)
    decode_rows = {"page_table": table, "lengths": jnp.asarray([3, 8, 5, 1], jnp.int32)}
    prefill_rows = {"page_table": table, "lengths": jnp.asarray([8, 5, 7, 6], jnp.int32)}
  steps = {
      "decode": dict(x=rng.normal(size=(4, 1, d)), rows=decode_rows, valid=None, decode=True),
      # right-padded prompt chunks of 5, 2, 1 and 4 tokens
      "prefill": dict(x=rng.normal(size=(4, 5, d)), rows=prefill_rows,
                      valid=np.arange(5)[None, :] < np.array([[5], [2], [1], [4]]), decode=False),
  }
  return graphdef, state, pool, steps


def _run(graphdef, state, pool, step):
  def call(state, pool, x, rows, valid):
    rows = dict(rows)
    kw = {"lengths": rows.pop("lengths")} if "lengths" in rows else {}
    y, new = nnx.merge(graphdef, state)(x, valid=valid, cache=dict(pool, **rows),
                                        decode=step["decode"], **kw)
    return y, {k: v for k, v in new.items() if k in pool or k == "tail"}
  valid = None if step["valid"] is None else jnp.asarray(step["valid"])
  return jax.jit(call)(state, pool, jnp.asarray(step["x"], jnp.float32), step["rows"], valid)


def fused_vs_separate(mesh_cfg=None) -> dict:
  """Largest relative error of the serving layout (on ``mesh_cfg``'s mesh, or one device) against
  the separate layout on one device, per case and step: outputs and cache writes (KDA: states and
  the rows' conv tails, which the serving layout takes and returns gathered; MLA: pages)."""
  import sharding
  from sharding import mesh as mesh_lib
  out = {}
  for case, (kind, overrides) in CASES.items():
    cfg = tiny_config("model.param_dtype=float32", "model.compute_dtype=float32", *overrides).model
    graphdef, state, pool, steps = _inputs(kind, cfg, np.random.default_rng(0))
    mesh = None if mesh_cfg is None else mesh_lib.make_mesh(mesh_cfg)
    shards = 1 if mesh is None else mesh.shape["tensor"]
    fused = nnx.merge(graphdef, state)
    fused.fuse_inputs(shards)
    f_graphdef, f_state = nnx.split(fused)
    f_pool = {k: a for k, a in pool.items() if not k.startswith("conv_")}
    for name, step in steps.items():
      y, new = _run(graphdef, state, pool, step)
      f_step = step
      if kind is KDA:  # the serving layout's rows' tails, and the separate layout's written ones
        slots = step["rows"]["slots"]
        f_step = dict(step, rows=dict(step["rows"], tail=fused_pool(pool, shards)["conv"][slots]))
        new = {"state": new["state"], "tail": fused_pool(new, shards)["conv"][slots]}
      if mesh is None:
        fy, fnew = _run(f_graphdef, f_state, f_pool, f_step)
      else:
        names = {"state": (None, "kv_heads", None, None), "pages": (None, None, None)}
        names = {k: names[k] for k in f_pool}
        with sharding.layout(mesh_cfg), jax.set_mesh(mesh):
          placed = jax.device_put(f_pool, mesh_lib.pure_shardings(f_pool, mesh, names))
          fy, fnew = _run(f_graphdef, mesh_lib.shard_params(f_state, mesh), placed, f_step)
      out[f"{case}/{name}"] = {"y": _max_rel(y, fy),
                               **{k: _max_rel(new[k], fnew[k]) for k in new}}
  return out


def test_fused_layout_matches_separate():
  out = fused_vs_separate()
  assert len(out) == 8
  for case, err in out.items():
    assert max(err.values()) < 2e-5, (case, err)


def test_fused_layout_drops_the_separate_weights():
  """The KDA serving layout holds one input weight and one conv weight in place of nine, laid out
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
