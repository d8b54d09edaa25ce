"""pallas_kernels.glu: the GLU activations, packed and as a pair (XLA and the Triton kernels in
interpret mode) against a float64 closed form and its finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.glu import glu, glu_packed

CLOSED = {
    "situ": lambda a, b: 4 * np.tanh(a / 4) / (1 + np.exp(-a)) * 25 * np.tanh(b / 25),
    "silu": lambda a, b: a / (1 + np.exp(-a)) * b,
}


def _inputs(shape, seed):
  rng = np.random.default_rng(seed)
  gu = rng.normal(size=shape) * rng.choice([0.05, 1.0, 8.0, 60.0], size=shape)
  g = rng.normal(size=shape[:-1] + (shape[-1] // 2,))
  return gu, g


@pytest.mark.parametrize("form", ["packed", "pair", "wide"])
@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("kind", ["situ", "silu"])
@pytest.mark.parametrize("shape", [(37, 80), (1, 16), (2, 5, 48)])
def test_glu_values_and_grad_match_float64(impl, kind, shape, form):
  """Rows not a multiple of the 32-row tile (37), one row, F=40 (not a multiple of the column
  tile), a leading batch shape; float32 inputs, so the tolerance is float32 rounding. Packed
  (``gu [..., 2F]``), as a pair of arrays (gate, up ``[..., F]``) and packed in a wider row
  (``width=F`` of ``[..., 2F + 7]``: the last 7 columns neither read nor given a gradient)."""
  gu, g = _inputs(shape, seed=len(shape) * 100 + shape[0])
  f = shape[-1] // 2
  guj, gj = jnp.asarray(gu, jnp.float32), jnp.asarray(g, jnp.float32)
  gu64 = np.asarray(guj, np.float64)
  a, b = gu64[..., :f], gu64[..., f:]
  fn, eps = CLOSED[kind], 1e-6
  want_d = np.concatenate([(fn(a + eps, b) - fn(a - eps, b)) / (2 * eps) * g,
                           (fn(a, b + eps) - fn(a, b - eps)) / (2 * eps) * g], -1)
  if form == "packed":
    y, vjp = jax.vjp(lambda x: glu_packed(x, kind, implementation=impl), guj)
    (dgu,) = vjp(gj)
  elif form == "wide":
    extra = jnp.asarray(np.random.default_rng(7).normal(size=shape[:-1] + (7,)) * 1e3, jnp.float32)
    y, vjp = jax.vjp(lambda x: glu_packed(x, kind, width=f, implementation=impl),
                     jnp.concatenate([guj, extra], -1))
    (dgu,) = vjp(gj)
    np.testing.assert_array_equal(np.asarray(dgu[..., 2 * f:]), 0)
    dgu = dgu[..., :2 * f]
  else:
    y, vjp = jax.vjp(lambda p, q: glu(p, q, kind, implementation=impl), guj[..., :f], guj[..., f:])
    dgu = jnp.concatenate(vjp(gj), -1)
  assert y.shape == shape[:-1] + (f,) and dgu.shape == shape
  np.testing.assert_allclose(np.asarray(y, np.float64), fn(a, b), rtol=2e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dgu, np.float64), want_d, rtol=2e-4, atol=1e-3)


@pytest.mark.parametrize("kind", ["situ", "silu"])
def test_pallas_equals_xla_and_the_pair_form_in_bf16(kind):
  gu, g = _inputs((45, 96), seed=3)
  guj, gj = jnp.asarray(gu, jnp.bfloat16), jnp.asarray(g, jnp.bfloat16)
  out = {}
  for impl in ("xla", "pallas_gpu"):
    y, vjp = jax.vjp(lambda x, impl=impl: glu_packed(x, kind, implementation=impl), guj)
    out[impl] = (y, vjp(gj)[0])
    assert y.dtype == jnp.bfloat16 and out[impl][1].dtype == jnp.bfloat16
  for x, p in zip(out["xla"], out["pallas_gpu"]):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(p, np.float32), rtol=1e-2,
                               atol=1e-2)
  for impl in ("xla", "pallas_gpu"):  # the pair form: the packed form's numbers exactly
    y2, vjp2 = jax.vjp(lambda a, b, impl=impl: glu(a, b, kind, implementation=impl),
                       guj[:, :48], guj[:, 48:])
    np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(out[impl][0], np.float32))
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(vjp2(gj), -1), np.float32),
                                  np.asarray(out[impl][1], np.float32))


def test_bad_input_is_named():
  with pytest.raises(ValueError, match="unknown activation 'gelu'"):
    glu_packed(jnp.ones((2, 4)), "gelu")
  with pytest.raises(ValueError, match="even last dimension"):
    glu_packed(jnp.ones((2, 5)), "situ")
  with pytest.raises(ValueError, match="width 3 does not fit gu"):
    glu_packed(jnp.ones((2, 5)), "situ", width=3)
  with pytest.raises(ValueError, match="one shape"):
    glu(jnp.ones((2, 4)), jnp.ones((2, 5)))
  # gate and up of two dtypes: both in their common type, as the XLA form's result
  a, b = (jax.random.normal(jax.random.key(i), (3, 16)) for i in (1, 2))
  y, vjp = jax.vjp(lambda a, b: glu(a, b, implementation="pallas_gpu"), a.astype(jnp.bfloat16), b)
  da, db = vjp(jax.random.normal(jax.random.key(3), (3, 16)))
  assert y.dtype == jnp.float32 and da.dtype == jnp.bfloat16 and db.dtype == jnp.float32


def test_cuda_lowering_at_the_expert_shape(h200_lowering):
  """The kernels lower for CUDA at k3_1b's expert activation (N*k = 524288 rows, F = 512), the
  packed and the pair forms."""
  from pallas_kernels.glu import gpu
  gu = jax.ShapeDtypeStruct((524288, 1024), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((524288, 512), jnp.bfloat16)
  for fn, args in ((lambda x: gpu.glu_fwd(x, 512, "situ", 4.0, 25.0), (gu,)),
                   (lambda x, y: gpu.glu_bwd(x, y, 512, "situ", 4.0, 25.0), (gu, g)),
                   (lambda a, b: gpu.glu_pair_fwd(a, b, "situ", 4.0, 25.0), (g, g)),
                   (lambda a, b, y: gpu.glu_pair_bwd(a, b, y, "situ", 4.0, 25.0), (g, g, g))):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert 'name = "glu_' in text
