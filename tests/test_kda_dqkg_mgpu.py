"""The Mosaic GPU ``kda_chunk_dqkg`` (``pallas_kernels.kda.dqkg_mgpu``,
``KdaGpuConfig.chunk_dqkg``): in GPU interpret mode on CPU the op with it on through KDA cases it
takes (V = 64; both gates, segments, odd T and T = 1, initial states, grouped values, every
gradient including A_log and dt_bias, the unbounded gates' chunks redone on sub-chunks) against
float64, its bf16 gradients beside Triton's, the choice of kernel, and its CUDA lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_cases import Case, check, inputs, reference, run
from kda_cases import _weights as weights
from numerics import max_rel_err
from pallas_kernels.kda import chunk_dense, config, dqkg_mgpu
from test_kda_a_mgpu import LOWERINGS, lowered
from pallas_kernels.kda.chunk_ops import gpu_rounding

# KDA cases at 64-token chunks with V = 64 (the kernel's smallest V); over ~5 s each on 2 CPUs
CASES = [
    Case("bounded_chunk64_K64_V64_T1", 1, 1, 1, 64, 64, 64, "bounded", True),
    pytest.param(Case("bounded_chunk64_K128_V64_T100", 100, 1, 2, 128, 64, 64, "bounded", True,
                      (30, 64, 65)), marks=pytest.mark.slow),
    pytest.param(Case("bounded_unfused_chunk64_V64_T70", 70, 1, 1, 64, 64, 64, "bounded", False,
                      (33,), initial_state=False), marks=pytest.mark.slow),
    # a quarter of the channels decaying by ~1e2 per token: those chunks redone on sub-chunks
    pytest.param(Case("softplus_subchunks_chunk64_K128_V64_T77", 77, 1, 2, 128, 64, 64,
                      "softplus", True, (30, 64, 65), tol=1e-4, saturate=(30.0, 8.0),
                      slow_decay=True), marks=pytest.mark.slow),
    pytest.param(Case("unfused_subchunks_chunk64_V64_T83", 83, 1, 2, 64, 64, 64, None, False,
                      (17, 40)), marks=pytest.mark.slow),
]


@pytest.fixture(autouse=True)
def _highest_precision():
  """float32 products in the XLA references (as ``test_kda_gpu.py``)."""
  with jax.default_matmul_precision("highest"):
    yield


def _tuning(case, chunk_dqkg="mosaic"):
  return dataclasses.replace(config.default_config(
      (1, case.t, case.hv, case.vd), use_qk_l2norm=case.fused, beta_is_logit=case.fused),
      chunk_dqkg=chunk_dqkg)


@pytest.fixture
def spy(monkeypatch):
  """The number of times the Mosaic kernel was traced (``dqkg_mgpu.chunk_dqkg`` wrapped)."""
  calls = []
  inner = dqkg_mgpu.chunk_dqkg
  monkeypatch.setattr(dqkg_mgpu, "chunk_dqkg", lambda *a, **k: calls.append(1) or inner(*a, **k))
  return calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_op_cases(case, spy):
  """The op with ``chunk_dqkg="mosaic"`` passes the shared checks (values and every gradient
  against float64; float32 inputs: the kernel's products of three bf16 parts and TF32 products
  are float32 in interpret mode) with the Mosaic kernel in place of Triton's."""
  check(case, "pallas_gpu", config=_tuning(case))
  assert spy


@pytest.mark.slow
def test_bf16_gradients_as_triton(spy):
  """bf16 inputs with the matrix units' roundings emulated: every gradient with the Mosaic kernel
  is about as close to float64 (of the float32 inputs) as with Triton's."""
  case = Case("bf16_softplus_chunk64_K128_V128_T70", 70, 1, 1, 128, 128, 64, "softplus", True,
              (20, 64), slow_decay=True)
  x, seg, opts = inputs(case)
  _, _, want = reference(case)
  wo, ws = (jnp.asarray(w, jnp.float32) for w in weights(case))

  def grads(choice):
    def loss(y):
      y = {m: y[m].astype(jnp.bfloat16) if m in ("q", "k", "v", "g") else y[m] for m in y}
      o, s = run("pallas_gpu", seg, opts, y, config=_tuning(case, choice))
      return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(s * ws)
    with gpu_rounding():
      return jax.jit(jax.grad(loss))({m: jnp.asarray(x[m]) for m in case.names()})

  ours, theirs = grads("mosaic"), grads("triton")
  assert spy
  for name in case.names():
    err, base = max_rel_err(ours[name], want[name]), max_rel_err(theirs[name], want[name])
    assert err < 1.25 * base + 2e-3, (name, err, base)


def test_the_op_takes_it_where_asked_and_supported(monkeypatch):
  """``chunk_dense.chunk_dqkg`` takes the Mosaic kernel with ``chunk_dqkg="mosaic"`` for 64-token
  chunks, K and V of 64 or 128 and operands of the kernels' dtype, and with ``"bounded"`` for the
  bounded gate's blocks only (not on sub-chunks); Triton's otherwise."""
  calls = []  # which kernel each call traced (spies on both)
  monkeypatch.setattr(dqkg_mgpu, "chunk_dqkg", lambda *a, **k: calls.append(1) or (None,) * 3)
  monkeypatch.setattr(chunk_dense, "call", lambda *a, **k: calls.append(0) or (None,) * 3)

  def run_one(kd=128, vd=128, chunk=64, dtype=jnp.bfloat16, h_dtype=jnp.bfloat16,
              choice="mosaic", sub_chunks=False):
    tok = lambda d, dt=dtype: jnp.zeros((1, 128, 2, d), dt)
    cfg = config.KdaOptions(scale=1.0, chunk=chunk, use_qk_l2norm=True, gate="bounded",
                            lower_bound=-5.0, beta_is_logit=True, diag_rows=32,
                            sub_chunks=sub_chunks, dtype=jnp.dtype(dtype).name,
                            tuning=config.KdaGpuConfig(chunk_dqkg=choice))
    states = jnp.zeros((1, 128 // chunk, 2, kd, vd), h_dtype)
    chunk_dense.chunk_dqkg(cfg, tok(kd), tok(kd), tok(vd), tok(kd), tok(1)[..., 0], jnp.zeros(2),
                           jnp.zeros((2, kd)), jnp.zeros((1, 128), jnp.int32), states, states,
                           tok(vd), tok(vd), tok(kd), tok(chunk), tok(1)[..., 0],
                           tok(1)[..., 0], None, 100)

  run_one()
  run_one(kd=64, vd=64, dtype=jnp.float32, h_dtype=jnp.float32)
  run_one(kd=256)
  run_one(vd=32)
  run_one(chunk=32)
  run_one(h_dtype=jnp.float32)
  run_one(choice="triton")
  run_one(choice="bounded")
  run_one(choice="bounded", sub_chunks=True)
  assert calls == [1, 1, 0, 0, 0, 0, 0, 1, 0]
  with pytest.raises(ValueError, match="chunk_dqkg"):
    config.KdaGpuConfig(chunk_dqkg="cuda")


@LOWERINGS
def test_lowers_for_cuda(h200_lowering, gate, shape, dtype):
  """The op's backward with ``chunk_dqkg="mosaic"`` lowers for an H200 on the CPU (layout
  inference, register and transposed operands, SMEM) with the Mosaic kernel in place of
  Triton's kda_chunk_dqkg, at the benchmark shape for both gates and for float32 operands; the
  unbounded gates keep kda_chunk_dqkg_sub behind it."""
  text = lowered(gate, shape, dtype, chunk_dqkg="mosaic")
  assert "kda_chunk_dqkg_mgpu" in text
  assert 'name = "kda_chunk_dqkg"' not in text
  assert ('name = "kda_chunk_dqkg_sub"' in text) == (gate != "bounded")
