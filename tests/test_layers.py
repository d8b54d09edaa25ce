"""RMSNorm, AttnRes, SiTU-GLU, short conv, routing and Quantile Balancing against NumPy."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import router
from k3jax.attn_res import AttnRes, attn_res
from k3jax.config import MoEConfig
from k3jax.glu import situ_glu
from k3jax.kda import short_conv


def _attn_res_np(srcs, proj, norm, eps=1e-5):
  """Float64 loop over tokens: softmax over sources of (norm * proj) . RMSNorm(v), mixed."""
  b_, t_, d = srcs[0].shape
  out = np.zeros((b_, t_, d))
  for b in range(b_):
    for t in range(t_):
      logits = np.array([np.dot(s[b, t] / np.sqrt(np.mean(s[b, t] ** 2) + eps), norm * proj)
                         for s in srcs])
      p = np.exp(logits - logits.max())
      p /= p.sum()
      out[b, t] = sum(pi * s[b, t] for pi, s in zip(p, srcs))
  return out


@pytest.mark.parametrize("shape,weighted", [((3, 5, 16), True), ((1, 7), False)])
def test_rms_norm_values_and_gradients_match_float64(shape, weighted):
  """The hand-written RMSNorm backward against a float64 NumPy forward and its derivative
  written out by finite differences, and in bfloat16 against autodiff of the plain formula;
  its residuals are x and the per-row scale, no float32 ``[..., d]`` copy."""
  from jax._src.ad_checkpoint import saved_residuals
  from k3jax.nn import rms_norm
  rng = np.random.default_rng(7)
  x = rng.normal(size=shape) * 2 + 0.5
  w = rng.normal(size=shape[-1]) if weighted else None
  dy = rng.normal(size=shape)
  eps = 1e-5

  def ref(x, w):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y

  with jax.enable_x64():
    y, vjp = jax.vjp(lambda a, b: rms_norm(a, b, eps), jnp.asarray(x),
                     None if w is None else jnp.asarray(w))
    np.testing.assert_allclose(y, ref(x, w), rtol=1e-12)
    dx, dw = vjp(jnp.asarray(dy))
  h = 1e-6
  num_dx = np.zeros_like(x)
  for idx in np.ndindex(*shape):
    e = np.zeros_like(x)
    e[idx] = h
    num_dx[idx] = np.sum((ref(x + e, w) - ref(x - e, w)) * dy) / (2 * h)
  np.testing.assert_allclose(dx, num_dx, rtol=1e-6, atol=1e-8)
  if weighted:
    e = np.eye(len(w)) * h
    num_dw = np.array([np.sum((ref(x, w + e[j]) - ref(x, w - e[j])) * dy) / (2 * h)
                       for j in range(len(w))])
    np.testing.assert_allclose(dw, num_dw, rtol=1e-6, atol=1e-8)
  else:
    assert dw is None

  xb = jnp.asarray(x, jnp.bfloat16)
  wf = None if w is None else jnp.asarray(w, jnp.float32)

  def plain(a, b):
    af = a.astype(jnp.float32)
    y = af * jax.lax.rsqrt(jnp.mean(af * af, axis=-1, keepdims=True) + eps)
    return (y if b is None else y * b).astype(a.dtype)

  got = jax.vjp(lambda a, b: rms_norm(a, b, eps), xb, wf)[1](jnp.asarray(dy, jnp.bfloat16))
  want = jax.vjp(plain, xb, wf)[1](jnp.asarray(dy, jnp.bfloat16))
  np.testing.assert_allclose(np.float32(got[0]), np.float32(want[0]), rtol=2e-2, atol=2e-2)
  if weighted:
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)
  # a row whose square sum overflows: the output saturates to 0 and the gradient is not finite,
  # as under autodiff (the train step's non-finite guard counts on it)
  big = jnp.full(shape, 1e30, jnp.float32)
  big_dy = jnp.full(shape, 1e30, jnp.float32)
  got = jax.vjp(lambda a: rms_norm(a, None, eps), big)[1](big_dy)[0]
  want = jax.vjp(lambda a: plain(a, None), big)[1](big_dy)[0]
  assert not np.isfinite(got).any() and not np.isfinite(want).any()
  res = [aval for aval, src in saved_residuals(lambda a, b: rms_norm(a, b, eps), xb, wf)
         if not src.startswith("from the argument")]
  assert [a.shape for a in res] == [(*shape[:-1], 1)], res


def test_attn_res_matches_numpy_and_zero_query_is_mean():
  rng = np.random.default_rng(0)
  srcs = [rng.normal(size=(2, 5, 16)) * (i + 1) for i in range(4)]
  proj, norm = rng.normal(size=16), rng.normal(size=16)
  got = np.asarray(attn_res([jnp.asarray(s, jnp.float32) for s in srcs], jnp.asarray(proj), jnp.asarray(norm), 1e-5))
  np.testing.assert_allclose(got, _attn_res_np(srcs, proj, norm), rtol=1e-5, atol=1e-5)
  mean = attn_res([jnp.asarray(s, jnp.float32) for s in srcs], jnp.zeros(16), jnp.asarray(norm), 1e-5)
  np.testing.assert_allclose(np.asarray(mean), np.mean(srcs, axis=0), rtol=1e-5, atol=1e-5)
  one = attn_res([jnp.asarray(srcs[0], jnp.bfloat16)], jnp.asarray(proj), jnp.asarray(norm), 1e-5)
  assert one.dtype == jnp.bfloat16  # a single source is itself


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
def test_attn_res_fold_mixes_as_the_two_parameters(impl):
  """AttnRes.fold (the serving layout: the query norm * proj as one float32 proj, norm None)
  against the float64 loop, before and after folding, with the XLA form and the kernels."""
  from flax import nnx
  rng = np.random.default_rng(2)
  srcs = [rng.normal(size=(2, 5, 16)) * (i + 1) for i in range(3)]
  proj, norm = rng.normal(size=16), rng.normal(size=16)
  res = AttnRes(16, 1e-5, rngs=nnx.Rngs(0), dtype=jnp.float32, implementation=impl)
  res.proj.value, res.norm.value = jnp.asarray(proj, jnp.float32), jnp.asarray(norm, jnp.float32)
  xs = [jnp.asarray(s, jnp.float32) for s in srcs]
  want = _attn_res_np(srcs, proj, norm)
  np.testing.assert_allclose(np.asarray(res(xs)), want, rtol=1e-5, atol=1e-5)
  res.fold()
  assert res.norm is None and res.proj.value.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(res(xs)), want, rtol=1e-5, atol=1e-5)


def test_attn_res_gradients_match_finite_differences():
  """Gradients of <out, r> wrt every source, proj and norm against central differences of the
  float64 loop (directional derivatives along random directions)."""
  rng = np.random.default_rng(1)
  srcs = [rng.normal(size=(2, 3, 8)) * (i + 1) for i in range(3)]
  proj, norm = rng.normal(size=8), rng.normal(size=8)
  r = rng.normal(size=(2, 3, 8))
  f = lambda ss, p, n: jnp.sum(attn_res(ss, p, n, 1e-5) * r)
  grads = jax.grad(f, argnums=(0, 1, 2))([jnp.asarray(s, jnp.float32) for s in srcs],
                                         jnp.asarray(proj, jnp.float32), jnp.asarray(norm, jnp.float32))
  args = (srcs, proj, norm)
  g_np = lambda ss, p, n: np.sum(_attn_res_np(ss, p, n) * r)
  for i, g in enumerate((*grads[0], grads[1], grads[2])):
    dirn = rng.normal(size=np.shape(g))
    h = 1e-5

    def at(step):
      a = [list(srcs), proj, norm]
      if i < len(srcs):
        a[0][i] = srcs[i] + step * dirn
      else:
        a[i - len(srcs) + 1] = args[i - len(srcs) + 1] + step * dirn
      return g_np(*a)

    fd = (at(h) - at(-h)) / (2 * h)
    np.testing.assert_allclose(float(np.sum(np.asarray(g) * dirn)), fd, rtol=2e-4, atol=2e-4)


def test_situ_glu_bounded_and_swiglu_near_origin():
  a = jnp.linspace(-1e4, 1e4, 1001)
  h = situ_glu(a[:, None], a[None, :])
  assert float(jnp.max(jnp.abs(h))) <= 100.0 + 1e-3
  x = jnp.linspace(-0.05, 0.05, 11)
  swiglu = jax.nn.silu(x)[:, None] * x[None, :]
  np.testing.assert_allclose(np.asarray(situ_glu(x[:, None], x[None, :])), np.asarray(swiglu), atol=1e-5)
  # the closed form itself
  a0, b0 = 3.0, -40.0
  want = 4 * np.tanh(a0 / 4) / (1 + np.exp(-a0)) * 25 * np.tanh(b0 / 25)
  np.testing.assert_allclose(float(situ_glu(jnp.float32(a0), jnp.float32(b0))), want, rtol=1e-5)


def test_situ_glu_values_and_gradients_match_float64():
  rng = np.random.default_rng(7)
  scale = np.array([1e-3, 0.3, 3.0, 30.0, 300.0])
  a = rng.normal(size=2000) * scale[rng.integers(0, 5, 2000)]
  b = rng.normal(size=2000) * scale[rng.integers(0, 5, 2000)]
  a[:4], b[:4] = [0.0, -0.0, 1e6, -1e6], [0.0, 5.0, -1e6, 1e6]
  g = rng.normal(size=2000)

  def closed(a, b):
    return 4 * np.tanh(a / 4) / (1 + np.exp(-np.clip(a, -700, 700))) * 25 * np.tanh(b / 25)

  eps = 1e-6
  for dtype, tol in ((jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)):
    aj, bj, gj = (jnp.asarray(v, dtype) for v in (a, b, g))
    ar, br, gr = (np.asarray(v, np.float64) for v in (aj, bj, gj))  # the rounded inputs
    want = closed(ar, br)
    want_da = (closed(ar + eps, br) - closed(ar - eps, br)) / (2 * eps) * gr
    want_db = (closed(ar, br + eps) - closed(ar, br - eps)) / (2 * eps) * gr
    y, vjp = jax.vjp(situ_glu, aj, bj)
    da, db = vjp(gj)
    assert y.dtype == dtype and da.dtype == dtype
    for got, ref in ((y, want), (da, want_da), (db, want_db)):
      np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=tol, atol=tol * 100)


def test_short_conv_matches_numpy_with_segments_and_tail():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 9, 3)).astype(np.float32)
  w = rng.normal(size=(4, 3)).astype(np.float32)
  seg = np.array([[1] * 4 + [2] * 5, [1] * 9])
  y, tail = short_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(seg))
  want = np.zeros_like(x)
  for b in range(2):
    for t in range(9):
      acc = np.zeros(3)
      for j in range(4):
        s = t - (3 - j)
        if s >= 0 and seg[b, s] == seg[b, t]:
          acc += w[j] * x[b, s]
      want[b, t] = acc / (1 + np.exp(-acc))
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(tail), x[:, -3:])
  # splitting the sequence and carrying the tail gives the same result
  y1, t1 = short_conv(jnp.asarray(x[:, :5]), jnp.asarray(w))
  y2, _ = short_conv(jnp.asarray(x[:, 5:]), jnp.asarray(w), tail=t1)
  full, _ = short_conv(jnp.asarray(x), jnp.asarray(w))
  np.testing.assert_allclose(np.concatenate([y1, y2], 1), np.asarray(full), rtol=1e-6, atol=1e-6)


def test_router_logits_float32_product_and_gradients_keep_x_narrow():
  """The router's ``wide_dot``: the float32 product of bf16 tokens and a float32 kernel and both
  gradients equal autodiff's of the widened product (and a float64 NumPy product), while its
  residuals hold x in bf16, not a float32 copy."""
  from jax._src.ad_checkpoint import saved_residuals
  from k3jax.latent_moe import wide_dot
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(37, 24)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(24, 5)) * 0.1, jnp.float32)
  g = jnp.asarray(rng.normal(size=(37, 5)), jnp.float32)
  plain = lambda a, b: jnp.dot(a.astype(jnp.float32), b)
  with jax.default_matmul_precision("highest"):
    y, vjp = jax.vjp(wide_dot, x, w)
    y0, vjp0 = jax.vjp(plain, x, w)
    (dx, dw), (dx0, dw0) = vjp(g), vjp0(g)
  assert y.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(y, np.float64(x) @ np.float64(w), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(y, y0)
  np.testing.assert_array_equal(np.float32(dx), np.float32(dx0))
  np.testing.assert_allclose(dw, np.float64(x).T @ np.float64(g), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, dw0, rtol=1e-6, atol=1e-6)
  res = [a for a, src in saved_residuals(wide_dot, x, w)]
  assert sorted((a.shape, a.dtype) for a in res) == sorted([((37, 24), jnp.bfloat16),
                                                            ((24, 5), jnp.float32)]), res


def test_router_bias_changes_selection_not_weights():
  cfg = MoEConfig(num_experts=8, top_k=2, routed_scaling_factor=2.5)
  scores = jax.nn.sigmoid(jax.random.normal(jax.random.key(0), (64, 8)))
  ids0, w0 = router.route(scores, jnp.zeros(8), cfg)
  bias = jnp.zeros(8).at[7].set(10.0)
  ids1, w1 = router.route(scores, bias, cfg)
  assert bool(jnp.all(jnp.any(ids1 == 7, axis=1)))  # the bias forces expert 7 in
  assert not bool(jnp.all(ids0 == ids1))
  # weights are the unbiased scores of the chosen experts, renormalised and scaled
  s = np.asarray(scores)
  for i in range(64):
    sel = s[i, np.asarray(ids1[i])]
    np.testing.assert_allclose(np.asarray(w1[i]), sel / sel.sum() * 2.5, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(w0.sum(1)), 2.5, rtol=1e-6)


def _skewed_scores(n, e, seed=0):
  key1, key2 = jax.random.split(jax.random.key(seed))
  skew = jnp.linspace(-1.0, 1.0, e)  # strongly preferred experts
  return jax.nn.sigmoid(jax.random.normal(key1, (n, e)) + skew)


@pytest.mark.slow
@pytest.mark.parametrize("experts, top_k", [(16, 4), (64, 8)])
def test_quantile_balancing_one_update(experts, top_k):
  """Four refinements on one batch balance it; one update per batch (the default) gets there
  over about five successive batches of the same skew, the bias carried as in training, to the
  batches' own noise (four refinements per batch do no better from then on)."""
  scores = _skewed_scores(8192, experts)
  bias = jnp.zeros(experts)

  # jitted (the same ratios as op by op, four times faster): every batch has one shape
  @functools.partial(jax.jit, static_argnums=0)
  def step(cfg, scores, bias):
    ids, _ = router.route(scores, bias, cfg)
    load = router.expert_load(ids, experts)
    return router.next_bias(cfg, bias, [{"bias_stat": router.bias_stat(scores, bias, ids, cfg),
                                         "load": load}]), load

  def update(cfg, scores, bias):
    new, load = step(cfg, scores, bias)
    assert abs(float(new.mean())) < 1e-5
    return new, float(load.max() / load.mean())

  refined = MoEConfig(num_experts=experts, top_k=top_k, balancing="quantile", balancing_iters=4)
  new, before = update(refined, scores, bias)
  assert before > 2.0  # skewed before
  assert update(refined, scores, new)[1] < 1.05
  cfg = MoEConfig(num_experts=experts, top_k=top_k, balancing="quantile")
  assert cfg.balancing_iters == 1
  ratios = []
  for seed in range(1, 9):  # 2.3-2.9, 1.11-1.17, then 1.02-1.06 from the sixth batch on
    batch = _skewed_scores(32768, experts, seed)
    bias, ratio = update(cfg, batch, bias)
    ratios.append(ratio)
  assert ratios[0] > 2.0 and 1.08 < ratios[1] < 1.3 and max(ratios[-3:]) < 1.07, ratios


def test_expert_load_counts_valid_slots():
  rng = np.random.default_rng(7)
  ids = rng.integers(0, 9, size=(37, 3)).astype(np.int32)
  valid = rng.random(37) > 0.3
  np.testing.assert_array_equal(router.expert_load(jnp.asarray(ids), 9),
                                np.bincount(ids.ravel(), minlength=9))
  np.testing.assert_array_equal(router.expert_load(jnp.asarray(ids), 9, jnp.asarray(valid)),
                                np.bincount(ids[valid].ravel(), minlength=9))


def test_quantile_exact_matches_numpy_and_ignores_padding():
  cfg = MoEConfig(num_experts=6, top_k=2, balancing_iters=1)
  scores = np.asarray(_skewed_scores(50, 6, seed=3), np.float64)
  bias = np.linspace(-0.2, 0.2, 6)
  valid = np.arange(50) < 41
  got = np.asarray(router.quantile_bias(jnp.asarray(scores, jnp.float32), jnp.asarray(bias, jnp.float32),
                                        cfg, jnp.asarray(valid)))
  s = scores[valid]
  q = int(np.floor(len(s) * 2 / 6))
  alpha = np.sort(s + bias, axis=1)[:, -3]
  want = np.array([-np.sort(s[:, j] - alpha)[::-1][q] for j in range(6)])
  np.testing.assert_allclose(got, want - want.mean(), atol=1e-5)


@pytest.mark.parametrize("n, e", [(1, 3), (7, 5), (513, 33)])
def test_kth_smallest_is_the_sorted_column_exactly(n, e):
  """The radix select behind exact QB equals np.sort's k-th row bit for bit: magnitudes from
  1e-30 to 1e20, both signs, ties (a constant column), zeros of both signs, +inf (padding)."""
  rng = np.random.default_rng(n)
  x = (rng.standard_normal((n, e)) * rng.choice([1e-30, 1e-3, 1.0, 1e20], (n, e))).astype(np.float32)
  x[rng.random((n, e)) < 0.2] = np.inf
  x[rng.random((n, e)) < 0.1] = 0.0
  x[:, 0] = 1.5
  select = jax.jit(router.kth_smallest)
  for k in sorted({0, n // 3, n - 1}):
    got = np.asarray(select(jnp.asarray(x), jnp.int32(k)))
    np.testing.assert_array_equal(got.view(np.uint32), np.sort(x, axis=0)[k].view(np.uint32))


def test_histogram_bias_within_one_bin_of_exact():
  cfg = MoEConfig(num_experts=16, top_k=4, balancing="quantile_hist", balancing_bins=1000)
  scores = _skewed_scores(2048, 16, seed=5)
  bias = jnp.linspace(-0.5, 0.5, 16)
  exact = router.quantile_bias(scores, bias, dataclasses.replace(cfg, balancing_iters=1))
  # two micro-batches' histograms sum to the whole batch's
  h = router.quantile_histogram(scores[:1024], bias, cfg) + router.quantile_histogram(scores[1024:], bias, cfg)
  np.testing.assert_array_equal(np.asarray(h), np.asarray(router.quantile_histogram(scores, bias, cfg)))
  approx = router.bias_from_histogram(h, bias, cfg)
  width = (float(bias.max() - bias.min()) + 2.0) / 1000
  assert float(jnp.max(jnp.abs(approx - exact))) <= width


def test_sign_baseline():
  cfg = MoEConfig(num_experts=4, top_k=1, balancing="sign", sign_update_rate=0.01)
  bias = jnp.zeros(4)
  load = jnp.array([10.0, 0.0, 5.0, 5.0])
  new = router.next_bias(cfg, bias, [{"bias_stat": load, "load": load}])
  np.testing.assert_allclose(np.asarray(new), [-0.01, 0.01, 0.0, 0.0])
