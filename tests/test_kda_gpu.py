"""What only the Pallas GPU KDA kernels have (interpret mode on CPU): their tuning's variants
against float64, the saved residuals, bf16 accuracy, the dense path's helpers, shared memory and
the CUDA lowering. Values and gradients on the shared cases: ``test_kda_backends.py``."""

import dataclasses

import chex
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kda_cases import CASES, Case, check, inputs, run
from numerics import rel_err
from pallas_kernels.kda import chunk_dense, config, kda, recurrence


@pytest.fixture(autouse=True)
def _highest_precision():
  """float32 products in the XLA references, for this file's tests only (set for the whole
  process, it made the Mosaic TPU kernels of tests run after these ask for fp32 products of
  bf16 operands, which Mosaic rejects)."""
  with jax.default_matmul_precision("highest"):
    yield


def _tuning(case, **changes):
  """The default tuning for ``case`` with ``changes``."""
  return dataclasses.replace(config.default_config(
      (1, case.t, case.hv, case.vd), use_qk_l2norm=case.fused, beta_is_logit=case.fused),
      **changes)


CUMSUM_CASES = [c for c in CASES if c.name in ("bounded_chunk64_K128_T100",
                                                "bounded_saturated_chunk64")]


@pytest.mark.parametrize("case", CUMSUM_CASES, ids=lambda c: c.name)
def test_cumsum_option(case):
  """kda_chunk_dqkg with the gate's cumulative sum the other way from its default
  (``KdaGpuConfig.dqkg_dot_cumsum``: a scan instead of matrix-unit products) passes the same
  checks, including the saturated gate whose dg sums terms e^80 apart."""
  check(case, "pallas_gpu",
        config=_tuning(case, dqkg_dot_cumsum=not config.KdaGpuConfig().dqkg_dot_cumsum))


def test_dot_cumsum_matches_float64():
  """``chunk_dense.dot_cumsum`` (three bf16 parts) against a float64 cumulative sum: float32
  accuracy on gates in (-5, 0), where one bf16 part alone is off by ~1e-2."""
  g = -5 * np.random.default_rng(4).random((64, 32)).astype(np.float32)
  want = np.cumsum(g.astype(np.float64), axis=0)
  got = np.asarray(chunk_dense.dot_cumsum(jnp.asarray(g)), np.float64)
  assert np.max(np.abs(got - want)) < 1e-4, np.max(np.abs(got - want))


def test_bad_head_dim_is_rejected():
  x, _, _ = inputs(Case("bad", 8, 1, 1, 24, 16, 64, None, False))
  with pytest.raises(ValueError, match="powers of two"):
    kda(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")), implementation="pallas_gpu")


@pytest.mark.parametrize("shape, cumsum_dot, gate", [((1, 100, 2, 128), True, "bounded"),
                                                     ((1, 16384, 32, 128), True, "bounded"),
                                                     ((1, 100, 2, 128), False, "bounded"),
                                                     ((1, 100, 2, 128), True, "softplus"),
                                                     ((1, 100, 2, 128), True, None)],
                         ids=["T100", "benchmark_T16384_H32", "T100_cumsum_scan",
                              "T100_softplus", "T100_precomputed_g"])
def test_dense_path_lowers_for_cuda(h200_lowering, shape, cumsum_dot, gate):
  """The dense path's kernels (forward and backward, bf16, K=128, two K slices) lower through
  Pallas' Triton path for an H200 without a GPU (catches lowering errors on CPU), also at the
  benchmark shape (inputs as shapes only), with the scan's cumulative sum in kda_chunk_dqkg
  (``KdaGpuConfig.dqkg_dot_cumsum``) and for the unbounded gates' sub-chunks."""
  b, t, h, kd = shape
  tuning = dataclasses.replace(
      config.default_config((b, t, h, kd), use_qk_l2norm=True, beta_is_logit=True),
      dqkg_dot_cumsum=cumsum_dot)

  def loss(q, k, v, g, beta):
    o, _ = kda(q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.zeros(h), dt_bias=jnp.zeros(h * kd),
               gate=gate, beta_is_logit=True, implementation="pallas_gpu", config=tuning)
    return jnp.sum(o.astype(jnp.float32))

  args = [jax.ShapeDtypeStruct((b, t, h, kd), jnp.bfloat16)] * 4 + [
      jax.ShapeDtypeStruct((b, t, h), jnp.bfloat16)]
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  names = ["kda_chunk_a", "kda_chunk_wu", "kda_chunk_dwy", "kda_chunk_dqkg",
           "kda_fwd_recurrence", "kda_bwd_recurrence"]
  for name in names + (["kda_chunk_a_sub", "kda_chunk_dqkg_sub"] if gate != "bounded" else []):
    assert f'name = "{name}"' in text, f"{name} is not a Triton call of the lowered module"


GENERAL_CASES = [c for c in CASES if c.name in ("unfused_segments_T37",
                                                 "softplus_large_decay_padded")]


@pytest.mark.parametrize("case", GENERAL_CASES, ids=lambda c: c.name)
def test_general_path_option(case):
  """The unbounded gates on the general path's kernels (``KdaGpuConfig.unbounded="general"``,
  the default being the dense kernels' sub-chunks) pass the same checks."""
  check(case, "pallas_gpu", config=_tuning(case, unbounded="general"))


def test_diag_rows():
  """Reference blocks of the dense path: the largest whose exponents stay within e^85."""
  diag_rows = config.diag_rows
  assert diag_rows("bounded", -5.0, 64) == 32  # K3: 16 * 5 = 80
  assert diag_rows("bounded", -2.0, 64) == 64
  assert diag_rows("bounded", -2.0, 32) == 32
  assert diag_rows("bounded", -8.0, 64) == 16
  assert diag_rows("bounded", -11.0, 64) == 0  # general path
  assert diag_rows("softplus", -5.0, 64) == 0
  tuning = config.KdaGpuConfig()
  assert config.chunk_path("bounded", -5.0, 64, tuning) == (32, False)
  # 32-row middle-row blocks first, 16-row sub-chunks where a chunk's gates exceed them
  for gate, lb in (("softplus", -5.0), (None, -5.0), ("bounded", -11.0)):
    assert config.chunk_path(gate, lb, 64, tuning) == (32, True)
  assert config.chunk_path("softplus", -5.0, 16, tuning) == (16, True)
  assert config.chunk_path("softplus", -5.0, 64, config.KdaGpuConfig(speculative_rows=64)) == (
      64, True)
  with pytest.raises(ValueError, match="speculative_rows"):
    config.KdaGpuConfig(speculative_rows=48)
  general = config.KdaGpuConfig(unbounded="general")
  assert config.chunk_path("softplus", -5.0, 64, general) == (0, False)
  with pytest.raises(ValueError, match="unbounded"):
    config.KdaGpuConfig(unbounded="clamp")


@pytest.mark.parametrize("case, unbounded", [(CASES[1], "general"), (CASES[1], "subchunk"),
                                             (CASES[3], "subchunk")],
                         ids=["softplus_general", "softplus_subchunks", "bounded_dense"])
def test_saved_residuals_give_the_same_gradients(case, unbounded):
  """``save_residuals`` (the backward reads the forward's chunk factors, states and V') gives
  bit for bit the gradients of recomputing them (general path, dense path's sub-chunks and
  middle-row blocks)."""
  x, seg, opts = inputs(case)
  wo = np.random.default_rng(1).standard_normal(x["v"].shape).astype(np.float32)
  tuning = _tuning(case, unbounded=unbounded)

  def grads(save):
    f = lambda y: jnp.sum(run("pallas_gpu", seg, opts, y, save_residuals=save,
                              config=tuning)[0] * wo)
    return jax.jit(jax.value_and_grad(f))({n: jnp.asarray(x[n]) for n in case.names()})

  (l0, g0), (l1, g1) = grads(False), grads(True)
  assert float(l0) == float(l1)
  chex.assert_trees_all_equal(g0, g1)


@pytest.mark.parametrize("gate, chunk_a", [("bounded", "triton"), ("softplus", "triton"),
                                           ("bounded", "mosaic"), ("softplus", "mosaic")])
def test_bf16_dense_path_matches_the_float32_recurrence(gate, chunk_a):
  """bf16 inputs on the dense path, as trained: the kernels' bf16 residuals (the chunk states,
  their gradients and dV', ``KdaGpuConfig.bf16_stores``) and kda_chunk_a's programs walking
  several chunks (``chunk_loop``: at least 4 per program, here all 4) keep outputs and every
  gradient within bf16 accuracy of the float32 recurrence on the same (bf16-rounded) inputs
  (relative error of the whole array), for K3's bounded gate and Kimi Linear's softplus gate
  (sub-chunks) alike, with kda_chunk_a in Triton or Mosaic GPU (``chunk_a``)."""
  case = Case("bf16", 256, 1, 1, 64, 32, 64, gate, True, (90, 91))
  x, seg, opts = inputs(case)
  tuning = _tuning(case, chunk_a=chunk_a)
  assert tuning.chunk_loop_of("kda_chunk_a")[0] >= 4 and "h" in tuning.bf16_stores
  low = {n: jnp.asarray(x[n], jnp.float32 if n in ("s0", "A_log", "dt_bias") else jnp.bfloat16)
         for n in case.names()}
  wo = jnp.asarray(np.random.default_rng(1).standard_normal(x["v"].shape), jnp.float32)

  def loss(impl):
    def f(y):
      o, s = run(impl, seg, opts, y)
      return jnp.sum(o.astype(jnp.float32) * wo) + 0.1 * jnp.sum(s), o
    return jax.jit(jax.value_and_grad(f, has_aux=True))

  (_, o), grads = loss("pallas_gpu")(low)
  (_, o_ref), ref = loss("naive")({n: a.astype(jnp.float32) for n, a in low.items()})
  rel = lambda a, b: rel_err(np.asarray(a.astype(jnp.float32)), b)
  assert rel(o, o_ref) < 1e-2
  # d A_log is one sum over every gate term of the head, whose large terms cancel: 3.1e-2 with
  # these residuals and with float32 ones (the others 3e-3 to 4e-3)
  for name in case.names():
    a, r = grads[name], ref[name]
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
  op = jax.jit(lambda q, k, v, g, beta, cfg: kda(
      q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.zeros(1), dt_bias=jnp.zeros(64),
      gate="bounded", beta_is_logit=True, implementation="pallas_gpu", config=cfg)[0],
      static_argnames="cfg")
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 4 + [
      jax.ShapeDtypeStruct(shape[:3], jnp.bfloat16)]
  warps = {}
  for cfg in (tuning, other, tuning):
    text = op.trace(*args, cfg=cfg).lower(lowering_platforms=("cuda",)).as_text()
    call = text[text.index('name = "kda_chunk_a"') - 400:text.index('name = "kda_chunk_a"') + 400]
    warps.setdefault(cfg, []).append([w for w in (2, 8) if f"num_warps = {w}" in call])
  assert warps == {tuning: [[8], [8]], other: [[2]]}
