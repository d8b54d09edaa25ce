"""The Mosaic GPU ``kda_chunk_a`` (``pallas_kernels.kda.chunk_a_mgpu``) in GPU interpret mode
against the Triton kernel (``gpu._dense_a_kernel``, itself checked through the op against float64
loops in ``test_kda_gpu.py``, where the op also runs with this kernel): every factor, with
segments inside and across chunks, a padded last chunk and grouped heads; and its CUDA lowering
at the benchmark shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_a_mgpu, gpu

BF16 = jnp.bfloat16


def _cfg(kd, l2):
  return gpu._Config(scale=kd ** -0.5, chunk=64, use_qk_l2norm=l2, gate="bounded",
                     lower_bound=-5.0, beta_is_logit=True, diag_rows=32, dtype="bfloat16")


@pytest.mark.parametrize("kd,l2", [(128, True), (64, False)])
def test_matches_the_triton_kernel(monkeypatch, kd, l2):
  b, tp, h, hv, t = 1, 192, 1, 2, 170  # the third chunk continues the second's last segment
  rng = np.random.default_rng(kd)
  n = lambda *s: jnp.asarray(rng.standard_normal(s), BF16)
  q, k, f, v = n(b, tp, h, kd), n(b, tp, h, kd), n(b, tp, hv, kd), n(b, tp, hv, kd)
  beta = n(b, tp, hv)
  if not l2:
    q, k = (x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True) for x in (q, k))
    q, k = q.astype(BF16), k.astype(BF16)
  a_log = jnp.asarray(rng.standard_normal(hv) * 0.5, jnp.float32)
  dt_bias = jnp.asarray(rng.standard_normal((hv, kd)) * 0.5, jnp.float32)
  seg = np.zeros((b, tp), np.int32)
  for cut in (30, 64, 65):  # inside the first chunk, at the second's start and right after
    seg[:, cut:] += 1
  cfg = _cfg(kd, l2)
  outs = {}
  for mode in ("triton", "mosaic"):
    monkeypatch.setattr(gpu, "CHUNK_A", mode)
    outs[mode] = gpu._chunk_a(cfg, q, k, v, f, beta, a_log, dt_bias, jnp.asarray(seg), t)
  # the same bf16 products; the gate's cumulative sums in another order, so bf16 operands and
  # results may round the other way (one bf16 step: 4e-3 of a value)
  tols = dict(pkk=1e-3, aqk=8e-3, qg=8e-3, kd=8e-3, kg=8e-3, gc=1e-5, rq=1e-6, rk=1e-6)
  for name, x, y in zip(tols, outs["triton"], outs["mosaic"]):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert x.shape == y.shape, name
    assert np.abs(x).max() > 0, name  # every factor is exercised
    err = np.abs(x - y).max() / np.abs(x).max()
    assert err < tols[name], (name, err)


def test_lowers_for_cuda():
  """At B1 T16384 H32 K128 for an H200, on the CPU: layout inference and shared memory."""
  sds = jax.ShapeDtypeStruct
  b, tp, h, kd = 1, 16384, 32, 128
  args = (sds((b, tp, h, kd), BF16),) * 3 + (sds((2, h, kd), jnp.float32),
                                             sds((4, b, tp), jnp.float32))
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    fn = lambda *a: chunk_a_mgpu.chunk_a(_cfg(kd, True), *a, hv=h, t=tp, max_exp=gpu._MAX_EXP,
                                         interpret=False)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "kda_chunk_a_mgpu" in text
