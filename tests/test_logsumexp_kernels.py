"""pallas_kernels.logsumexp (XLA's one-pass reduction and the Triton kernel in interpret mode)
against float64 NumPy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.logsumexp import gpu, logsumexp


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("shape", [(11, 3001), (1, 5), (2, 3, 40)])
def test_matches_float64(impl, shape, dtype):
  """Rows of very different scales, one huge logit, a constant row, a -inf entry; V not a
  multiple of the column tile, rows not a multiple of the row tile, one row; the kernel with
  small tiles so a row spans several tiles and splits (and a split past the last tile). bf16
  input (the head's bf16 logits) is summed in float32: the float64 sum of the rounded values."""
  config = dataclasses.replace(gpu.default_config(dtype), cols=256, splits=5)
  rng = np.random.default_rng(sum(shape))
  x = rng.normal(size=shape).reshape(-1, shape[-1])
  x *= np.resize([0.01, 1, 30, 300, 1, 1], (x.shape[0], 1))
  x[0, min(3, shape[-1] - 1)] = -np.inf
  if x.shape[0] > 5:
    x[4, 17] = 1e4
    x[5] = 2.5
  xj = jnp.asarray(x.reshape(shape), dtype)
  out = jax.jit(lambda a: logsumexp(a, implementation=impl, config=config))(xj)
  assert out.dtype == jnp.float32
  got = np.asarray(out, np.float64)
  x32 = np.asarray(xj, np.float64)
  m = x32.max(-1, keepdims=True)
  want = (m + np.log(np.exp(x32 - m).sum(-1, keepdims=True)))[..., 0]
  assert got.shape == shape[:-1]
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_kernel_rejects_float16():
  with pytest.raises(ValueError, match="takes float32 or bfloat16, got float16"):
    logsumexp(jnp.ones((2, 8), jnp.float16), implementation="pallas_gpu")


def test_kernel_lowers_for_cuda(h200_lowering):
  x = jax.ShapeDtypeStruct((1024, 163840), jnp.float32)  # one chunk of the K3 head's logits
  text = jax.jit(gpu.logsumexp).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "logsumexp"' in text


def test_a_trace_for_the_gpu_is_not_reused_on_this_host(monkeypatch):
  """``target_platform`` is part of the jit cache key: a function traced for the GPU (the Triton
  kernel, lowered for cuda) is traced again outside, where it picks XLA's reduction and runs."""
  gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
  monkeypatch.setattr(gpu_info, "get_gpu_info",
                      lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  traced = []

  @jax.jit
  def f(a):
    traced.append(pallas_kernels.default_backend())
    return logsumexp(a)

  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 300)), jnp.float32)
  with pallas_kernels.target_platform("gpu"):
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "logsumexp"' in text
  got = np.asarray(f(x), np.float64)
  assert traced == ["gpu", jax.default_backend()]
  x64 = np.asarray(x, np.float64)
  np.testing.assert_allclose(got, np.log(np.exp(x64).sum(-1)), rtol=2e-6)
