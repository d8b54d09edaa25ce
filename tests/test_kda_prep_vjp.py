"""The pre-processing VJP kernel (pallas_kernels/kda/prep_vjp.py, interpret mode on CPU) against
``jax.vjp`` of ``gpu.preprocess`` (XLA, float32) and an analytic float64 NumPy VJP written here;
plus its CUDA lowering at the benchmark shape."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels.kda import config, gpu, prep_vjp

TILES = prep_vjp.Config(rows=32, block=16)  # several programs and steps at test shapes


def cfg_of(l2, gate, logit, lb=-5.0):
  return config.KdaOptions(scale=1.0, chunk=64, use_qk_l2norm=l2, gate=gate, lower_bound=lb,
                           beta_is_logit=logit, diag_rows=0, dtype="float32")


def np_vjp(q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta, *, l2, gate, lb, logit):
  """float64 cotangents of the raw inputs, written out analytically."""
  q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta = (
      np.asarray(x, np.float64) for x in (q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta))
  b, tc, hv, kd = dq.shape
  t, h = q.shape[1], q.shape[2]
  grp = lambda d: d[:, :t].reshape(b, t, h, hv // h, kd).sum(3)
  dq, dk, dg, dbeta = grp(dq), grp(dk), dg[:, :t], dbeta[:, :t]
  if l2:
    def l2_vjp(x, dy):
      r = 1 / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
      return r * dy - r ** 3 * x * (x * dy).sum(-1, keepdims=True)
    dq, dk = l2_vjp(q, dq), l2_vjp(k, dk)
  dalog, ddtb = np.zeros(hv), np.zeros((hv, kd))
  if gate is not None:
    x = g + dt_bias
    a = np.exp(A_log)[:, None]
    if gate == "softplus":
      dx = dg * -a / (1 + np.exp(-x))
      dal = dg * -a * np.log1p(np.exp(x))
    else:
      s = 1 / (1 + np.exp(-a * x))
      dx = dg * lb * s * (1 - s) * a
      dal = dx * x
    dg, dalog, ddtb = dx, dal.sum((0, 1, 3)), dx.sum((0, 1))
  if logit:
    s = 1 / (1 + np.exp(-beta))
    dbeta = dbeta * s * (1 - s)
  return dq, dk, dg, dbeta, dalog, ddtb


def xla_vjp(cfg, q, k, g, beta, A_log, dt_bias, dq, dk, dg, dbeta):
  """``jax.vjp`` of ``gpu.preprocess`` with the value-head groups summed, cast as _kda_bwd did."""
  b, t, h, kd = q.shape
  hv = g.shape[2]
  grp = lambda d: d[:, :t].reshape(b, t, h, hv // h, kd).sum(3)
  _, f = jax.vjp(lambda *x: gpu.preprocess(cfg, *x), q, k, g, beta, A_log, dt_bias)
  out = f((grp(dq), grp(dk), dg[:, :t], dbeta[:, :t]))
  return tuple(o.astype(x.dtype) for o, x in zip(out, (q, k, g, beta, A_log, dt_bias)))


def make(seed, b, t, h, hv, kd, dtype, tc):
  r = np.random.default_rng(seed)
  n = lambda *s: r.standard_normal(s).astype(np.float32)
  raw = [jnp.asarray(x, dtype) for x in (n(b, t, h, kd), n(b, t, h, kd), n(b, t, hv, kd),
                                         2 * n(b, t, hv))]
  params = [jnp.asarray(0.5 * n(hv)), jnp.asarray(0.5 * n(hv, kd))]
  cts = [jnp.asarray(x) for x in (n(b, tc, hv, kd), n(b, tc, hv, kd), n(b, tc, hv, kd),
                                  n(b, tc, hv))]
  return raw + params + cts


# (B, T, Tc (cotangent time axis, >= T: chunk padding), H, HV, K, dtype, l2norm, gate, logit)
CASES = [
    (1, 37, 37, 2, 2, 128, jnp.bfloat16, True, "bounded", True),  # K3's settings
    (2, 21, 32, 1, 2, 64, jnp.float32, False, "softplus", True),
    (1, 37, 48, 2, 4, 64, jnp.bfloat16, True, None, False),
    (2, 5, 5, 1, 1, 64, jnp.float32, False, "bounded", False),
    (1, 19, 19, 2, 2, 128, jnp.float32, True, "softplus", False),
    (1, 16, 16, 1, 2, 128, jnp.bfloat16, False, None, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:6])) + "-"
                         + "-".join(str(x) for x in (jnp.dtype(c[6]).name, *c[7:])))
def test_matches_xla_and_numpy(case):
  b, t, tc, h, hv, kd, dtype, l2, gate, logit = case
  cfg = cfg_of(l2, gate, logit, lb=-4.0)
  args = make(t * kd + hv, b, t, h, hv, kd, dtype, tc)
  got = jax.jit(lambda *a: prep_vjp.preprocess_vjp(cfg, *a, config=TILES))(*args)
  want = xla_vjp(cfg, *args)
  ref = np_vjp(*args, l2=l2, gate=gate, lb=-4.0, logit=logit)
  names = ("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias")
  bf16 = jnp.dtype(dtype) == jnp.bfloat16
  for name, x, w, r in zip(names, got, want, ref):
    assert x.shape == w.shape == r.shape and x.dtype == w.dtype, name
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    summed = name in ("dA_log", "ddt_bias")  # float32 sums, not rounded to the input dtype
    if summed and gate is None:
      assert not x.any() and not w.any(), name
      continue
    scale = np.abs(r).max()
    assert scale > 0, name
    tol = 1e-5 if summed or not bf16 else 8e-3  # bf16: within about one rounding step
    np.testing.assert_allclose(x, r, rtol=tol, atol=tol * scale, err_msg=f"{name} vs numpy")
    np.testing.assert_allclose(x, w, rtol=tol, atol=tol * scale, err_msg=f"{name} vs xla")


def test_bad_shapes_raise():
  args = make(0, 1, 8, 2, 2, 64, jnp.float32, 8)
  with pytest.raises(ValueError, match="dbeta"):
    prep_vjp.preprocess_vjp(cfg_of(True, None, False), *args[:9], args[9][:, :, :1])
  with pytest.raises(ValueError, match="unknown gate"):
    prep_vjp.preprocess_vjp(cfg_of(True, "relu", False), *args)


def test_cuda_lowering_at_the_benchmark_shape(h200_lowering):
  """The kernel lowers for CUDA at B1 T16384 H32 K128 bf16 (K3's settings), and grouped heads
  with the softplus gate at K = 64."""
  for (b, t, h, hv, kd), cfg in (((1, 16384, 32, 32, 128), cfg_of(True, "bounded", True)),
                                 ((1, 100, 2, 4, 64), cfg_of(False, "softplus", False))):
    s = lambda *shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt)
    bf = jnp.bfloat16
    args = (s(b, t, h, kd, dt=bf), s(b, t, h, kd, dt=bf), s(b, t, hv, kd, dt=bf),
            s(b, t, hv, dt=bf), s(hv), s(hv, kd), s(b, t, hv, kd), s(b, t, hv, kd),
            s(b, t, hv, kd), s(b, t, hv))
    f = lambda *a: prep_vjp.preprocess_vjp(cfg, *a)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert 'name = "kda_prep_vjp"' in text
