"""The whole model: packed documents, cached decoding, float64 parity, training signal."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax import generate
from k3jax.generate import sample
from k3jax.losses import cross_entropy
from k3jax.model import K3Model
from conftest import tiny_config

SMALL = ["model.hidden_size=128", "model.dense_intermediate=256", "model.moe.expert_intermediate=64",
         "model.moe.latent_dim=64", "model.moe.num_experts=8", "model.moe.top_k=2",
         "model.kda.num_heads=2", "model.mla.num_heads=2"]


@pytest.fixture(scope="module")
def model():
  return K3Model(tiny_config(*SMALL).model, rngs=nnx.Rngs(0))


def _pad_rows(rows, width):
  out = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return jnp.asarray(out)


def test_packed_documents_do_not_leak(model):
  """Each document of a packed row gives the logits it gives alone (KDA restarts, conv taps,
  MLA segment mask)."""
  ids = np.asarray(jax.random.randint(jax.random.key(1), (1, 50), 0, 256))
  seg = jnp.asarray([[1] * 17 + [2] * 20 + [3] * 13])
  fwd = jax.jit(lambda m, x, s: m(x, segment_ids=s))
  packed = fwd(model, jnp.asarray(ids), seg)
  spans = [(0, 17), (17, 37), (37, 50)]
  # each document alone, right-padded (causal: padding after a token cannot reach it)
  alone = jax.jit(lambda m, x: m(x))(model, _pad_rows([ids[0, lo:hi] for lo, hi in spans], 20))
  for i, (lo, hi) in enumerate(spans):
    np.testing.assert_allclose(np.asarray(packed[0, lo:hi]), np.asarray(alone[i, :hi - lo]),
                               rtol=2e-4, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kda_impl", [None, "pallas_gpu"])
def test_incremental_decode_matches_full_forward(model, kda_impl):
  """Greedy decoding and the logits of prefill + 4 decode steps equal the (XLA) full forward's;
  with ``pallas_gpu`` through the KDA kernels (interpret mode), the chunked kernels' final state
  entering the cache as the decode kernel's K-last pool."""
  full_model = model
  if kda_impl:
    model = K3Model(tiny_config(*SMALL, f"model.kda.implementation={kda_impl}").model,
                    rngs=nnx.Rngs(0))
  prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [2, 71, 82]]
  new = generate(model, prompts, max_new_tokens=5)
  full = jax.jit(lambda m, x: m(x))(full_model,
                                    _pad_rows([p + o for p, o in zip(prompts, new)], 16))
  for i, (p, o) in enumerate(zip(prompts, new)):
    assert len(o) == 5
    # greedy tokens equal the full forward's argmax at every step
    np.testing.assert_array_equal(np.asarray(jnp.argmax(full[i, len(p) - 1:len(p) + 4], -1)), o)
    # and the logits themselves agree: prefill + 4 decode steps vs one forward
  from k3jax.generate import _decode, _prefill
  graphdef, state = nnx.split(model)
  lengths = jnp.asarray([len(p) for p in prompts])
  logits, cache = _prefill(graphdef, state, _pad_rows(prompts, 9), lengths, 16)
  for step in range(5):
    for i, p in enumerate(prompts):
      np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(full[i, len(p) - 1 + step]),
                                 rtol=1e-4, atol=1e-4)
    nxt = jnp.asarray([o[step] for o in new])
    lengths = lengths + 1
    logits, cache = _decode(graphdef, state, cache, nxt, lengths)


def test_sampling():
  logits = jnp.asarray([[0.0, 5.0, 1.0], [3.0, 0.0, 2.9]])
  np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.key(0))), [1, 0])
  # a tiny nucleus keeps only the top token
  np.testing.assert_array_equal(np.asarray(sample(logits, jax.random.key(1), 1.0, 1e-3)), [1, 0])
  draws = np.stack([np.asarray(sample(logits, jax.random.key(i), 1.0, 1.0)) for i in range(200)])
  assert set(draws[:, 1]) == {0, 1, 2}  # full temperature sampling reaches every token
  with pytest.raises(ValueError, match="at least one token"):
    generate(K3Model(tiny_config(*SMALL).model, rngs=nnx.Rngs(0)), [[]], max_new_tokens=1)


@pytest.mark.parametrize("n_tok,chunk", [(7, 4), (1, 4), (16, 4)])
def test_cross_entropy_matches_direct(n_tok, chunk):
  """Loss, and gradients of h, the head and the weights, against a float64 NumPy softmax; T=1,
  T not a multiple of the chunk and a multiple of it."""
  rng = np.random.default_rng(n_tok)
  h = rng.normal(size=(2, n_tok, 8)).astype(np.float32)
  w = rng.normal(size=(8, 11)).astype(np.float32)
  tgt = rng.integers(0, 11, size=(2, n_tok))
  wts = (rng.random((2, n_tok)) > 0.3).astype(np.float32) * rng.uniform(0.5, 2, (2, n_tok)).astype(np.float32)
  f = lambda hh, ww, wt: cross_entropy(hh, ww, jnp.asarray(tgt), wt, chunk_size=chunk)
  loss, count = f(jnp.asarray(h), jnp.asarray(w), jnp.asarray(wts))
  logits = h.astype(np.float64) @ w
  lse = np.log(np.exp(logits).sum(-1))
  tok = lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), (tok * wts).sum(), rtol=1e-5)
  np.testing.assert_allclose(float(count), wts.sum(), rtol=1e-6)
  gh, gw, gwt = jax.grad(lambda *a: f(*a)[0], argnums=(0, 1, 2))(jnp.asarray(h), jnp.asarray(w), jnp.asarray(wts))
  p = np.exp(logits - lse[..., None])
  p[np.arange(2)[:, None], np.arange(n_tok)[None], tgt] -= 1
  dl = p * wts[..., None]
  np.testing.assert_allclose(np.asarray(gh), dl @ w.T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gw), np.einsum("btd,btv->dv", h, dl), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gwt), tok, rtol=1e-4, atol=1e-5)
  # bf16 hidden states with a float32 head: bf16 matmul operands, float32 loss and head gradient.
  hb = jnp.asarray(h, jnp.bfloat16)
  lb = f(hb, jnp.asarray(w), jnp.asarray(wts))[0]
  gh_b, gw_b = jax.grad(lambda *a: f(*a, jnp.asarray(wts))[0], argnums=(0, 1))(hb, jnp.asarray(w))
  assert lb.dtype == jnp.float32 and gh_b.dtype == jnp.bfloat16 and gw_b.dtype == jnp.float32
  np.testing.assert_allclose(float(lb), (tok * wts).sum(), rtol=2e-2)
  rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
  assert rel(gh_b, dl @ w.T) < 3e-2 and rel(gw_b, np.einsum("btd,btv->dv", h, dl)) < 3e-2


@pytest.mark.parametrize("n_tok,chunk", [(9, 4), (1, 4)])
def test_cross_entropy_bf16_logits(n_tok, chunk):
  """Logits stored in bf16: the loss and the gradients are those of the rounded logits (float64
  NumPy on the bf16-rounded float32 products), and differ from the float32 path's by about the
  rounding."""
  rng = np.random.default_rng(10 + n_tok)
  h = rng.normal(size=(2, n_tok, 16)).astype(np.float32)
  w = (3 * rng.normal(size=(16, 37))).astype(np.float32)  # logits up to ~40: bf16 steps of 0.25
  tgt = rng.integers(0, 37, size=(2, n_tok))
  wts = rng.uniform(0.5, 2, (2, n_tok)).astype(np.float32)
  f = lambda hh, ww, dt: cross_entropy(hh, ww, jnp.asarray(tgt), jnp.asarray(wts), chunk_size=chunk,
                                       logits_dtype=dt)[0]
  loss, (gh, gw) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w), jnp.bfloat16)
  assert loss.dtype == jnp.float32 and gh.dtype == jnp.float32
  exact = h.astype(np.float64) @ w
  logits = np.asarray(jnp.asarray(exact.astype(np.float32), jnp.bfloat16), np.float64)
  assert np.abs(logits - exact).max() > 1e-2  # the rounding is visible at this scale
  lse = np.log(np.exp(logits).sum(-1))
  tok = lse - np.take_along_axis(logits, tgt[..., None], -1)[..., 0]
  np.testing.assert_allclose(float(loss), (tok * wts).sum(), rtol=1e-5)
  p = np.exp(logits - lse[..., None])
  p[np.arange(2)[:, None], np.arange(n_tok)[None], tgt] -= 1
  dl = p * wts[..., None]
  np.testing.assert_allclose(np.asarray(gh), dl @ w.T, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(gw), np.einsum("btd,btv->dv", h, dl), rtol=1e-4, atol=1e-4)
  loss32 = f(jnp.asarray(h), jnp.asarray(w), None)
  assert 0 < abs(float(loss32) - float(loss)) < 0.05 * float(loss32)


@pytest.mark.slow
def test_float64_model_chunked_equals_naive():
  """In float64 the chunked KDA path and the token recurrence agree to 1e-10 through the whole
  model, so parity checks against other implementations can be made at that precision."""
  with jax.enable_x64(True):
    cfg = tiny_config(*SMALL, "model.param_dtype=float64", "model.compute_dtype=float64",
                      "model.kda.implementation=chunked")
    m = K3Model(cfg.model, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (2, 40), 0, 256)
    seg = jnp.asarray([[1] * 25 + [2] * 15, [1] * 40])
    a = jax.jit(lambda m, x: m(x, segment_ids=seg))(m, ids)
    assert a.dtype == jnp.float64
    for layer in m.layers:
      if layer.kind == "kda":
        layer.self_attn.cfg = tiny_config(*SMALL, "model.param_dtype=float64", "model.compute_dtype=float64",
                                          "model.kda.implementation=naive").model
    b = jax.jit(lambda m, x: m(x, segment_ids=seg))(m, ids)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_tiny_model_loss_falls_with_adamw():
  cfg = tiny_config(*SMALL)
  model = K3Model(cfg.model, rngs=nnx.Rngs(0))
  text = np.frombuffer((open(np.__file__).read() * 4).encode()[:2 * 65], np.uint8).astype(np.int32)
  batch = text.reshape(2, 65)
  inputs, targets = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optax.adamw(3e-3)
  opt_state = opt.init(params)

  @jax.jit
  def step(params, opt_state):
    def loss_fn(p):
      m = nnx.merge(graphdef, p, rest)
      h, _ = m.hidden(inputs)
      s, n = cross_entropy(h, m.lm_head.kernel[...], targets, jnp.ones_like(targets, jnp.float32))
      return s / n
    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  losses = []
  for _ in range(50):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert np.isfinite(losses).all()
  assert losses[-1] < 0.5 * losses[0], losses


def _kernel_counts(jaxpr) -> dict:
  """Kernel names and how often they appear in a jaxpr (nested jaxprs included): pallas_call
  names, and ``"mosaic_gpu"`` for every Mosaic GPU kernel (an ``mpmd_map``)."""
  from jax.extend import core
  counts: dict = {}

  def walk(j):
    for e in j.eqns:
      name = None
      if e.primitive.name == "pallas_call":
        info = e.params.get("name_and_src_info")
        name = getattr(info, "name", None) or e.params.get("name") or "?"
      elif e.primitive.name == "mpmd_map":
        name = "mosaic_gpu"
      if name:
        counts[name] = counts.get(name, 0) + 1
      for v in e.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
          if isinstance(x, core.ClosedJaxpr):
            walk(x.jaxpr)
          elif isinstance(x, core.Jaxpr):
            walk(x)

  walk(jaxpr)
  return counts


def _grad_kernel_counts(cfg):
  """Pallas kernel name -> calls in the traced gradient of the loss of ``cfg``'s model (shapes
  only: nothing is lowered or run)."""
  from k3jax.latent_moe import RouterBias
  from k3jax.train_state import abstract_model
  from k3jax.train_step import _loss
  graphdef, params, biases = nnx.split(abstract_model(cfg), nnx.Param, RouterBias)
  params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
  batch = {k: jax.ShapeDtypeStruct((1, 64), jnp.float32 if k == "weights" else jnp.int32)
           for k in ("input_ids", "targets", "segment_ids", "positions", "weights")}
  # the biases are traced too: a layer outside a remat reads them directly
  grad = lambda p, bias, b: jax.grad(lambda p: _loss(graphdef, p, bias, b)[0])(p)
  jaxpr = jax.make_jaxpr(grad)(params, biases, batch)
  return _kernel_counts(jaxpr.jaxpr)


@pytest.mark.slow
@pytest.mark.parametrize("remat, save, runs", [("dots", False, 3), ("dots_kernels", False, 2),
                                               ("dots", True, 2), ("dots_kernels", True, 1)])
def test_remat_dots_kernels_keeps_kernel_outputs(h200_lowering, remat, save, runs):
  """Under ``remat: dots`` the gradient runs each KDA forward kernel three times per layer
  (forward, layer recompute, the kernel's own backward recompute); ``dots_kernels`` keeps the
  Pallas outputs, so the layer recompute does not rerun them; with the kernel's residuals saved
  (``model.kda.save_residuals``) its backward does not either. Traced for the GPU kernels (no lowering,
  no GPU)."""
  cfg = tiny_config("model.kda.implementation=pallas_gpu", f"model.remat={remat}",
                    f"model.kda.save_residuals={save}")
  counts = _grad_kernel_counts(cfg)
  n_kda = sum(cfg.model.layer_kind(i) == "kda" for i in range(cfg.model.num_layers))
  assert counts["kda_chunk_a"] == runs * n_kda and counts["kda_fwd_recurrence"] == runs * n_kda
  assert counts["kda_chunk_dqkg"] == n_kda  # one backward per layer either way


@pytest.mark.slow
def test_remat_skip_runs_the_last_layers_without_remat(h200_lowering):
  """``model.remat_skip``: the last layers keep their activations, so the gradient runs their
  KDA forward kernels twice (forward, the kernel's backward recompute) where the remat layers
  run them three times (and a layer recompute). Traced for the GPU kernels (no lowering)."""
  base = ("model.kda.implementation=pallas_gpu", "model.remat=dots",
          "model.kda.save_residuals=false")
  cfg = tiny_config(*base, "model.remat_skip=3")
  m = cfg.model
  kda = [i for i in range(m.num_layers) if m.layer_kind(i) == "kda"]
  assert [m.is_remat(i) for i in range(m.num_layers)] == [True, True, False, False, False]
  runs = sum(3 if m.is_remat(i) else 2 for i in kda)
  assert 2 * len(kda) < runs < 3 * len(kda)  # both kinds among the KDA layers
  assert _grad_kernel_counts(cfg)["kda_chunk_a"] == runs
  for skip in (0, m.num_layers):
    every = _grad_kernel_counts(tiny_config(*base, f"model.remat_skip={skip}"))
    assert every["kda_chunk_a"] == (2 if skip else 3) * len(kda)


@pytest.mark.slow
@pytest.mark.parametrize("remat,runs", [("dots", 8), ("dots_kernels", 6)])
def test_remat_dots_kernels_keeps_the_grouped_matmuls(monkeypatch, remat, runs):
  """The routed experts' Mosaic GPU grouped matmuls per MoE layer in the gradient: two forward,
  two for the lhs cotangents and two for the weights'; under ``dots`` the two forward ones run
  again in the layer recompute, under ``dots_kernels`` their named outputs are kept (no
  primitive policy sees a Mosaic GPU kernel). The token expansion's gather kernel runs twice
  under both: its output is recomputed, not kept. Traced for the GPU (no lowering, no GPU)."""
  from pallas_kernels.moe.permute_gpu import EXPAND_KERNEL
  import pallas_kernels.moe as moe_ops
  from pallas_kernels.moe import gpu
  monkeypatch.setattr(gpu, "default_backend", lambda: "gpu")  # no interpret-mode callbacks
  monkeypatch.setattr(moe_ops, "resolve", lambda implementation: "pallas_gpu")
  cfg = tiny_config(f"model.remat={remat}", "model.compute_dtype=bfloat16",
                    "model.moe.expert_intermediate=128")
  counts = _grad_kernel_counts(cfg)
  n_moe = sum(cfg.model.is_moe(i) for i in range(cfg.model.num_layers))
  assert counts["mosaic_gpu"] == runs * n_moe
  assert counts[EXPAND_KERNEL] == 2 * n_moe


@pytest.mark.slow
@pytest.mark.parametrize("remat,runs", [("dots", 2), ("dots_kernels", 1)])
def test_remat_dots_kernels_keeps_the_expert_activation(monkeypatch, remat, runs):
  """The routed experts' packed GLU kernel runs once per MoE layer in the gradient under
  ``dots_kernels`` (its output kept), twice under ``dots`` (recomputed). Traced, no GPU."""
  import pallas_kernels.glu as glu_ops
  from pallas_kernels.glu import gpu
  monkeypatch.setattr(gpu, "_interpret", lambda: False)
  monkeypatch.setattr(glu_ops, "resolve", lambda implementation: "pallas_gpu")
  cfg = tiny_config(f"model.remat={remat}")
  counts = _grad_kernel_counts(cfg)
  n_moe = sum(cfg.model.is_moe(i) for i in range(cfg.model.num_layers))
  assert counts["glu_fwd"] == runs * n_moe and counts["glu_bwd"] == n_moe


@pytest.mark.slow
def test_layer_grad_barrier_keeps_the_gradients():
  """``model.layer_grad_barrier`` only orders the backward: one ``optimization_barrier`` per
  decoder layer in the gradient, and the same loss and gradients as without it. Either way each
  MoE layer's output waits for its balancing statistics (a barrier, and its transpose)."""
  from k3jax.latent_moe import RouterBias
  from k3jax.train_step import _loss
  rng = np.random.default_rng(7)
  b, t = 2, 24
  batch = {"input_ids": rng.integers(0, 200, (b, t)), "targets": rng.integers(0, 200, (b, t)),
           "segment_ids": np.repeat([[1] * 10 + [2] * 14], b, 0),
           "positions": np.tile(np.r_[np.arange(10), np.arange(14)], (b, 1)),
           "weights": rng.uniform(0.5, 1.0, (b, t))}
  batch = {k: jnp.asarray(v, jnp.float32 if k == "weights" else jnp.int32)
           for k, v in batch.items()}
  out, count = {}, {}
  for on in (True, False):
    cfg = tiny_config(*SMALL, f"model.layer_grad_barrier={on}")
    graphdef, params, biases = nnx.split(K3Model(cfg.model, rngs=nnx.Rngs(0)), nnx.Param,
                                         RouterBias)
    params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
    grad = jax.value_and_grad(lambda p: _loss(graphdef, p, biases, batch)[0])
    jaxpr = jax.make_jaxpr(grad)(params)
    out[on] = jax.jit(grad)(params)
    count[on] = str(jaxpr).count("optimization_barrier")
  # one per layer; and either way each MoE layer's balancing statistics leave with its output
  # (one barrier in the forward, its transpose in the backward)
  n_moe = sum(cfg.model.is_moe(i) for i in range(cfg.model.num_layers))
  assert count[False] == 2 * n_moe > 0, count
  assert count[True] - count[False] == cfg.model.num_layers, count
  (l1, g1), (l0, g0) = out[True], out[False]
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)
