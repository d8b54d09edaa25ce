"""pallas_kernels.triton_math (the Triton kernels' exp / sigmoid / silu) against float64 NumPy,
over the whole float32 range: no overflow to NaN at the ends."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import triton_math as tm


def test_matches_float64_over_the_float32_range():
  rng = np.random.default_rng(3)
  x = np.concatenate([rng.uniform(-90, 90, 4000), rng.normal(size=1000),
                      [-np.inf, -1e4, -200.0, -88.0, -0.0, 0.0, 1e-30, 88.0, 200.0, 1e4, np.inf]])
  x32 = np.asarray(x, np.float32)
  got = {f: np.asarray(jax.jit(getattr(tm, f))(jnp.asarray(x32)), np.float64)
         for f in ("exp", "sigmoid", "silu")}
  x64 = x32.astype(np.float64)
  with np.errstate(over="ignore", invalid="ignore"):
    e = np.exp(-np.abs(x64))
    sig = np.where(x64 >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    want = {"exp": np.exp(x64), "sigmoid": sig, "silu": np.where(np.isinf(x64), np.where(
        x64 > 0, np.inf, 0.0), x64 * sig)}
  fin = np.abs(x64) < 85  # e^x a normal float32 number
  np.testing.assert_allclose(got["exp"][fin], want["exp"][fin], rtol=1e-5)
  for f in ("sigmoid", "silu"):
    assert not np.isnan(got[f][~np.isinf(x64)]).any(), f
    np.testing.assert_allclose(got[f][np.isfinite(x64)], want[f][np.isfinite(x64)], rtol=1e-5,
                               atol=1e-30)
  assert got["exp"][x64 == -np.inf] == 0 and got["exp"][x64 == np.inf] == np.inf
  assert got["sigmoid"][x64 == -np.inf] == 0 and got["sigmoid"][x64 == np.inf] == 1
