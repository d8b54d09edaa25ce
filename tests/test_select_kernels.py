"""k-th smallest per column (pallas_kernels.select): the XLA radix select and the Pallas GPU kernel
(interpret mode on CPU) against a NumPy sort of the floats' order-preserving keys, bit for bit, on
awkward columns; the implementation switch and input checks; the kernel's Triton lowering for CUDA
at exact QB's shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import select
from pallas_kernels.select import gpu


def np_kth(x, k):
  """Float64-free NumPy reference: the k-th smallest of each column ordered as float32 with
  -0.0 < +0.0 (np.sort's order otherwise), as uint32 bits."""
  bits = x.view(np.uint32)
  key = np.where(bits >= 1 << 31, ~bits, bits | np.uint32(1 << 31))
  kth = np.sort(key, axis=0)[k]
  return np.where(kth >= 1 << 31, kth & np.uint32(0x7FFFFFFF), ~kth).astype(np.uint32)


def awkward(n, e, seed):
  """[N, E] float32: magnitudes 1e-30..1e20 of both signs, +inf, zeros of both signs; column 0
  constant (all tied), column 1 all +inf, column 2 only zeros of both signs and +-1e-30."""
  rng = np.random.default_rng(seed)
  scale = rng.choice([1e-30, 1e-3, 1.0, 1e20], (n, e))
  x = (rng.standard_normal((n, e)) * scale).astype(np.float32)
  x[rng.random((n, e)) < 0.2] = np.inf
  x[rng.random((n, e)) < 0.1] = 0.0
  x[rng.random((n, e)) < 0.1] = -0.0
  x[:, 0] = 1.5
  x[:, 1] = np.inf
  x[:, 2] = rng.choice(np.array([0.0, -0.0, 1e-30, -1e-30], np.float32), n)
  return x


def check(fn, x):
  """fn(x, traced k) equals the key sort for k = 0, N // 3, N - 1, and np.sort as values."""
  n = x.shape[0]
  f = jax.jit(fn)
  for k in sorted({0, n // 3, n - 1}):
    got = np.asarray(f(jnp.asarray(x), jnp.int32(k))).view(np.uint32)
    np.testing.assert_array_equal(got, np_kth(x, k), err_msg=f"k={k}")
    np.testing.assert_array_equal(got.view(np.float32), np.sort(x, axis=0)[k])


# (N, E, kernel config): N = 1; N not a multiple of the [rows, C] step (padding); several steps
# of keys and of candidates (warps=1: C = 128); 1, 2 and 4 bits per pass over the row and over
# the candidates; few and many passes over the whole row; with and without the prefetch.
CASES = [
    (1, 3, gpu.Config()),
    (7, 5, gpu.Config(bits=1, full_bits=4, cand_bits=2, rows=2, warps=1)),
    (513, 33, gpu.Config(bits=2, full_bits=12, cand_bits=4, rows=2, warps=1)),
    (513, 6, gpu.Config(bits=4, full_bits=8, cand_bits=4, prefetch=False, rows=4, warps=1)),
    (300, 4, gpu.Config(bits=2, full_bits=30, cand_bits=1, rows=2, warps=1)),
]


@pytest.mark.parametrize("n, e, config", CASES)
def test_pallas_kernel_is_the_sorted_column_exactly(n, e, config):
  check(lambda x, k: gpu.kth_smallest(x, k, config), awkward(n, e, seed=n + e))


def test_qb_like_margins_through_both_implementations():
  """Margins shaped like exact QB's (normal * 0.1, +inf padding rows), k = N * 8 / 48."""
  rng = np.random.default_rng(3)
  x = (rng.standard_normal((700, 7)) * 0.1).astype(np.float32)
  x[rng.random(700) < 0.05] = np.inf
  k = 700 * 8 // 48
  for impl in ("xla", "pallas"):
    got = np.asarray(select.kth_smallest(jnp.asarray(x), jnp.int32(k), implementation=impl))
    np.testing.assert_array_equal(got.view(np.uint32), np_kth(x, k), err_msg=impl)


def test_reference_is_the_sorted_column_exactly():
  check(lambda x, k: select.kth_smallest(x, k, implementation="xla"), awkward(129, 9, seed=1))


def test_input_checks():
  x = jnp.ones((4, 3), jnp.float32)
  with pytest.raises(ValueError, match="float32"):
    select.kth_smallest(x.astype(jnp.bfloat16), 0)
  with pytest.raises(ValueError, match=r"\[N, E\]"):
    select.kth_smallest(x[0], 0)
  with pytest.raises(ValueError, match="unknown implementation"):
    select.kth_smallest(x, 0, implementation="cuda")
  with pytest.raises(ValueError, match="full_bits"):
    gpu.kth_smallest(x, 0, gpu.Config(bits=4, full_bits=6))


def test_resolve():
  assert select.resolve(None) == ("pallas_gpu" if jax.default_backend() == "gpu" else "xla")
  assert select.resolve("pallas") == "pallas_gpu"
  for backend, default in (("gpu", "pallas_gpu"), ("tpu", "xla"), ("cpu", "xla")):
    with pallas_kernels.target_platform(backend):
      assert select.resolve(None) == default, backend
      assert select.resolve("pallas") == ("xla" if backend == "tpu" else "pallas_gpu"), backend


@pytest.mark.parametrize("config", [gpu.Config(), gpu.Config(bits=1, full_bits=16, rows=16)])
def test_kernel_lowers_for_cuda(h200_lowering, config):
  """The Triton lowering at exact QB's shape (N 65536 tokens, E 48 experts)."""
  args = (jax.ShapeDtypeStruct((65536, 48), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
  lowered = jax.jit(lambda x, k: gpu.kth_smallest(x, k, config)).trace(*args).lower(
      lowering_platforms=("cuda",))
  assert "kth_smallest" in lowered.as_text()


def test_exact_qb_selects_in_xla_when_tokens_are_split(h200_lowering):
  """With the tokens split over a mesh, exact QB's select stays in XLA (GSPMD splits its count
  reductions; the Pallas kernel would gather every rank's margins); on one device it takes the
  kernel. Traced for the GPU (where the kernel is the default), on an abstract mesh."""
  from k3jax import router
  from k3jax.config import MoEConfig
  cfg = MoEConfig(num_experts=8, top_k=2, balancing="quantile", balancing_iters=1)
  scores = jax.ShapeDtypeStruct((64, 8), jnp.float32)
  bias = jax.ShapeDtypeStruct((8,), jnp.float32)
  ids = jax.ShapeDtypeStruct((64, 2), jnp.int32)

  def has_kernel():
    stat = lambda s, b, i: router.sharded_bias_stat(s, b, i, cfg)
    jaxpr = jax.make_jaxpr(stat)(scores, bias, ids)
    return "pallas_call" in str(jaxpr)

  assert has_kernel()
  mesh = jax.sharding.AbstractMesh((4,), ("data",))
  with jax.sharding.use_abstract_mesh(mesh):
    assert not has_kernel()
