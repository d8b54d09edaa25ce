"""The MoE token permutation's Triton kernels (interpret mode) and the XLA reference against
float64 NumPy loops: the expansion (permute's row gather) and its cotangent, the unpermute's
forward value and both cotangents; dispatch; the kernels' CUDA lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels.moe import reference, permute_gpu


def _inputs(n, k, d, y_dtype, w_dtype, seed):
  """Ragged groups: random expert ids among 5 experts, order by a stable argsort (NumPy)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 5, size=(n, k))
  order = np.argsort(ids.reshape(-1), kind="stable").astype(np.int32)
  y = jnp.asarray(rng.normal(size=(n * k, d)), y_dtype)
  w = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), w_dtype)
  g = jnp.asarray(rng.normal(size=(n, d)), y_dtype)
  return y, jnp.asarray(order), w, g


def _numpy_loop(y, order, w, g):
  """float64 (out [N, D], dy [N*k, D], dweights [N, k]), one sorted row at a time."""
  y, order, w, g = (np.asarray(a, np.float64) if a.dtype != jnp.int32 else np.asarray(a)
                    for a in (y, order, w, g))
  n, k = w.shape
  out, dy, dw = np.zeros((n, y.shape[1])), np.zeros_like(y), np.zeros_like(w)
  for r, p in enumerate(order):
    t, j = divmod(int(p), k)
    out[t] += w[t, j] * y[r]
    dy[r] = w[t, j] * g[t]
    dw[t, j] = y[r] @ g[t]
  return out, dy, dw


def _vjp(fn, y, order, w, g):
  return jax.jit(lambda y, w, g: (lambda o, f: (o, *f(g)))(*jax.vjp(
      lambda y, w: fn(y, order, w), y, w)))(y, w, g)


def _tol(dtype):
  return dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)


CASES = [  # n, k, d, y dtype, weights dtype, kernel config
    (37, 8, 80, jnp.bfloat16, jnp.float32, permute_gpu.Config(rows=16, block_d=32)),
    (37, 8, 80, jnp.bfloat16, jnp.float32, permute_gpu.Config()),
    (23, 2, 48, jnp.float32, jnp.float32, permute_gpu.Config(rows=8, block_d=16)),
    (50, 1, 130, jnp.float32, jnp.float32, permute_gpu.Config(rows=32)),
    (29, 2, 64, jnp.bfloat16, jnp.bfloat16, permute_gpu.Config(rows=8, block_d=64)),
]


@pytest.mark.parametrize("n, k, d, y_dtype, w_dtype, cfg", CASES)
def test_kernel_and_reference_match_float64_loop(n, k, d, y_dtype, w_dtype, cfg):
  """N*k not a multiple of the row block, k = 1, 2, 8, D not a multiple of the D tile (80 over
  32-wide tiles, 48 over 16, 130 under one 256-wide tile), ragged expert groups."""
  y, order, w, g = _inputs(n, k, d, y_dtype, w_dtype, seed=n * k + d)
  want = _numpy_loop(y, order, w, g)
  got = {"xla": _vjp(reference.unpermute, y, order, w, g),
         "pallas_gpu": _vjp(lambda *a: permute_gpu.unpermute(*a, config=cfg), y, order, w, g)}
  for impl, res in got.items():
    for name, a, b, dt in zip(("out", "dy", "dweights"), res, want, (y_dtype, y_dtype, w_dtype)):
      assert a.dtype == dt and a.shape == b.shape, (impl, name, a.dtype, a.shape)
      np.testing.assert_allclose(np.asarray(a, np.float64), b, **_tol(dt), err_msg=f"{impl} {name}")
  # dy is the same float32 product rounded once: equal; dweights only differ in summation order
  np.testing.assert_array_equal(np.asarray(got["xla"][1], np.float32),
                                np.asarray(got["pallas_gpu"][1], np.float32))
  np.testing.assert_allclose(np.asarray(got["xla"][2], np.float32),
                             np.asarray(got["pallas_gpu"][2], np.float32), **_tol(w_dtype))


@pytest.mark.parametrize("n, k, d, dtype, cfg", [
    (37, 8, 80, jnp.bfloat16, permute_gpu.Config(rows=16, block_d=32)),
    (23, 2, 48, jnp.float32, permute_gpu.Config()),
    (50, 1, 130, jnp.float32, permute_gpu.Config(rows=32))])
def test_expansion_matches_float64_loop(n, k, d, dtype, cfg):
  """``xs[r] = x[order[r] // k]`` and its cotangent (each token's k rows summed): the kernel and
  the reference against a loop; sorted rows not a multiple of the row block, D not a multiple
  of the D tile, k = 1."""
  rng = np.random.default_rng(n + k + d)
  ids = jnp.asarray(rng.integers(0, 5, size=(n, k)), jnp.int32)
  x = jnp.asarray(rng.normal(size=(n, d)), dtype)
  gs = jnp.asarray(rng.normal(size=(n * k, d)), dtype)
  order, inverse = reference.sort_pairs(ids)
  np.testing.assert_array_equal(np.asarray(order), np.argsort(np.asarray(ids).reshape(-1),
                                                                kind="stable"))
  want_x = np.zeros((n * k, d))
  want_dx = np.zeros((n, d))
  for r, p in enumerate(np.asarray(order)):
    want_x[r] = np.asarray(x[p // k], np.float64)
    want_dx[p // k] += np.asarray(gs[r], np.float64)
  for name, fn in (("xla", lambda x: reference.permute(x, ids, 5)[0]),
                   ("pallas_gpu", lambda x: permute_gpu.expand(x, order, inverse, k, cfg))):
    xs, vjp = jax.vjp(fn, x)
    np.testing.assert_array_equal(np.asarray(xs, np.float64), want_x, err_msg=name)
    np.testing.assert_allclose(np.asarray(vjp(gs)[0], np.float64), want_dx, **_tol(dtype),
                               err_msg=name)


def test_dispatch_picks_the_kernel_only_when_asked_on_cpu():
  y, order, w, g = _inputs(9, 2, 32, jnp.bfloat16, jnp.float32, seed=1)
  kinds = {}
  for impl in (None, "xla", "pallas", "pallas_gpu", "pallas_tpu"):
    fn = lambda y, w, impl=impl: jax.vjp(
        lambda y, w: moe.unpermute(y, order, w, implementation=impl), y, w)[1](g)
    kinds[impl] = "pallas_call" in str(jax.make_jaxpr(fn)(y, w))
  assert kinds == {None: False, "xla": False, "pallas": True, "pallas_gpu": True,
                   "pallas_tpu": False}
  x = jnp.ones((9, 32), jnp.bfloat16)
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 3, size=(9, 2)), jnp.int32)
  for impl, kernel in kinds.items():
    jaxpr = str(jax.make_jaxpr(lambda x: moe.permute(x, ids, 3, implementation=impl)[0])(x))
    assert ("pallas_call" in jaxpr) == kernel, impl
  with pytest.raises(ValueError, match="unknown implementation"):
    moe.unpermute(y, order, w, implementation="cuda")
  with pytest.raises(ValueError, match="take float32/bfloat16/float16"):
    moe.permute(x.astype(jnp.int32), ids, 3, implementation="pallas_gpu")
  with pytest.raises(ValueError, match=r"must be \[N\*k, D\]"):
    moe.unpermute(y[1:], order[1:], w, implementation="pallas_gpu")


@pytest.mark.parametrize("cfg", [permute_gpu.Config(), permute_gpu.Config(rows=32,
                                                                              block_d=128)])
def test_kernels_lower_for_cuda(h200_lowering, cfg):
  """The real Triton lowering for an H200 at the k3_1b step shape (inputs as shapes only),
  whole-row and D-tiled programs: the unpermute's backward through its custom VJP and the
  expansion; no GPU needed."""
  n, k, d = 65536, 8, 512
  y = jax.ShapeDtypeStruct((n * k, d), jnp.bfloat16)
  order = jax.ShapeDtypeStruct((n * k,), jnp.int32)
  w = jax.ShapeDtypeStruct((n, k), jnp.float32)
  g = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  fn = lambda y, order, w, g: jax.vjp(
      lambda y, w: permute_gpu.unpermute(y, order, w, config=cfg), y, w)[1](g)
  text = jax.jit(fn).trace(y, order, w, g).lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "unpermute_bwd"' in text
  x = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  fn = lambda x, order: permute_gpu.expand(x, order, order, k, cfg)
  text = jax.jit(fn).trace(x, order).lower(lowering_platforms=("cuda",)).as_text()
  assert f'name = "{permute_gpu.EXPAND_KERNEL}"' in text


@pytest.mark.parametrize("m, p", [(9, 6), (6, 9), (1, 1)])
def test_move_rows_partial_map_and_its_transpose(m, p):
  """``reference.move_rows`` over a partial map (some targets empty, some sources unused) vs a
  float64 loop, its inverse by ``reference.inverse_map``: rows land where the map sends them,
  zeros elsewhere; the cotangent of each source row is the cotangent of the one place it landed
  (zero if none)."""
  rng = np.random.default_rng(m * 10 + p)
  src = rng.permutation(m)[:min(m, p) - (1 if min(m, p) > 1 else 0)]  # sources that land
  dst = rng.permutation(p)[:len(src)]
  index = np.full(p, m, np.int32)  # out of range: an empty row
  inverse = np.full(m, p, np.int32)
  index[dst], inverse[src] = src, dst
  y = rng.normal(size=(m, 3))
  g = rng.normal(size=(p, 3))
  want = np.zeros((p, 3))
  want_grad = np.zeros((m, 3))
  for q in range(p):
    if index[q] < m:
      want[q] = y[index[q]]
      want_grad[index[q]] += g[q]
  np.testing.assert_array_equal(np.asarray(reference.inverse_map(jnp.asarray(index), m)), inverse)
  with jax.enable_x64():
    out, vjp = jax.vjp(lambda y: reference.move_rows(y, jnp.asarray(index), jnp.asarray(inverse)),
                       jnp.asarray(y))
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(g))[0]), want_grad)
