"""The Mosaic GPU ``kda_chunk_a`` (``pallas_kernels.kda.a_mgpu``, ``KdaGpuConfig.chunk_a``): in
GPU interpret mode on CPU its outputs against a float64 NumPy loop (both gates, segments, odd T,
every reference block size, the unbounded gates' redo flags), the op through the shared KDA
cases with it on (values and every gradient against float64), the choice of kernel, and its
CUDA lowering."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_cases import CASES, check
from kda_numpy import preprocess
from numerics import max_rel_err
from pallas_kernels.kda import a_mgpu, chunk_dense, config, kda

C = a_mgpu.CHUNK
NAMES = ("pkk", "aqk", "qg", "kd", "kg", "gc", "rq", "rk")
# the shared cases at 64-token chunks (over ~5 s each on 2 CPUs: slow)
SLOW = ("bounded_chunk64_K128_T100", "softplus_subchunks_chunk64_K128_T77",
        "unfused_subchunks_chunk64_T83")
MOSAIC = [pytest.param(c, marks=pytest.mark.slow) if c.name in SLOW else c for c in CASES
          if c.name in SLOW + ("bounded_chunk64_K64_T1", "bounded_unfused_l2_chunk64_T70")]


@pytest.fixture(autouse=True)
def _highest_precision():
  """float32 products in the XLA references (as ``test_kda_gpu.py``)."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.parametrize("case", MOSAIC, ids=lambda c: c.name)
def test_op_cases(case):
  """The op with ``chunk_a="mosaic"`` passes the shared cases' checks (float32 inputs: the
  kernel's TF32 products are exact float32 in interpret mode)."""
  tuning = dataclasses.replace(config.default_config(
      (1, case.t, case.hv, case.vd), use_qk_l2norm=case.fused, beta_is_logit=case.fused),
      chunk_a="mosaic")
  check(case, "pallas_gpu", config=tuning)


def _inputs(seed, dtype, t, h, hv, kd, cuts, wild, bsz=1):
  """q, k ``[B, Tp, H, K]``, raw g ``[B, Tp, HV, K]`` (zero after T, as the op pads them), A_log,
  dt_bias ``[HV, K]`` around -4 (slow decays: earlier segments of a chunk still count) and
  segment ids ``[B, Tp]`` (edge-padded); with ``wild`` a quarter of the channels of value head 0
  in the second chunk decay by ~10 per token, so only that chunk's middle-row exponents exceed
  MAX_EXP."""
  rng = np.random.default_rng(seed)
  tp = -(-t // C) * C
  n = lambda *s: rng.standard_normal(s)
  q, k, g = n(bsz, tp, h, kd), n(bsz, tp, h, kd), n(bsz, tp, hv, kd)
  if wild:
    g[0, C:, 0, :kd // 4] = 3 * g[0, C:, 0, :kd // 4] + 16.0
  for x in (q, k, g):
    x[:, t:] = 0.0
  seg = np.zeros((bsz, tp), np.int32)
  for cut in cuts:
    seg[:, cut:] += 1
  seg[:, t:] = seg[:, t - 1:t]
  cast = lambda x: jnp.asarray(x, jnp.float32).astype(dtype)
  return cast(q), cast(k), cast(g), jnp.asarray(0.5 * n(hv), jnp.float32), jnp.asarray(
      0.5 * n(hv, kd) - 4.0, jnp.float32), jnp.asarray(seg)


def _loop(cfg, q, k, g, A_log, dt_bias, seg, t, speculative_rows):
  """float64 (pkk, aqk, qg, kd, kg, gc, rq, rk) of ``chunk_dense.chunk_a`` by chunk, pair by pair
  (each exponent G_i - G_j formed on its own), and the chunks whose ``speculative_rows``-row
  middle-row references leave an exponent above MAX_EXP (flags ``[B, Tp, HV]``)."""
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  q, k, g, seg = f64(q), f64(k), f64(g), np.asarray(seg)
  _, tp, h, kd = q.shape
  hv = g.shape[2]
  sq = lambda x: 1 / np.sqrt((x * x).sum(-1) + 1e-6)
  rq, rk = (np.repeat(sq(x), hv // h, axis=2) if cfg.use_qk_l2norm else np.ones((1, tp, hv))
            for x in (q, k))
  q, k, g, _ = preprocess(q, k, g, np.zeros(1), hv=hv, l2=cfg.use_qk_l2norm, gate=cfg.gate,
                          A_log=f64(A_log), dt_bias=f64(dt_bias), lb=cfg.lower_bound,
                          beta_logit=False)
  g[:, t:] = 0.0
  out = dict(pkk=np.zeros((1, tp, hv, C)), aqk=np.zeros((1, tp, hv, C)), qg=np.zeros(g.shape),
             kd=np.zeros(g.shape), kg=np.zeros(g.shape), gc=np.zeros((1, tp // C, hv, kd)),
             rq=rq, rk=rk)
  redo = np.zeros((1, tp, hv))
  low = np.tril(np.ones((C, C), bool))
  for j in range(hv):
    for ci in range(tp // C):
      r = slice(ci * C, (ci + 1) * C)
      qc, kc, G = q[0, r, j * h // hv], k[0, r, j * h // hv], np.cumsum(g[0, r, j], axis=0)
      sg, prev = seg[0, r], seg[0, max(ci * C - 1, 0)]
      incl = low & (sg[:, None] == sg[None, :])
      decay = np.exp(np.where(low[:, :, None], G[:, None] - G[None, :], -np.inf))  # [C, C, K]
      out["pkk"][0, r, j] = np.where(incl & ~np.eye(C, dtype=bool),
                                     np.einsum("id,jd,ijd->ij", kc, kc, decay), 0.0)
      out["aqk"][0, r, j] = np.where(incl, cfg.scale * np.einsum("id,jd,ijd->ij", qc, kc, decay),
                                     0.0)
      out["qg"][0, r, j] = cfg.scale * (sg == prev)[:, None] * qc * np.exp(G)
      out["kd"][0, r, j] = (sg == sg[-1])[:, None] * kc * np.exp(G[-1] - G)
      out["kg"][0, r, j] = kc * np.exp(G)
      out["gc"][0, ci, j] = (sg[-1] == prev) * np.exp(G[-1])
      n = speculative_rows
      refs = np.repeat(G[n // 2 - 1::n], n, axis=0)
      redo[0, r, j] = np.abs(G - refs).max() > config.MAX_EXP
  return out, redo


# (dtype, gate, lower bound (reference blocks of 32, 16 and 64 rows), L2 norm fused, T, H, HV,
# K, segment starts, wild decays in one chunk, B): every gate, segments inside and at the edge of
# a chunk, odd T and T = 1, grouped values, one and two K slices; and the shape of
# benchmarks/kda.py's check (two batch rows, 3 segments, T = 600), whose op gave NaN on an H100
# with this kernel (issue 40): run on the card, this test names the outputs that differ
@pytest.mark.parametrize("dtype,gate,lb,fused,t,h,hv,kd,cuts,wild,bsz", [
    (jnp.float32, "bounded", -5.0, True, 100, 1, 2, 128, (30, 64, 65), False, 1),
    (jnp.bfloat16, "bounded", -8.0, True, 50, 1, 1, 64, (20,), False, 1),
    (jnp.float32, "bounded", -2.0, False, 1, 1, 1, 64, (), False, 1),
    (jnp.bfloat16, "softplus", -5.0, True, 77, 1, 2, 128, (30,), True, 1),
    # Not strict: its wild decays reach -1.7e9, whose float32 cumulative sums are rounded to
    # multiples of 128; on 2026-12-07's AMD EPYC host (interpret mode, the host's BLAS) the
    # chunk end's sum and the last real row's (equal in exact arithmetic: padding adds zeros)
    # came out 2 apart, so kd's last row was off by e^2. Issue 40's closing note of that day.
    pytest.param(jnp.float32, None, -5.0, False, 83, 2, 2, 64, (17, 40), True, 1,
                 marks=pytest.mark.xfail(strict=False, reason="float32 sums of -1e9 decays")),
    pytest.param(jnp.bfloat16, "bounded", -5.0, True, 600, 4, 4, 128, (250, 350), False, 2,
                 marks=pytest.mark.slow),
], ids=["f32_bounded_T100", "bf16_bounded_lb8", "f32_rows64_T1", "bf16_softplus_redo",
        "f32_given_g_redo", "bf16_check_shape_B2_T600"])
def test_matches_float64(dtype, gate, lb, fused, t, h, hv, kd, cuts, wild, bsz):
  q, k, g, A_log, dt_bias, seg = _inputs(kd + t, dtype, t, h, hv, kd, cuts, wild, bsz)
  if gate is None:  # g is the log decay itself
    g = (-jnp.exp(g.astype(jnp.float32) - 4.0)).astype(dtype)
  tuning = config.KdaGpuConfig(chunk_a="mosaic")
  rows, sub = config.chunk_path(gate, lb, C, tuning)
  cfg = config.KdaOptions(scale=kd ** -0.5, chunk=C, use_qk_l2norm=fused, gate=gate,
                          lower_bound=lb, beta_is_logit=False, diag_rows=rows, sub_chunks=sub,
                          dtype=jnp.dtype(dtype).name, tuning=tuning)
  assert a_mgpu.supported(cfg, q, k, g)
  v = jnp.zeros(g.shape[:3] + (16,), dtype)
  got = chunk_dense.chunk_a(cfg, q, k, v, g, jnp.zeros(g.shape[:3]), A_log, dt_bias, seg, t)
  rows_b = [_loop(cfg, *(x[i:i + 1] for x in (q, k, g)), A_log, dt_bias, seg[i:i + 1], t, rows)
            for i in range(bsz)]  # (the loop takes one batch row)
  want = {name: np.concatenate([w[name] for w, _ in rows_b]) for name in NAMES}
  redo = np.concatenate([r for _, r in rows_b])
  tol = 1e-4 if dtype == jnp.float32 else 1.2e-2  # bf16 operands and results
  errs = {name: (max_rel_err(np.asarray(x, np.float32), want[name]),
                 int(np.isnan(np.asarray(x, np.float32)).sum())) for name, x in zip(NAMES, got)}
  assert all(e < tol for e, _ in errs.values()), errs  # (error, NaN count) of every output
  if sub:
    assert wild == bool(redo.any())
    np.testing.assert_array_equal(np.asarray(got[-1]), redo)
  else:
    assert got[-1] is None


def test_the_op_takes_it_where_asked_and_supported(monkeypatch):
  """``chunk_dense.chunk_a`` takes the Mosaic kernel with ``chunk_a="mosaic"`` for 64-token
  chunks, K = 64 or 128 and q, k, g of the kernels' dtype, and with ``chunk_a="bounded"`` for the
  bounded gate's blocks only (not on sub-chunks); Triton's otherwise."""
  calls = []  # which kernel each call traced (spies on both)
  monkeypatch.setattr(a_mgpu, "chunk_a", lambda *a, **k: calls.append(1) or (None,) * 8)
  monkeypatch.setattr(chunk_dense, "call", lambda *a, **k: calls.append(0) or (None,) * 8)

  def run(kd=128, chunk=C, dtype=jnp.bfloat16, g_dtype=jnp.bfloat16, chunk_a="mosaic",
          sub_chunks=False):
    tok = lambda d, dt=dtype: jnp.zeros((1, 128, 2, d), dt)
    cfg = config.KdaOptions(scale=1.0, chunk=chunk, use_qk_l2norm=True, gate="bounded",
                            lower_bound=-5.0, beta_is_logit=True, diag_rows=32,
                            sub_chunks=sub_chunks, dtype=jnp.dtype(dtype).name,
                            tuning=config.KdaGpuConfig(chunk_a=chunk_a))
    chunk_dense.chunk_a(cfg, tok(kd), tok(kd), tok(64), tok(kd, g_dtype), tok(1)[..., 0],
                        jnp.zeros(2), jnp.zeros((2, kd)), jnp.zeros((1, 128), jnp.int32), 100)

  run()
  run(kd=64, dtype=jnp.float32, g_dtype=jnp.float32)
  run(kd=256)
  run(chunk=32)
  run(g_dtype=jnp.float32)
  run(chunk_a="triton")
  run(chunk_a="bounded")
  with pytest.raises(AttributeError):  # the spy's outputs go no further than the kernel choice
    run(chunk_a="bounded", sub_chunks=True)
  assert calls == [1, 1, 0, 0, 0, 0, 1, 0]
  with pytest.raises(ValueError, match="chunk_a"):
    config.KdaGpuConfig(chunk_a="cuda")


# (gate, shape [B, T, H, K], dtype) of the CUDA lowering tests of the Mosaic chunk kernels: the
# benchmark shape for both gates (inputs as shapes only) and float32 operands
LOWERINGS = pytest.mark.parametrize("gate, shape, dtype", [
    ("bounded", (1, 16384, 32, 128), jnp.bfloat16), ("softplus", (1, 16384, 32, 128), jnp.bfloat16),
    (None, (2, 100, 2, 64), jnp.float32)], ids=["bounded_benchmark", "softplus_benchmark", "f32"])


def lowered(gate, shape, dtype, **changes) -> str:
  """The op's forward and backward lowered for an H200 (under the ``h200_lowering`` fixture) as
  text, at ``shape`` [B, T, H, K] with the Hopper default tuning and ``changes``."""
  b, t, h, kd = shape
  hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0", core_count=132)
  tuning = dataclasses.replace(config.default_config(
      (b, t, h, kd), use_qk_l2norm=True, beta_is_logit=True, device=hopper), **changes)

  def loss(q, k, v, g, beta):
    o, _ = kda(q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.zeros(h),
               dt_bias=jnp.zeros(h * kd), gate=gate, beta_is_logit=True,
               implementation="pallas_gpu", config=tuning)
    return jnp.sum(o.astype(jnp.float32))

  args = [jax.ShapeDtypeStruct((b, t, h, kd), dtype)] * 4 + [
      jax.ShapeDtypeStruct((b, t, h), dtype)]
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()


@LOWERINGS
def test_lowers_for_cuda(h200_lowering, gate, shape, dtype):
  """The op's forward and backward with ``chunk_a="mosaic"`` lower for an H200 on the CPU
  (layout inference, register operands, SMEM) with the Mosaic kernel in place of Triton's
  kda_chunk_a, at the benchmark shape for both gates (inputs as shapes only) and for float32
  operands; the unbounded gates keep kda_chunk_a_sub behind it."""
  text = lowered(gate, shape, dtype, chunk_a="mosaic")
  assert "kda_chunk_a_mgpu" in text
  assert 'name = "kda_chunk_a"' not in text
  assert ('name = "kda_chunk_a_sub"' in text) == (gate != "bounded")
