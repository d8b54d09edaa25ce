"""Schedules, Muon's update RMS and parameter roles, weight-decay masks, and the train step's
gradient accumulation / non-finite guard on a toy model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax import config, optim, train_step
from k3jax.latent_moe import RouterBias

D = 128


def cfg_with(*overrides):
  return config.load("configs/k3_tiny.yaml", list(overrides))


def fake_params():
  """A pure-dict tree with the K3 parameter names (tiny preset: layer 0 KDA, layer 3 MLA)."""
  ones = lambda *s: jnp.ones(s, jnp.float32)
  return {
      "embed_tokens": {"embedding": ones(320, D)},
      "layers": {
          0: {"self_attn": {"q_proj": {"kernel": ones(D, 256)}, "o_proj": {"kernel": ones(256, D)},
                            "q_conv1d": {"kernel": ones(4, 256)}, "A_log": ones(4),
                            "dt_bias": ones(256), "o_norm": {"weight": ones(64)}},
              "mlp": {"gate_proj": {"kernel": ones(D, 512)}},
              "input_layernorm": {"weight": ones(D)}},
          3: {"self_attn": {"kv_b_proj": {"kernel": ones(64, 4 * 64)}},
              "mlp": {"experts": {"w_gate_up": ones(16, 32, 2 * 24), "w_down": ones(16, 24, 32)},
                      "gate": {"kernel": ones(D, 16)}},
              "mlp_res": {"proj": ones(D)}},
      },
      "lm_head": {"kernel": ones(D, 320)},
  }


def random_like(tree, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), tree)


def first_update(cfg, grads=None, seed=0):
  params = fake_params()
  tx, _ = optim.make_optimizer(cfg, params)
  grads = random_like(params, seed) if grads is None else grads
  updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
  return updates


def rms(x):
  return float(jnp.sqrt(jnp.mean(jnp.square(x))))


NO_DECAY_NO_CLIP = ["optimizer.weight_decay=0.0", "optimizer.grad_clip=0.0",
                    "optimizer.schedule=constant", "optimizer.warmup_steps=0", "optimizer.lr=0.01"]


def test_wsd_schedule():
  s = optim.make_schedule(cfg_with("optimizer.lr=1.0", "optimizer.warmup_steps=10",
                                   "optimizer.decay_fraction=0.2",
                                   "optimizer.min_lr_ratio=0.1").optimizer, 100)
  np.testing.assert_allclose([float(s(i)) for i in (0, 4, 9, 10, 50, 80, 90, 100, 200)],
                             [0.1, 0.5, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)


def test_cosine_and_constant_schedules():
  o = cfg_with("optimizer.lr=2.0", "optimizer.warmup_steps=4", "optimizer.schedule=cosine",
               "optimizer.min_lr_ratio=0.0").optimizer
  s = optim.make_schedule(o, 104)
  np.testing.assert_allclose([float(s(i)) for i in (0, 3, 4, 54, 104)], [0.5, 2.0, 2.0, 1.0, 0.0],
                             atol=1e-6)
  c = optim.make_schedule(cfg_with("optimizer.schedule=constant", "optimizer.lr=1.0",
                                   "optimizer.warmup_steps=0").optimizer, 10)
  assert [float(c(i)) for i in (0, 5, 50)] == [1.0, 1.0, 1.0]


def test_muon_update_rms_matches_adamw_scale():
  cfg = cfg_with("optimizer.name=muon", *NO_DECAY_NO_CLIP)
  u = first_update(cfg)
  lr = cfg.optimizer.lr
  muon = [u["layers"][0]["self_attn"]["q_proj"]["kernel"], u["layers"][0]["self_attn"]["o_proj"]["kernel"],
          u["layers"][0]["mlp"]["gate_proj"]["kernel"], u["layers"][3]["mlp"]["gate"]["kernel"],
          u["layers"][3]["mlp"]["experts"]["w_gate_up"], u["layers"][3]["mlp"]["experts"]["w_down"],
          u["layers"][3]["self_attn"]["kv_b_proj"]["kernel"]]
  for x in muon:  # 0.2 * sqrt(max(fan_in, fan_out)) scaling: RMS 0.2 x lr whatever the shape
    assert 0.17 < rms(x) / lr < 0.23, (x.shape, rms(x) / lr)
  adam = [u["embed_tokens"]["embedding"], u["lm_head"]["kernel"],
          u["layers"][0]["self_attn"]["q_conv1d"]["kernel"], u["layers"][0]["self_attn"]["A_log"],
          u["layers"][0]["input_layernorm"]["weight"], u["layers"][3]["mlp_res"]["proj"]]
  for x in adam:  # Adam's first step is sign-like: RMS 1 x lr
    assert 0.95 < rms(x) / lr < 1.05, (x.shape, rms(x) / lr)
  # Orthogonalised: the singular values of a Muon update are nearly equal.
  s = np.linalg.svd(np.asarray(u["layers"][0]["mlp"]["gate_proj"]["kernel"]), compute_uv=False)
  assert s.max() / s.min() < 2.0


@pytest.mark.parametrize("form", ["sums", "polynomial"])
@pytest.mark.parametrize("precision,operand", [("bf16", "bf16"), ("f32", "f32")])
def test_muon_newton_schulz_precision(precision, operand, form):
  """``muon_ns_precision=bf16`` carries the Newton-Schulz iterate in bf16: every matmul of the
  optimizer takes bf16 operands and gives a bf16 product (float32 accumulation inside); ``f32``
  keeps float32 operands and products. Both step forms (``optimizer.ns_form``)."""
  cfg = cfg_with("optimizer.name=muon", f"optimizer.muon_ns_precision={precision}",
                 f"optimizer.ns_form={form}", *NO_DECAY_NO_CLIP)
  params = fake_params()
  tx, _ = optim.make_optimizer(cfg, params)
  text = jax.jit(tx.update).lower(random_like(params, 0), jax.jit(tx.init)(params), params).as_text()
  dots = [l for l in text.splitlines() if "dot_general" in l]
  assert dots  # the Newton-Schulz iteration
  for line in dots:
    types = line.split("(tensor<")[1]
    assert all(t.split(">")[0].endswith("x" + operand) for t in types.split("tensor<")[:2]), line
    assert line.rstrip().endswith("x" + operand + ">"), line
  with pytest.raises(ValueError, match="muon_ns_precision"):
    cfg_with("optimizer.muon_ns_precision=fp8")
  with pytest.raises(ValueError, match="optimizer.ns_form"):
    cfg_with("optimizer.ns_form=cubic")


@pytest.mark.parametrize("per_head", [True, False])
def test_muon_per_head_orthogonalisation(per_head):
  cfg = cfg_with("optimizer.name=muon", f"optimizer.muon_per_head={str(per_head).lower()}",
                 *NO_DECAY_NO_CLIP)
  g1 = random_like(fake_params(), 1)
  g2 = jax.tree.map(lambda x: x, g1)
  q = g1["layers"][0]["self_attn"]["q_proj"]["kernel"]  # [D, 4 heads * 64]
  g2["layers"][0]["self_attn"]["q_proj"]["kernel"] = q.at[:, 64:].multiply(-3.0).at[:, 64:].add(1.0)
  u1 = first_update(cfg, g1)["layers"][0]["self_attn"]["q_proj"]["kernel"]
  u2 = first_update(cfg, g2)["layers"][0]["self_attn"]["q_proj"]["kernel"]
  head0_same = np.allclose(u1[:, :64], u2[:, :64], atol=1e-6)
  assert head0_same == per_head  # per head: head 0's update depends on head 0's gradient only
  if per_head:
    s = np.linalg.svd(np.asarray(u1[:, :64]), compute_uv=False)
    assert s.max() / s.min() < 2.0


@pytest.mark.parametrize("form", ["sums", "polynomial"])
@pytest.mark.parametrize("shape,dims", [((6, 10), (0, 1)), ((12, 5), (0, 1)),
                                        ((3, 4, 2, 7), (1, 3)), ((2, 9, 4), (2, 1))])
def test_newton_schulz_matches_a_float64_loop(shape, dims, form):
  """:func:`optim.newton_schulz` in float32 against the same quintic iteration in float64 NumPy,
  matrix by matrix, on wide and tall matrices and on batched views whose fan-in and fan-out axes
  are not the last two (including fan-out before fan-in); three leaves of one view shape are
  stacked (one scaled: each leaf must get the iteration of its own matrices). Both step forms."""
  from optax.contrib import MuonDimensionNumbers
  rng = np.random.default_rng(len(shape))
  red, out = dims
  batch = [a for a in range(len(shape)) if a not in dims]
  layout = batch + [red, out]
  mats = np.transpose(rng.normal(size=shape), layout).reshape(-1, shape[red], shape[out])
  mats = mats / np.linalg.norm(mats, axis=(1, 2), keepdims=True)
  a, b, c = optim.NS_COEFFS

  def ns64(ms):  # the iteration in float64, back in x's layout
    res = []
    for m in ms:
      tall = m.shape[0] > m.shape[1]
      y = m.T if tall else m
      for _ in range(optim.NS_STEPS):
        s = y @ y.T
        y = a * y + (b * s + c * s @ s) @ y
      res.append((y.T if tall else y) * 0.2 * np.sqrt(max(m.shape)))
    return np.transpose(np.stack(res).reshape([shape[i] for i in layout]), np.argsort(layout))

  xn = np.transpose(mats.reshape([shape[i] for i in layout]), np.argsort(layout))
  xj = jnp.asarray(xn, jnp.float32)
  with jax.default_matmul_precision("highest"):
    got = optim.newton_schulz([xj, xj * 0.5, xj], [MuonDimensionNumbers(red, out)] * 3,
                              jnp.float32, rms=0.2, form=form)
  for g, want in zip(got, (ns64(mats), ns64(mats * 0.5), ns64(mats))):
    np.testing.assert_allclose(np.asarray(g, np.float64), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["sums", "polynomial"])
def test_newton_schulz_compiles_one_step_per_group(form):
  """The steps are a loop: the lowered program holds one step's three matmuls per group of
  stacked leaves (two groups here), not ``NS_STEPS`` copies (each instruction costs a TPU compile
  seconds at K3's size). Only the program's structure is checked: the inputs are abstract."""
  from optax.contrib import MuonDimensionNumbers
  xs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 16), (8, 16), (4, 12))]
  text = jax.jit(lambda xs: optim.newton_schulz(
      xs, [MuonDimensionNumbers(0, 1)] * 3, jnp.float32, rms=0.2, form=form)).lower(xs).as_text()
  assert text.count("stablehlo.while") == 2
  assert text.count("stablehlo.dot_general") == 2 * 3


def test_weight_decay_mask():
  m = optim.decay_mask(fake_params())
  assert m["embed_tokens"]["embedding"] and m["lm_head"]["kernel"]
  assert m["layers"][0]["self_attn"]["q_proj"]["kernel"] and m["layers"][3]["mlp"]["experts"]["w_down"]
  for no in (m["layers"][0]["self_attn"]["A_log"], m["layers"][0]["self_attn"]["dt_bias"],
             m["layers"][0]["self_attn"]["o_norm"]["weight"], m["layers"][0]["input_layernorm"]["weight"],
             m["layers"][3]["mlp_res"]["proj"]):
    assert not no
  # AdamW applies it: with zero gradients only the decayed leaves move.
  cfg = cfg_with("optimizer.weight_decay=0.5", "optimizer.grad_clip=0.0",
                 "optimizer.schedule=constant", "optimizer.warmup_steps=0", "optimizer.lr=0.1")
  params = fake_params()
  tx, _ = optim.make_optimizer(cfg, params)
  u, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  assert float(jnp.max(jnp.abs(u["layers"][0]["self_attn"]["A_log"]))) == 0.0
  np.testing.assert_allclose(u["lm_head"]["kernel"], -0.05, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# The train step on a toy model with the K3 interface (hidden, lm_head, router biases).


class _Gate(nnx.Module):
  def __init__(self):
    self.bias = RouterBias(jnp.zeros((4,), jnp.float32))


class _MLP(nnx.Module):
  def __init__(self):
    self.gate = _Gate()


class _Layer(nnx.Module):
  def __init__(self, rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)) * 0.3)
    self.mlp = _MLP()


class _Head(nnx.Module):
  def __init__(self, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (8, 16)) * 0.3)


class ToyModel(nnx.Module):
  """Embedding, one tanh layer with a 4-expert 'router' whose stats are the mean features."""

  def __init__(self, rngs):
    self.embed = nnx.Param(jax.random.normal(rngs.params(), (16, 8)))
    self.layers = nnx.List([_Layer(rngs)])
    self.lm_head = _Head(rngs)

  def hidden(self, ids, *, segment_ids=None, vision=None, stacked=None):
    assert vision is None and stacked is None  # a text-only stand-in without scanned layers
    h = jnp.tanh(self.embed[...][ids] @ self.layers[0].w[...])
    scores = jax.nn.sigmoid(h[..., :4]).reshape(-1, 4)
    load = jnp.sum(scores, 0)
    return h, {"moe": {"0": {"load": load, "bias_stat": load - jnp.mean(load)}}}


def toy_batch(seed, b=4, t=6):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 16, (b, t)).astype(np.int32)
  w = (rng.random((b, t)) > 0.3).astype(np.float32)
  return {"input_ids": ids, "targets": np.roll(ids, -1, 1), "segment_ids": np.ones_like(ids),
          "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)), "weights": w}


def toy_step(*overrides):
  cfg = cfg_with("model.num_layers=1", "model.mla_layers=[]", "model.dense_layers=[]",
                 "model.moe.num_experts=4", "model.moe.top_k=2", "optimizer.grad_clip=0.0",
                 *overrides)
  graphdef, params, biases = nnx.split(ToyModel(nnx.Rngs(0)), nnx.Param, RouterBias)
  params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
  tx, sched = optim.make_optimizer(cfg, params)
  fn = jax.jit(train_step.make_train_step(cfg, graphdef, tx, sched))
  return fn, params, tx.init(params), biases


def test_grad_accumulation_matches_one_batch():
  batch = toy_batch(0)
  rng = jax.random.key_data(jax.random.key(0))
  f1, p, o, b = toy_step("train.batch_size=4", "train.grad_accum=1")
  f2, *_ = toy_step("train.batch_size=4", "train.grad_accum=2")
  p1, _, b1, m1 = f1(p, o, b, 0, rng, batch)
  p2, _, b2, m2 = f2(p, o, b, 0, rng, batch)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
  assert float(m1["tokens"]) == float(batch["weights"].sum())
  for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  # QB over micro-batches: next_bias averages the two micro-batches' proposals.
  assert not np.allclose(b1["layers"][0]["mlp"]["gate"]["bias"], 0.0)
  assert m1["moe_load_max_mean"].shape == (1,)


def test_bf16_logits_reach_the_loss_and_the_eval():
  """``train.bf16_logits`` stores the head's logits in bf16 in the train and eval steps: the loss
  moves by about the rounding (the toy head's logits are ~1, steps of 2^-8), the float32 path's
  does not."""
  batch = toy_batch(2)
  rng = jax.random.key_data(jax.random.key(0))
  f32, p, o, b = toy_step("train.batch_size=4")
  f16, *_ = toy_step("train.batch_size=4", "train.bf16_logits=true")
  l32, l16 = (float(f(p, o, b, 0, rng, batch)[3]["loss"]) for f in (f32, f16))
  assert 1e-6 < abs(l16 - l32) < 1e-2 * l32
  graphdef = nnx.graphdef(ToyModel(nnx.Rngs(0)))
  evals = (train_step.make_eval_step(graphdef, config.TrainConfig(bf16_logits=bf))
           for bf in (False, True))
  e32, e16 = (f(p, b, batch)[0] for f in evals)
  assert 1e-6 < abs(float(e16) - float(e32)) < 1e-2 * float(e32)


def test_nonfinite_step_is_skipped():
  f, p, o, b = toy_step("train.batch_size=4")
  batch = toy_batch(1)
  bad = jax.tree.map(lambda x: x, p)
  bad["embed"] = bad["embed"].at[3].set(jnp.nan)
  batch["input_ids"][0, 0] = 3
  rng = jax.random.key_data(jax.random.key(0))
  p2, o2, b2, m = f(bad, o, b, 0, rng, batch)
  assert int(m["nonfinite"]) == 1
  for x, y in zip(jax.tree.leaves((bad, o, b)), jax.tree.leaves((p2, o2, b2))):
    np.testing.assert_array_equal(x, y)
  _, _, _, m = f(p, o, b, 0, rng, batch)
  assert int(m["nonfinite"]) == 0


def test_momentum_matches_optax_scale_by_muon():
  """``optim._momentum`` (one norm reduction per leaf) gives optax's ``scale_by_muon(ns_steps=0)``
  updates and state over three steps, on 2-D, batched and fan-out-first views."""
  from optax.contrib import MuonDimensionNumbers as D
  rng = np.random.default_rng(7)
  shapes = {"w": (6, 10), "experts": (3, 5, 4), "flip": (2, 9, 4)}
  dims = {"w": D(0, 1), "experts": D(1, 2), "flip": D(2, 1)}
  dims_fn = lambda tree: {k: dims[k] for k in tree}
  ours = optim._momentum(0.9, 1e-8, dims_fn)
  ref = optax.contrib.scale_by_muon(ns_steps=0, beta=0.9, eps=1e-8, nesterov=True,
                                    weight_dimension_numbers=dims_fn)
  params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
  s1, s2 = ours.init(params), ref.init(params)
  for step in range(3):
    g = {k: jnp.asarray(rng.normal(size=s) * (step + 1), jnp.float32) for k, s in shapes.items()}
    u1, s1 = jax.jit(ours.update)(g, s1)
    u2, s2 = jax.jit(ref.update)(g, s2)
    for k in shapes:
      np.testing.assert_allclose(u1[k], u2[k], rtol=2e-6, atol=1e-7)
      np.testing.assert_allclose(s1.mu[k], s2.mu[k], rtol=1e-6)
    assert int(s1.count) == int(s2.count) == step + 1
