"""KDA decode kernel (Pallas GPU in interpret mode on CPU, and the XLA path) against an
independent float64 NumPy loop, with a pool of states indexed by non-contiguous slots."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from kda_numpy import numpy_kda, preprocess
from pallas_kernels.kda import decode, kda_decode


def np_decode(q, k, v, g, beta, pool, slots, *, scale, l2, gate, A_log, dt_bias, lb, logit):
  """float64 reference: per request, Tn recurrent steps on its pool row."""
  q, k, g, beta = preprocess(q, k, g, beta, hv=v.shape[2], l2=l2, gate=gate, A_log=A_log,
                             dt_bias=dt_bias, lb=lb, beta_logit=logit)
  pool = np.asarray(pool, np.float64).copy()
  slots = np.asarray(slots)
  o, pool[slots] = numpy_kda(q, k, v, g, beta, scale, pool[slots], np.zeros(q.shape[:2], int))
  return o, pool


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
  pool, A_log, dt_bias = f(pool_size, hv, kd, vd), 0.5 * f(hv), 0.5 * f(hv * kd)
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


@pytest.mark.parametrize("block_v,num_warps", [(32, 4), (128, 8)])
def test_decode_gpu_tiles(block_v, num_warps):
  """The tilings the benchmark sweeps: 4 V tiles of 32, one of 128."""
  n, tn, h, kd, vd = 2, 2, 1, 32, 128
  r = np.random.default_rng(block_v)
  f = lambda *s: r.standard_normal(s).astype(np.float32)
  q, k, v, g, beta = f(n, tn, h, kd), f(n, tn, h, kd), f(n, tn, h, vd), f(n, tn, h, kd), f(n, tn, h)
  pool, A_log, dt_bias = f(3, h, kd, vd), 0.5 * f(h), 0.5 * f(h * kd)
  slots = np.array([2, 0], np.int32)
  o, new_pool = decode._decode_gpu(
      *(jnp.asarray(x) for x in (q, k, v, g, beta, pool)), jnp.asarray(slots), scale=0.3,
      use_qk_l2norm=True, A_log=jnp.asarray(A_log), dt_bias=jnp.asarray(dt_bias),
      gate="bounded", lower_bound=-5.0, beta_is_logit=True, block_v=block_v,
      num_warps=num_warps)
  o_np, pool_np = np_decode(q, k, v, g, beta, pool, slots, scale=0.3, l2=True, gate="bounded",
                            A_log=A_log, dt_bias=dt_bias, lb=-5.0, logit=True)
  np.testing.assert_allclose(o, o_np, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(new_pool, pool_np, rtol=1e-5, atol=1e-5)
