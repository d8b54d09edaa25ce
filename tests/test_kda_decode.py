"""KDA decode kernel (Pallas GPU in interpret mode on CPU, and the XLA path) against an
independent float64 NumPy loop, with a pool of states indexed by non-contiguous slots."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kda_numpy import numpy_kda, preprocess
from pallas_kernels.kda import decode, kda_decode


def np_decode(q, k, v, g, beta, pool, slots, *, scale, l2, gate, A_log, dt_bias, lb, logit):
  """float64 reference: per request, Tn recurrent steps on its row of the K-last pool
  ``[S, HV, V, K]`` (the NumPy loop's states are ``[K, V]``)."""
  q, k, g, beta = preprocess(q, k, g, beta, hv=v.shape[2], l2=l2, gate=gate, A_log=A_log,
                             dt_bias=dt_bias, lb=lb, beta_logit=logit)
  pool = np.swapaxes(np.asarray(pool, np.float64), -1, -2).copy()
  slots = np.asarray(slots)
  o, pool[slots] = numpy_kda(q, k, v, g, beta, scale, pool[slots], np.zeros(q.shape[:2], int))
  return o, np.swapaxes(pool, -1, -2)


CASES = [  # (Tn, gate, fused l2 / beta logit)
    (1, "bounded", True),
    (3, "softplus", True),
    (3, None, False),
]


@pytest.mark.parametrize("tn,gate,fused", CASES)
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kda_decode(backend, tn, gate, fused):
  n, h, hv, kd, vd, pool_size = 3, 1, 2, 16, 64, 7
  r = np.random.default_rng(tn * 10 + len(str(gate)))
  f = lambda *s: r.standard_normal(s).astype(np.float32)
  q, k, v, g, beta = f(n, tn, h, kd), f(n, tn, h, kd), f(n, tn, hv, vd), f(n, tn, hv, kd), f(n, tn, hv)
  if gate is None:
    g, beta = -np.exp(g - 1.0), 1 / (1 + np.exp(-beta))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
  pool, A_log, dt_bias = f(pool_size, hv, vd, kd), 0.5 * f(hv), 0.5 * f(hv * kd)
  slots = np.array([5, 0, 3], np.int32)
  opts = dict(scale=kd ** -0.5, use_qk_l2norm=fused, gate=gate, beta_is_logit=fused,
              A_log=None if gate is None else jnp.asarray(A_log),
              dt_bias=None if gate is None else jnp.asarray(dt_bias))
  step = jax.jit(lambda *a: decode.kda_decode(*a, slots=jnp.asarray(slots), backend=backend,
                                              **opts), donate_argnums=(5,))
  o, new_pool = step(*(jnp.asarray(x) for x in (q, k, v, g, beta, pool)))
  o_np, pool_np = np_decode(q, k, v, g, beta, pool, slots, scale=kd ** -0.5, l2=fused,
                            gate=gate, A_log=A_log, dt_bias=dt_bias, lb=-5.0, logit=fused)
  np.testing.assert_allclose(o, o_np, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_pool, pool_np, rtol=1e-5, atol=1e-5)
  untouched = [i for i in range(pool_size) if i not in slots]
  np.testing.assert_array_equal(np.asarray(new_pool)[untouched], pool[untouched])


def test_decode_rejects_bad_state():
  x = jnp.ones((2, 1, 1, 16))
  with pytest.raises(ValueError, match="float32"):
    kda_decode(x, x, x, x, jnp.ones((2, 1, 1)), jnp.ones((2, 1, 16, 16), jnp.bfloat16),
               implementation="pallas_gpu")


D = decode.DecodeConfig
TUNINGS = [  # (Tn, tuning of decode_gpu); H=2, HV=4 (grouped values), V=32
    (1, D(block_v=16, num_warps=1)),  # two tiles per head
    (3, D(block_v=16, num_warps=2)),
    (3, D(block_v=8, num_warps=1)),  # four tiles per head
    (1, D(block_v=32, num_warps=4)),
    (3, D(block_v=32, num_warps=8)),  # one V tile spanning V
]


def _tuning_id(x):
  return f"{x.block_v}-{x.num_warps}" if isinstance(x, D) else f"tn{x}"


@pytest.mark.parametrize("tn,cfg", TUNINGS, ids=_tuning_id)
def test_decode_gpu_tunings(tn, cfg):
  """The kernel's tunings (benchmarks/kda_decode.py): V tiles and warps, Tn 1 and 3;
  grouped values, non-contiguous slots, the untouched pool rows unchanged."""
  n, h, hv, kd, vd = 3, 2, 4, 16, 32
  r = np.random.default_rng(tn + 2)
  f = lambda *s: r.standard_normal(s).astype(np.float32)
  q, k, g = f(n, tn, h, kd), f(n, tn, h, kd), f(n, tn, hv, kd)
  v, beta = f(n, tn, hv, vd), f(n, tn, hv)
  pool, A_log, dt_bias = f(6, hv, vd, kd), 0.5 * f(hv), 0.5 * f(hv * kd)
  slots = np.array([4, 0, 2], np.int32)
  step = jax.jit(lambda *a: decode.decode_gpu(
      *a, jnp.asarray(slots), scale=0.3, use_qk_l2norm=True, A_log=jnp.asarray(A_log),
      dt_bias=jnp.asarray(dt_bias), gate="bounded", lower_bound=-5.0, beta_is_logit=True,
      config=cfg), donate_argnums=(5,))
  o, new_pool = step(*(jnp.asarray(x) for x in (q, k, v, g, beta, pool)))
  o_np, pool_np = np_decode(q, k, v, g, beta, pool, slots, scale=0.3, l2=True, gate="bounded",
                            A_log=A_log, dt_bias=dt_bias, lb=-5.0, logit=True)
  np.testing.assert_allclose(o, o_np, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_pool, pool_np, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(new_pool)[[1, 3, 5]], pool[[1, 3, 5]])


def test_decode_gpu_rejects_bad_tuning():
  x = jnp.ones((2, 1, 1, 16))
  args = (x, x, jnp.ones((2, 1, 2, 32)), jnp.ones((2, 1, 2, 16)), jnp.ones((2, 1, 2)),
          jnp.ones((2, 2, 16, 32)), jnp.arange(2))
  kw = dict(scale=0.3, use_qk_l2norm=False, A_log=None, dt_bias=None, gate=None,
            lower_bound=-5.0, beta_is_logit=False)
  with pytest.raises(ValueError, match="must divide"):
    decode.decode_gpu(*args, **kw, config=D(block_v=24))


@pytest.mark.parametrize("cfg", decode.SWEEP, ids=_tuning_id)
def test_decode_sweep_lowers_for_cuda(h200_lowering, cfg):
  """Every tuning the benchmark times lowers through Pallas' Triton path for an H200 at the
  benchmark shape (N=256, H=32, K=V=128, Tn=1; inputs as shapes only), without a GPU."""
  n, h, kd = 256, 32, 128
  S = jax.ShapeDtypeStruct
  args = [S((n, 1, h, kd), jnp.bfloat16)] * 3 + [
      S((n, 1, h, kd), jnp.float32), S((n, 1, h), jnp.float32), S((n, h, kd, kd), jnp.float32),
      S((n,), jnp.int32)]
  fn = lambda *a: decode.decode_gpu(*a, scale=kd ** -0.5, use_qk_l2norm=True, A_log=None,
                                    dt_bias=None, gate=None, lower_bound=-5.0,
                                    beta_is_logit=False, config=cfg)
  text = jax.jit(fn, donate_argnums=(5,)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "kda_decode"' in text
