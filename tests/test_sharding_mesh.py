"""Mesh construction, parameter placement rules and the plan report (single device)."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax import config as config_lib
from k3jax.config import ConfigError, MeshConfig
from k3jax.train_state import abstract_model, abstract_train_state
from sharding import mesh as mesh_lib
from sharding.rules import logical_spec


def test_axis_sizes_fill_and_errors():
  assert mesh_lib.axis_sizes(MeshConfig(data=-1, expert=4, context=2), 64) == {
      "data": 8, "fsdp": 1, "expert": 4, "context": 2, "tensor": 1}
  with pytest.raises(ConfigError, match="not divisible"):
    mesh_lib.axis_sizes(MeshConfig(data=-1, expert=3), 8)
  with pytest.raises(ConfigError, match="multiply to 4"):
    mesh_lib.axis_sizes(MeshConfig(data=2, expert=2), 8)


def test_one_device_mesh_same_path():
  mesh = mesh_lib.make_mesh(MeshConfig())
  assert mesh.axis_names == mesh_lib.AXES and math.prod(mesh.axis_sizes) == len(jax.devices())
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_logical_specs_for_k3_layout():
  sizes = {"data": 1, "fsdp": 2, "expert": 32, "context": 32, "tensor": 1}
  axes = [a for a, s in sizes.items() if s > 1]
  # activations: tokens over batch axes and context, nothing else
  assert logical_spec(("batch", "length", "embed"), None, axes) == P(("fsdp", "expert"), "context", None)
  # parameters: ZeRO over fsdp x context x expert; K3's d=7168 is not divisible by 2048, so the
  # axis that does not fit moves to the other dimension
  spec = mesh_lib.fit_spec(logical_spec(("embed", "heads"), None, axes), (7168, 12288), sizes)
  assert spec == P(("fsdp", "context"), "expert")
  assert logical_spec(("expert", "latent", "mlp"), None, axes) == P("expert", ("fsdp", "context"), None)


def test_names_tree_and_pure_shardings():
  cfg = config_lib.load("configs/k3_tiny.yaml")
  names = mesh_lib.names_tree(abstract_model(cfg))
  assert names["layers"][1]["mlp"]["experts"]["w_gate_up"] == ("expert", "latent", "mlp")
  assert names["embed_tokens"]["embedding"] == ("vocab", "embed")
  amesh = mesh_lib.abstract_mesh(MeshConfig(data=2, expert=2, context=2), 8)
  struct = {"embed_tokens": {"embedding": jax.ShapeDtypeStruct((320, 256), np.float32)}}
  sh = mesh_lib.pure_shardings(struct, amesh, {"embed_tokens": {"embedding": ("vocab", "embed")}})
  assert sh["embed_tokens"]["embedding"].spec == P(None, ("context", "expert"))


def test_parameters_a_mesh_axis_cannot_split_are_named():
  """A rule asks for a mesh axis that divides none of a parameter's dimensions: the parameter is
  whole on every device of that axis. ``unsplit_params`` groups such leaves by pattern, and the
  plan (and train.py at start-up) warn once they hold more than 1% of the model."""
  from k3jax import plan
  cfg = config_lib.load("configs/k3_tiny.yaml")
  state, names = plan.abstract_state(cfg)
  params = state.params
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  three = plan.parse_mesh("fsdp=3")
  unsplit = mesh_lib.unsplit_params(params, names, three)
  emb = next(g for g in unsplit if g["leaf"] == "embed_tokens.embedding")
  assert emb == {"leaf": "embed_tokens.embedding", "shape": [320, 256], "axes": ["fsdp"],
                 "count": 1, "bytes": 320 * 256 * 4}  # neither 320 nor 256 splits 3 ways
  q = next(g for g in unsplit if g["leaf"] == "layers.*.self_attn.q_proj.kernel")
  assert q["count"] == 3 and q["bytes"] == 3 * math.prod(q["shape"]) * 4  # the 3 KDA layers
  warning = mesh_lib.unsplit_warning(unsplit, three, total)
  assert warning.startswith("warning:") and "fsdp=3" in warning and "x3" in warning
  rep = plan.plan(config_lib.load("configs/k3_tiny.yaml", ["mesh.fsdp=3"]), three, 64, 6,
                  platform="cpu")
  assert rep["warning"] == warning and rep["unsplit_params"][0]["GB"] > 0
  eight = plan.parse_mesh("fsdp=8")  # only A_log [4] cannot split: under 1%, no warning
  assert [g["leaf"] for g in mesh_lib.unsplit_params(params, names, eight)] == [
      "layers.*.self_attn.A_log"]
  assert mesh_lib.unsplit_warning(mesh_lib.unsplit_params(params, names, eight), eight, total) is None
  assert mesh_lib.unsplit_params(params, names, plan.parse_mesh("data=1")) == []


@pytest.mark.slow
def test_plan_report_tiny():
  from k3jax import plan
  cfg = config_lib.load("configs/k3_tiny.yaml", ["mesh.data=2", "mesh.expert=2", "mesh.context=2"])
  sizes = plan.parse_mesh("data=2,expert=2,context=2")
  rep = plan.plan(cfg, sizes, 64, 8)
  b = rep["per_device_bytes"]
  assert rep["devices"] == 8 and b["params"] > 0 and b["optimizer"] > 0 and b["activations_peak"] > 0
  coll = rep["collectives_bytes_per_step"]
  for key in ("expert_all_to_all_tokens", "moonep_weight_fetch_all_to_all",
              "kda_context_all_gather_MN", "mla_context_all_gather_latent", "grad_all_reduce"):
    assert coll[key] > 0, key
  # replicated on one device: the parameter bytes are the whole model
  one = plan.plan(config_lib.load("configs/k3_tiny.yaml"), plan.parse_mesh("data=1"), 64, 8)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(plan.abstract_state(cfg)[0].params))
  assert one["per_device_bytes"]["params"] == total > b["params"]
  with pytest.raises(ConfigError, match="unknown axis"):
    plan.parse_mesh("pipeline=2")


def test_plan_counts_one_micro_batch_of_activations_and_every_micro_batch_of_collectives():
  """With ``train.grad_accum`` A the step runs A micro-batches one after another: activations
  are those of one micro-batch (the plan of batch / A without accumulation), collectives A times
  theirs; a batch the micro-batches cannot split over the token axes is a clear error."""
  from k3jax import plan
  sizes = plan.parse_mesh("data=2,expert=2,context=2")
  load = lambda *o: config_lib.load("configs/k3_tiny.yaml", ["mesh.data=2", "mesh.expert=2",
                                                             "mesh.context=2", *o])
  acc3 = lambda: load("train.batch_size=12", "train.grad_accum=3")
  acc = plan.plan(acc3(), sizes, 64, 12)
  one = plan.plan(load(), sizes, 64, 4)
  assert acc["micro_batch"] == 4 and acc["tokens_per_step"] == 3 * one["tokens_per_step"]
  assert acc["per_device_bytes"]["activations_peak"] == one["per_device_bytes"]["activations_peak"]
  for key, v in one["collectives_bytes_per_step"].items():
    assert acc["collectives_bytes_per_step"][key] == pytest.approx(3 * v), key
  with pytest.raises(ConfigError, match="micro-batch of 2 sequences"):
    plan.plan(acc3(), sizes, 64, 6)
  with pytest.raises(ConfigError, match="train.grad_accum = 3"):
    plan.plan(acc3(), sizes, 64, 8)


@pytest.mark.slow
def test_plan_remat_skip_between_remat_and_none():
  """Layers taken out of the remat (``model.remat_skip``) raise the activation estimate from the
  remat policy's towards no remat, and their recompute's all-gathers leave the collectives."""
  from k3jax import plan
  sizes = plan.parse_mesh("fsdp=2")
  rep = lambda *o: plan.plan(config_lib.load("configs/k3_tiny.yaml", ["mesh.fsdp=2", *o]), sizes,
                             64, 8)
  act = lambda r: r["per_device_bytes"]["activations_peak"]
  gather = lambda r: r["collectives_bytes_per_step"]["fsdp_all_gather_params"]
  dots, skip2, none = rep("model.remat=dots"), rep("model.remat=dots", "model.remat_skip=2"), rep()
  assert act(dots) < act(skip2) < act(none)
  assert gather(dots) > gather(skip2) > gather(none) > 0
  everything = rep("model.remat=dots", "model.remat_skip=5")  # all five layers skipped
  assert act(everything) == act(none) and gather(everything) == gather(none)


@pytest.mark.slow
def test_plan_traced_activations_against_the_compiled_step():
  """Without expert, context or tensor splits the plan's activations come from the traced loss's
  residuals: against the temporaries XLA (CPU) compiles the loss's gradient to, they lie between
  half and the whole (XLA's CPU backward keeps more cotangents than its GPU one; on an H200 the
  estimate is within 5%, benchmarks/RESULTS.md). The analytical model, which counts a ``dots``
  layer as keeping only its input, fails the same bound."""
  from k3jax import plan, train_step as ts
  b, t = 2, 256
  for over in (["model.remat=dots"], ["model.remat=full", "model.remat_skip=3"]):
    cfg = config_lib.load("configs/k3_tiny.yaml", over)
    act = plan.plan(cfg, plan.parse_mesh("data=1"), t, b, platform="cpu")["activations"]
    assert act["method"] == "traced"
    terms = act["terms_GB"]
    est = terms["saved_residuals"] + max(terms["loss_chunk_logits_and_gradient"],
                                         terms["one_layer_recompute"])
    state = plan.abstract_state(cfg)[0]
    grad = jax.grad(lambda p, bi, x: ts._loss(state.graphdef, p, bi, x, cfg.train)[0])
    compiled = jax.jit(grad).trace(state.params, state.biases,
                                   plan._abstract_batch(b, t)).lower().compile()
    temps = compiled.memory_analysis().temp_size_in_bytes / plan.GB
    assert 0.5 * temps < est < temps, (over, est, temps)
    if over == ["model.remat=dots"]:
      analytical = plan.activations(cfg, plan.parse_mesh("data=1"), t, b)["peak"] / plan.GB
      assert not 0.5 * temps < analytical < temps, (analytical, temps)
    else:  # layers 0-1 recompute, 2-4 keep everything
      assert terms["one_layer_recompute"] > 0


@pytest.mark.slow
def test_plan_peak_for_every_remat_skip_and_the_largest_that_fits():
  """From one trace of the configured layout the plan gives the peak for every
  ``model.remat_skip`` (each layer leaving the remat adds what its backward would recompute);
  each agrees with the plan traced at that setting, and ``--memory`` picks the largest setting
  whose total fits."""
  from k3jax import plan
  load = lambda *o: config_lib.load("configs/k3_tiny.yaml", ["model.remat=dots", *o])
  sizes = plan.parse_mesh("fsdp=2")
  rep = plan.plan(load("model.remat_skip=2"), sizes, 128, 4, platform="cpu")
  curve = rep["activations"]["by_remat_skip_GB"]
  assert sorted(curve) == list(range(6)) and all(curve[n] < curve[n + 1] for n in range(5))
  assert curve[2] == rep["per_device_GB"]["activations_peak"]
  direct = plan.plan(load("model.remat_skip=4"), sizes, 128, 4, platform="cpu")
  assert abs(curve[4] / direct["per_device_GB"]["activations_peak"] - 1) < 0.03
  state = sum(rep["per_device_GB"][k] for k in ("params", "grads", "optimizer"))
  budget = state + (curve[3] + curve[4]) / 2
  fit = plan.plan(load(), sizes, 128, 4, platform="cpu", memory_gb=budget)["fit"]
  assert fit == {"memory_GB": budget, "fits": True, "largest_remat_skip": 3}  # configured: 0
  assert plan.largest_fit({0: 5.0, 1: 6.0}, 2.0, 7.5) == 0
  assert plan.largest_fit({0: 5.0, 1: 6.0}, 2.0, 6.5) is None


@pytest.mark.slow
def test_plan_traces_the_target_platforms_kernels():
  """``--platform cuda`` traces the GPU kernels on a CPU host (``pallas_kernels.target_platform``),
  which keep less than the XLA reference's float32 chunk tensors; the platform must be known."""
  import pallas_kernels
  from k3jax import plan
  from pallas_kernels import kda
  cfg = config_lib.load("configs/k3_tiny.yaml")
  with pallas_kernels.target_platform("gpu"):
    assert kda.resolve(None) == "pallas_gpu"
    with pallas_kernels.target_platform("tpu"):
      assert kda.resolve(None) == "pallas_tpu"
    assert pallas_kernels.default_backend() == "gpu"
  assert pallas_kernels.default_backend() == jax.default_backend()
  saved = {p: plan.traced_activations(cfg, 2, 256, p)["terms"]["saved_residuals"]
           for p in ("cpu", "cuda", "tpu")}
  assert saved["cuda"] < saved["cpu"] and saved["tpu"] < saved["cpu"], saved
  with pytest.raises(ValueError, match="target_platform"):
    with pallas_kernels.target_platform("metal"):
      pass
  with pytest.raises(SystemExit):
    plan.main(["configs/k3_tiny.yaml", "--mesh", "data=1", "--platform", "metal"])


@pytest.mark.slow
@pytest.mark.parametrize("platform,kernels", [("tpu", {"mosaic_tpu"}),
                                              ("cuda", {"triton", "mosaic_gpu"})])
def test_plan_lowers_the_whole_step_with_the_targets_kernels(platform, kernels):
  """``--lower-layers`` lowers the training step (forward, backward, optimizer) for a TPU or an
  H200 on this CPU host with that platform's Pallas kernels inside the expert- and
  context-parallel ``shard_map``s: the model's composition of the kernels lowers, not only each
  kernel alone. k3_1b cut to 2 layers (one KDA, one MLA; its remat_skip cut too)."""
  from k3jax import plan
  sizes = plan.parse_mesh("fsdp=2,expert=2,context=2")
  cfg = config_lib.load("configs/k3_1b.yaml", [f"mesh.{a}={s}" for a, s in sizes.items()]
                        + ["train.grad_accum=1"])  # the batch of 4 below in one micro-batch
  low = plan.lower_step(cfg, sizes, 512, 4, 2, platform)
  assert low["layers"] == 2 and set(low["kernel_calls"]) == kernels, low
  assert low["shard_map_collectives"]["all_to_all"] > 0  # the experts' dispatch and combine
  assert low["shard_map_collectives"]["collective_permute"] > 0  # MLA's zigzag context split


def test_prefix_compose_equals_associative_scan():
  """The context-parallel KDA prefix of affine maps (log-depth scan with static shifts) equals
  ``jax.lax.associative_scan`` and the sequential composition."""
  import jax.numpy as jnp
  from sharding.context_parallel import _compose, prefix_compose
  rng = np.random.default_rng(0)
  for c in (1, 2, 3, 5, 8):
    ms = jnp.asarray(rng.normal(size=(c, 2, 4, 4)) * 0.5)
    ns = jnp.asarray(rng.normal(size=(c, 2, 4, 3)))
    got = prefix_compose(ms, ns)
    want = jax.lax.associative_scan(_compose, (ms, ns))
    seq = [(ms[0], ns[0])]
    for i in range(1, c):
      seq.append(_compose(seq[-1], (ms[i], ns[i])))
    for a, b, s in zip(got, want, zip(*seq)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(a, jnp.stack(s), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_optimizer_state_is_split_like_the_parameters(opt):
  """``optimizer_shardings`` lays each moment out as its parameter (``jit(tx.init)`` alone
  replicated all of it on every device): on fsdp=8 the per-device optimizer bytes of the train
  state equal the plan's exact count, an eighth of the whole, for AdamW and for Muon (whose
  packed w_gate_up momentum has its own shape)."""
  from k3jax import plan
  sizes = plan.parse_mesh("fsdp=8")
  cfg = config_lib.load("configs/k3_tiny.yaml", ["mesh.fsdp=8", f"optimizer.name={opt}"])
  amesh = mesh_lib.abstract_mesh(MeshConfig(fsdp=8), 8)
  a_opt = abstract_train_state(cfg, amesh).opt_state
  nbytes = lambda x: math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
  per_device = sum(map(nbytes, jax.tree.leaves(a_opt)))
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(a_opt))
  assert per_device == plan.state_bytes(cfg, sizes)["optimizer"] < whole / 7, (per_device, whole)
  params = plan.abstract_state(cfg)[0].params
  assert mesh_lib.optimizer_shardings(a_opt, params) is None  # parameters not on a mesh
