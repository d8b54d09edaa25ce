"""Pallas GPU chunked KDA (interpret mode on CPU) against an independent float64 NumPy loop and
reference.kda_naive: outputs, final state and gradients of every input."""

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kda_numpy import numpy_kda, preprocess
from numerics import rel_err
from pallas_kernels.kda import chunk_dense, config, kda, recurrence


@pytest.fixture(autouse=True)
def _highest_precision():
  """float32 products in the XLA references, for this file's tests only (set for the whole
  process, it made the Mosaic TPU kernels of tests run after these ask for fp32 products of
  bf16 operands, which Mosaic rejects)."""
  with jax.default_matmul_precision("highest"):
    yield


def np_kda(q, k, v, g, beta, s0, seg, *, scale, l2, gate, A_log, dt_bias, lb, beta_logit):
  """float64 token loop of SPEC section 2 with the optional pre-processing."""
  q, k, g, beta = preprocess(q, k, g, beta, hv=v.shape[2], l2=l2, gate=gate, A_log=A_log,
                             dt_bias=dt_bias, lb=lb, beta_logit=beta_logit)
  return numpy_kda(q, k, v, g, beta, scale, s0, seg)


def make(seed, b, t, h, hv, kd, vd):
  r = np.random.default_rng(seed)
  n = lambda *s: r.standard_normal(s).astype(np.float32)
  return dict(q=n(b, t, h, kd), k=n(b, t, h, kd), v=n(b, t, hv, vd), g=n(b, t, hv, kd),
              beta=n(b, t, hv), s0=n(b, hv, kd, vd), A_log=0.5 * n(hv), dt_bias=0.5 * n(hv * kd))


# (name, T, H, HV, K, V, chunk, gate, l2/beta-logit fused, segment boundaries)
CASES = [
    ("bounded_fused_segments_grouped", 40, 1, 2, 16, 32, 32, "bounded", True, (7, 27)),
    ("softplus_fused_short", 5, 1, 1, 32, 16, 16, "softplus", True, ()),
    ("unfused_segments_T37", 37, 2, 2, 16, 16, 16, None, False, (3, 16, 17)),
    # the dense (bounded-gate) path at the production chunk: 4 row blocks, two K slices
    ("bounded_chunk64_K128_T100", 100, 1, 2, 128, 32, 64, "bounded", True, (30, 64, 65)),
    ("bounded_chunk64_K64_T1", 1, 1, 1, 64, 16, 64, "bounded", True, ()),
    # the dense path's split kernels at a single 16-row block (T < 16) and with grouped heads,
    # segments and a partial last chunk at chunk 32
    ("bounded_chunk16_T9_segments", 9, 1, 1, 32, 16, 16, "bounded", True, (4,)),
    ("bounded_chunk32_grouped_T45", 45, 1, 2, 64, 16, 32, "bounded", True, (1, 31, 32)),
    # the dense path with q, k normalised and beta in (0, 1) by the caller (no fused L2 norm)
    ("bounded_unfused_l2_chunk64_T70", 70, 1, 1, 64, 16, 64, "bounded", False, (33,)),
    # optional (lower bound, shift of the raw gate, gradient tolerance, key similarity): the gate
    # near its lower bound (most steps below -4.5), so the 32-row reference blocks come near their
    # largest exponents (+-80); a lower bound of -8 takes 16-row blocks. The gate's gradients are
    # then sums of terms e^80 apart: float32 keeps them to ~1e-3 (the previous kernels, 16-row
    # blocks referenced at their start, failed this case on dg).
    ("bounded_saturated_chunk64", 80, 1, 1, 64, 16, 64, "bounded", True, (50,), -5.0, 4.0, 2e-3),
    ("bounded_lb8_chunk64", 70, 1, 1, 32, 16, 64, "bounded", True, (20,), -8.0, 3.0, 2e-3),
    # keys of cosine similarity ~0.98, gates near 0 and beta near 1: (I + diag(beta) A_kk) with
    # entries near 1 across the chunk, whose inverse the former nilpotent series lost to the
    # powers of A (~1e17 here)
    ("bounded_chunk64_similar_keys", 64, 1, 1, 64, 16, 64, "bounded", True, (), -5.0, -8.0, 2e-4,
     0.98),
]


def _setup(case):
  name, t, h, hv, kd, vd, chunk, gate, fused, cuts, *extra = case
  defaults = (-5.0, 0.0, 2e-4, 0.0)
  lb, shift, tol, cos = tuple(extra) + defaults[len(extra):]
  x = make(len(name), 1, t, h, hv, kd, vd)
  x["g"] += shift
  if cos:  # keys of cosine similarity about cos (after the L2 norm), beta near 1
    common = np.random.default_rng(7).standard_normal((1, 1, h, kd)).astype(np.float32)
    x["k"] = np.sqrt(cos) * common + np.sqrt(1 - cos) * x["k"]
    x["beta"] += 3
  if gate is None:  # g is the log decay
    x["g"] = -np.exp(x["g"] - 1.0)
  if not fused:  # beta in (0, 1), q/k pre-normalised
    x["beta"] = 1 / (1 + np.exp(-x["beta"]))
    x["q"], x["k"] = (y / np.linalg.norm(y, axis=-1, keepdims=True) for y in (x["q"], x["k"]))
  seg = np.zeros((1, t), np.int32)
  for c in cuts:
    seg[:, c:] += 1
  opts = dict(scale=kd ** -0.5, use_qk_l2norm=fused, gate=gate, lower_bound=lb,
              beta_is_logit=fused)
  return x, jnp.asarray(seg), opts, chunk, tol


def _run(impl, chunk, seg, opts, q, k, v, g, beta, s0, A_log, dt_bias, tuning=None):
  return kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, segment_ids=seg,
             A_log=A_log, dt_bias=dt_bias, chunk_size=chunk, implementation=impl, config=tuning,
             **opts)


def _tuning(v_shape, opts, **changes):
  """The default tuning for these shapes and options with ``changes``."""
  return dataclasses.replace(config.default_config(
      v_shape, use_qk_l2norm=opts["use_qk_l2norm"], beta_is_logit=opts["beta_is_logit"]),
      **changes)


ORDER = ("q", "k", "v", "g", "beta", "s0", "A_log", "dt_bias")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kda_pallas_gpu(case):
  _check_case(case)


CUMSUM_CASES = [c for c in CASES if c[0] in ("bounded_chunk64_K128_T100",
                                              "bounded_saturated_chunk64")]


@pytest.mark.parametrize("case", CUMSUM_CASES, ids=[c[0] for c in CUMSUM_CASES])
def test_cumsum_option(case):
  """kda_chunk_dqkg with the gate's cumulative sum the other way from its default
  (``KdaGpuConfig.dqkg_dot_cumsum``: a scan instead of matrix-unit products) passes the same
  checks, including the saturated gate whose dg sums terms e^80 apart."""
  _check_case(case, dqkg_dot_cumsum=not config.KdaGpuConfig().dqkg_dot_cumsum)


def test_dot_cumsum_matches_float64():
  """``chunk_dense.dot_cumsum`` (three bf16 parts) against a float64 cumulative sum: float32
  accuracy on gates in (-5, 0), where one bf16 part alone is off by ~1e-2."""
  g = -5 * np.random.default_rng(4).random((64, 32)).astype(np.float32)
  want = np.cumsum(g.astype(np.float64), axis=0)
  got = np.asarray(chunk_dense.dot_cumsum(jnp.asarray(g)), np.float64)
  assert np.max(np.abs(got - want)) < 1e-4, np.max(np.abs(got - want))


def _check_case(case, **changes):
  """Outputs, final state and every gradient of ``pallas_gpu`` (its default tuning with
  ``changes``) against the float64 loop, the naive recurrence and central differences."""
  x, seg, opts, chunk, tol = _setup(case)
  tuning = _tuning(x["v"].shape, opts, **changes) if changes else None
  args = tuple(jnp.asarray(x[n]) for n in ORDER)
  np_run = lambda y: np_kda(y["q"], y["k"], y["v"], y["g"], y["beta"], y["s0"], np.asarray(seg),
                            l2=opts["use_qk_l2norm"], gate=opts["gate"], A_log=y["A_log"],
                            dt_bias=y["dt_bias"], lb=opts["lower_bound"],
                            beta_logit=opts["beta_is_logit"],
                            scale=opts["scale"])
  o_np, s_np = np_run(x)
  wo = np.random.default_rng(1).standard_normal(o_np.shape)
  ws = np.random.default_rng(2).standard_normal(s_np.shape)

  def loss(impl):
    def f(*a):
      o, s = _run(impl, chunk, seg, opts, *a, tuning=tuning if impl == "pallas_gpu" else None)
      return jnp.sum(o * wo.astype(np.float32)) + jnp.sum(s * ws.astype(np.float32)), (o, s)
    return f

  n_args = 8 if opts["gate"] else 6  # A_log / dt_bias only exist with a fused gate
  (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss("pallas_gpu"), argnums=tuple(range(n_args)),
                                                  has_aux=True))(*args)
  np.testing.assert_allclose(o, o_np, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(s, s_np, rtol=1e-4, atol=1e-4)

  # gradients of every input against the naive recurrence (autodiff through a scan)
  ref = jax.jit(jax.grad(loss("naive"), argnums=tuple(range(n_args)), has_aux=True))(*args)[0]
  for name, a, r in zip(ORDER, grads, ref):
    np.testing.assert_allclose(a, r, rtol=tol, atol=tol * float(jnp.abs(r).max()),
                               err_msg=f"d{name}")

  # and a directional derivative against central differences of the float64 loop
  rng = np.random.default_rng(3)
  dirs = {n: rng.standard_normal(x[n].shape) for n in ORDER[:n_args]}
  def np_loss(eps):
    o_, s_ = np_run({n: x[n] + eps * dirs[n] if n in dirs else x[n] for n in ORDER})
    return (o_ * wo).sum() + (s_ * ws).sum()
  fd = (np_loss(1e-5) - np_loss(-1e-5)) / 2e-5
  ad = sum(float(jnp.sum(grads[i] * dirs[n])) for i, n in enumerate(ORDER[:n_args]))
  assert abs(ad - fd) <= 1e-3 * max(1.0, abs(fd)), (ad, fd)


def test_bad_head_dim_is_rejected():
  x = make(0, 1, 8, 1, 1, 24, 16)
  with pytest.raises(ValueError, match="powers of two"):
    kda(*(jnp.asarray(x[n]) for n in ORDER[:5]), implementation="pallas_gpu")


@pytest.mark.parametrize("shape, cumsum_dot", [((1, 100, 2, 128), True),
                                               ((1, 16384, 32, 128), True),
                                               ((1, 100, 2, 128), False)],
                         ids=["T100", "benchmark_T16384_H32", "T100_cumsum_scan"])
def test_dense_path_lowers_for_cuda(h200_lowering, shape, cumsum_dot):
  """The bounded-gate kernels (forward and backward, bf16, K=128, two K slices)
  lower through Pallas' Triton path for an H200 without a GPU (catches lowering errors on CPU),
  also at the benchmark shape (inputs as shapes only) and with the scan's cumulative sum in
  kda_chunk_dqkg (``KdaGpuConfig.dqkg_dot_cumsum``)."""
  b, t, h, kd = shape
  x = make(5, 1, 1, h, h, kd, kd)  # A_log, dt_bias; the rest only as shapes
  tuning = dataclasses.replace(
      config.default_config((b, t, h, kd), use_qk_l2norm=True, beta_is_logit=True),
      dqkg_dot_cumsum=cumsum_dot)

  def loss(q, k, v, g, beta):
    o, _ = kda(q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.asarray(x["A_log"]),
               dt_bias=jnp.asarray(x["dt_bias"]), gate="bounded", beta_is_logit=True,
               implementation="pallas_gpu", config=tuning)
    return jnp.sum(o.astype(jnp.float32))

  args = [jax.ShapeDtypeStruct((b, t, h, kd), jnp.bfloat16)] * 4 + [
      jax.ShapeDtypeStruct((b, t, h), jnp.bfloat16)]
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  for name in ("kda_chunk_a", "kda_chunk_wu", "kda_chunk_dwy", "kda_chunk_dqkg",
               "kda_fwd_recurrence", "kda_bwd_recurrence"):
    assert f'name = "{name}"' in text, f"{name} is not a Triton call of the lowered module"


def test_diag_rows():
  """Reference blocks of the dense path: the largest whose exponents stay within e^85."""
  diag_rows = config.diag_rows
  assert diag_rows("bounded", -5.0, 64) == 32  # K3: 16 * 5 = 80
  assert diag_rows("bounded", -2.0, 64) == 64
  assert diag_rows("bounded", -2.0, 32) == 32
  assert diag_rows("bounded", -8.0, 64) == 16
  assert diag_rows("bounded", -11.0, 64) == 0  # general path
  assert diag_rows("softplus", -5.0, 64) == 0


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[CASES[1][0], CASES[3][0]])
def test_saved_residuals_give_the_same_gradients(case):
  """``save_residuals`` (the backward reads the forward's chunk factors, states and V') gives
  bit for bit the gradients of recomputing them (general and dense paths)."""
  x, seg, opts, chunk, _ = _setup(case)
  args = tuple(jnp.asarray(x[n]) for n in ORDER)
  wo = np.random.default_rng(1).standard_normal(x["v"].shape).astype(np.float32)

  def grads(save):
    f = lambda *a: jnp.sum(_run("pallas_gpu", chunk, seg, dict(opts, save_residuals=save), *a)[0]
                           * wo)
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(8))))(*args)

  (l0, g0), (l1, g1) = grads(False), grads(True)
  assert float(l0) == float(l1)
  for name, a, b in zip(ORDER, g0, g1):
    np.testing.assert_array_equal(a, b, err_msg=f"d{name}")


def test_bf16_dense_path_matches_the_float32_recurrence():
  """bf16 inputs on the dense path, as trained: the kernels' bf16 residuals (the chunk states,
  their gradients and dV', ``KdaGpuConfig.bf16_stores``) and kda_chunk_a's programs walking
  several chunks (``chunk_loop``: at least 4 per program, here all 4) keep outputs and every
  gradient within bf16 accuracy of the float32 recurrence on the same (bf16-rounded) inputs
  (relative error of the whole array)."""
  case = ("bf16", 256, 1, 1, 64, 32, 64, "bounded", True, (90, 91))
  x, seg, opts, chunk, _ = _setup(case)
  tuning = _tuning(x["v"].shape, opts)
  assert tuning.chunk_loop_of("kda_chunk_a")[0] >= 4 and "h" in tuning.bf16_stores
  args = tuple(jnp.asarray(x[n]) for n in ORDER)
  low = tuple(a.astype(jnp.bfloat16) if n not in ("s0", "A_log", "dt_bias") else a
              for n, a in zip(ORDER, args))
  wo = jnp.asarray(np.random.default_rng(1).standard_normal(x["v"].shape), jnp.float32)

  def loss(impl):
    def f(*a):
      o, s = _run(impl, chunk, seg, opts, *a)
      return jnp.sum(o.astype(jnp.float32) * wo) + 0.1 * jnp.sum(s), o
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(8)), has_aux=True))

  (_, o), grads = loss("pallas_gpu")(*low)
  (_, o_ref), ref = loss("naive")(*(a.astype(jnp.float32) for a in low))
  rel = lambda a, b: rel_err(np.asarray(a.astype(jnp.float32)), b)
  assert rel(o, o_ref) < 1e-2
  # d A_log is one sum over every gate term of the head, whose large terms cancel: 3.1e-2 with
  # these residuals and with float32 ones (the others 3e-3 to 4e-3)
  for name, a, r in zip(ORDER, grads, ref):
    assert rel(a, r) < (6e-2 if name == "A_log" else 1e-2), (name, rel(a, r))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("kd, bv", [(64, 32), (128, 32), (128, 64), (256, 32)])
def test_pipeline_stages_fit_shared_memory(dtype, kd, bv):
  """The sequential passes' pipeline stages: as many as asked (3) for K3's bf16 K = 128, fewer
  where their buffers would exceed the H200's shared memory (float32 inputs, K = 256)."""
  tile = lambda d: jax.ShapeDtypeStruct((1, 64, 1, d), dtype)
  opts = config.KdaOptions(scale=1.0, chunk=64, use_qk_l2norm=True, gate="bounded",
                           lower_bound=-5.0, beta_is_logit=True, diag_rows=32, dtype="bfloat16")
  n = recurrence.recur_stages(opts, 64, kd, bv, tile(kd), tile(bv))
  per_stage = jnp.dtype(dtype).itemsize * 64 * (3 * kd + 64 + bv)
  assert n >= 1 and (n == 1 or n * per_stage + config.SMEM_OWN <= config.SMEM)
  if dtype == jnp.bfloat16 and kd <= 128:
    assert n == opts.tuning.recur_stages == 3
  if dtype == jnp.bfloat16 and (kd, bv) == (128, 32):
    # measured on the H200 (benchmarks/RESULTS.md, KDA runs 35-38): the forward recurrence at 4
    # stages asked for more shared memory than there is; 3 stages compiled and ran
    assert config.stages(4, per_stage) == 3


def test_changed_tuning_changes_the_traced_kernels(h200_lowering):
  """A tuning is a static argument JAX's caches key on: the same jitted function lowered at two
  tunings builds its kernels at each (here kda_chunk_a's warps), not the first one's twice."""
  shape = (1, 64, 1, 64)
  tuning = config.default_config(shape, use_qk_l2norm=True, beta_is_logit=True)
  other = dataclasses.replace(tuning, warps={"kda_chunk_a": 2})
  assert hash(other) != hash(tuning) and dict(other.warps)["kda_chunk_dqkg"] == 4
  x = make(0, *shape[:3], 1, 64, 64)
  op = jax.jit(lambda q, k, v, g, beta, cfg: kda(
      q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.asarray(x["A_log"]),
      dt_bias=jnp.asarray(x["dt_bias"]), gate="bounded", beta_is_logit=True,
      implementation="pallas_gpu", config=cfg)[0], static_argnames="cfg")
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 4 + [
      jax.ShapeDtypeStruct(shape[:3], jnp.bfloat16)]
  warps = {}
  for cfg in (tuning, other, tuning):
    text = op.trace(*args, cfg=cfg).lower(lowering_platforms=("cuda",)).as_text()
    call = text[text.index('name = "kda_chunk_a"') - 400:text.index('name = "kda_chunk_a"') + 400]
    warps.setdefault(cfg, []).append([w for w in (2, 8) if f"num_warps = {w}" in call])
  assert warps == {tuning: [[8], [8]], other: [[2]]}
