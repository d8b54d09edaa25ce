"""MoE grouped matmuls and token permutation: Pallas kernels (GPU and TPU, interpret mode on CPU)
against the XLA reference and a float64 NumPy loop; lowering for TPU and CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err

import pallas_kernels
from pallas_kernels import moe
from pallas_kernels.moe import gpu, pallas, reference


def np_gmm(x, w, sizes):
  """Float64 loop: forward, d_lhs and d_rhs of sum(gmm(x, w) * dy) for dy = cos-pattern."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  m, n = x.shape[0], w.shape[2]
  dy = dy_pattern(m, n)
  out, dx, dw = np.zeros((m, n)), np.zeros_like(x), np.zeros_like(w)
  start = 0
  for g, size in enumerate(sizes):
    rows = slice(start, start + size)
    out[rows] = x[rows] @ w[g]
    dx[rows] = dy[rows] @ w[g].T
    dw[g] = x[rows].T @ dy[rows]
    start += size
  return out, dx, dw


def dy_pattern(m, n):
  return np.cos(np.arange(m * n, dtype=np.float64).reshape(m, n) * 0.37)


def operands(seed, m, k, n, e):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  return x, w


def value_and_grads(impl, x, w, sizes):
  dy = jnp.asarray(dy_pattern(x.shape[0], w.shape[2]), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def loss(x, w):
    out = moe.gmm(x, w, gs, implementation=impl)
    return jnp.sum(out.astype(jnp.float32) * dy), out

  (_, out), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  return out, dx, dw


# Skewed sizes with empty groups, groups smaller than a tile, rows past the sum (203 - 187 = 16)
# and M not a multiple of 8 or of the row tile.
SKEWED = (0, 150, 3, 0, 33, 1)
# Every row in one group but the last.
LAST_EMPTY = (203, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("impl, sizes", [
    ("pallas_gpu", SKEWED), ("pallas_gpu", LAST_EMPTY), ("pallas_tpu", SKEWED), ("xla", SKEWED)],
    ids=["gpu-skewed", "gpu-one_group", "tpu-skewed", "xla-skewed"])
def test_gmm_values_and_grads_vs_numpy(impl, sizes):
  x, w = operands(0, 203, 128, 128, len(sizes))
  out, dx, dw = value_and_grads(impl, x, w, sizes)
  ref_out, ref_dx, ref_dw = np_gmm(x, w, sizes)
  assert rel_err(out, ref_out) < 1e-2
  assert rel_err(dx, ref_dx) < 1e-2
  assert rel_err(dw, ref_dw) < 1e-2
  tail = sum(sizes)
  assert np.all(np.asarray(out[tail:], np.float32) == 0)  # rows past the groups
  assert np.all(np.asarray(dx[tail:], np.float32) == 0)
  empty = [g for g, s in enumerate(sizes) if s == 0]
  assert np.all(np.asarray(dw[np.array(empty)], np.float32) == 0)


def test_gmm_gpu_random_sizes_matches_reference():
  """Random group sizes summing to M, K=N=64 tiles (block_n 64), M past several row tiles."""
  rng = np.random.default_rng(3)
  m, e = 421, 5
  cuts = np.sort(rng.integers(0, m, e - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [m]]))
  x, w = operands(1, m, 64, 64, e)
  gs = jnp.asarray(sizes, jnp.int32)
  out = moe.gmm(x, w, gs, implementation="pallas_gpu")
  ref = reference.gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs)
  assert rel_err(out, ref) < 1e-2
  assert rel_err(out, np_gmm(x, w, sizes)[0]) < 1e-2


def small_mlp(seed=0, t=37, d=128, f=64, e=5, k=2):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (t, d), jnp.float32).astype(jnp.bfloat16)
  ids = jnp.argsort(jax.random.normal(ks[1], (t, e)), axis=1)[:, :k]
  ids = ids.at[:, 0].set(jnp.where(jnp.arange(t) % 3 == 0, 1, ids[:, 0]))  # skew towards expert 1
  ids = jnp.where(ids == 4, 3, ids)  # expert 4 gets no tokens
  wts = jax.random.uniform(ks[2], (t, k), jnp.float32, 0.1, 1.0)
  wgu = (jax.random.normal(ks[3], (e, d, 2 * f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  wdn = (jax.random.normal(ks[4], (e, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
  return x, ids, wts, wgu, wdn


def glu(gu):  # SiTU-GLU by XLA's autodiff, packed gate and up
  a, b = jnp.split(gu, 2, axis=-1)
  return 4.0 * jnp.tanh(a / 4.0) * jax.nn.sigmoid(a) * 25.0 * jnp.tanh(b / 25.0)


@pytest.mark.slow
def test_expert_mlp_pallas_equals_xla_values_and_grads():
  x, ids, wts, wgu, wdn = small_mlp()
  probe = jnp.cos(jnp.arange(x.shape[1], dtype=jnp.float32))

  def run(impl):
    def loss(x, wts, wgu, wdn):
      y = moe.expert_mlp(x, ids, wts, wgu, wdn, glu, implementation=impl)
      return jnp.sum(y.astype(jnp.float32) * probe), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, wts, wgu, wdn)

  (_, y_p), g_p = run("pallas_gpu")
  (_, y_x), g_x = run("xla")
  assert rel_err(y_p, y_x) < 1e-2
  for a, b in zip(g_p, g_x):
    assert rel_err(a, b) < 2e-2
  assert np.all(np.asarray(g_p[3][4], np.float32) == 0)  # the expert without tokens


# the routed experts as expert_mlp runs them (XLA), and TPU's formulation of few pairs
FORMULATIONS = {"expert_mlp": lambda *a: moe.expert_mlp(*a, glu, implementation="xla"),
                "looped_mlp": lambda *a: reference.looped_mlp(*a, glu)}


@pytest.mark.parametrize("form", FORMULATIONS)
@pytest.mark.parametrize("t,e,k", [(37, 5, 2), (3, 32, 2), (1, 16, 4)])
def test_expert_mlp_matches_numpy_loop(t, e, k, form):
  """The grouped path (also for few token-expert pairs, 4 * t * k <= e, off TPU) and TPU's pair
  by pair."""
  x, ids, wts, wgu, wdn = small_mlp(seed=1, t=t, e=e, k=k)
  y = FORMULATIONS[form](x, ids, wts, wgu, wdn)
  xf, wgu64, wdn64 = (np.asarray(a, np.float64) for a in (x, wgu, wdn))
  f = wdn.shape[1]
  ref = np.zeros_like(xf)
  for n in range(x.shape[0]):
    for j in range(ids.shape[1]):
      e = int(ids[n, j])
      h = xf[n] @ wgu64[e]
      a, b = h[:f], h[f:]
      act = 4 * np.tanh(a / 4) / (1 + np.exp(-a)) * 25 * np.tanh(b / 25)
      ref[n] += float(wts[n, j]) * (act @ wdn64[e])
  assert rel_err(y, ref) < 2e-2


@pytest.mark.parametrize("form", FORMULATIONS)
def test_few_pairs_gradients_match_a_dense_formulation(form):
  """Few pairs (the grouped path; TPU's pair by pair): the gradients (tokens, routing weights,
  both expert stacks, including experts no token picked) equal a one-hot dense formulation's."""
  x, ids, wts, wgu, wdn = (a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                           for a in small_mlp(seed=3, t=2, e=16, k=2))
  probe = jnp.sin(jnp.arange(x.shape[1], dtype=jnp.float32))

  def dense(x, wts, wgu, wdn):
    onehot = jax.nn.one_hot(ids, wgu.shape[0], dtype=jnp.float32)  # [N, k, E]
    h = glu(jnp.einsum("nd,nke,edf->nkf", x, onehot, wgu))
    return jnp.einsum("nk,nkf,nke,efd->nd", wts, h, onehot, wdn)

  loss = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) * probe), argnums=(0, 1, 2, 3))
  got = jax.jit(loss(lambda *a: FORMULATIONS[form](a[0], ids, *a[1:])))(x, wts, wgu, wdn)
  want = jax.jit(loss(dense))(x, wts, wgu, wdn)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_permutation_roundtrip_and_sparse_gradient():
  x, ids, wts, *_ = small_mlp(seed=2)
  xs, gs, order = reference.permute(x, ids, 5)
  assert list(np.asarray(gs)) == list(np.bincount(np.asarray(ids).ravel(), minlength=5))
  flat = np.asarray(ids).ravel()
  assert np.array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
  assert np.array_equal(np.asarray(xs), np.asarray(x)[np.asarray(order) // ids.shape[1]])
  mean = jnp.full(wts.shape, 1.0 / ids.shape[1])
  assert np.array_equal(np.asarray(reference.unpermute(xs, order, mean)), np.asarray(x))

  def loss(x, wts):
    xs, _, order = reference.permute(x, ids, 5)
    return jnp.sum(reference.unpermute(xs * 2, order, wts).astype(jnp.float32))

  jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, wts))
  assert "scatter-add" not in jaxpr and "scatter_add" not in jaxpr
  n_pairs = ids.size
  assert f"[{n_pairs},{x.shape[0]}]" not in jaxpr.replace(" ", "")  # no dense [N*k, N] matrix
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, wts)
  np.testing.assert_allclose(np.asarray(dx, np.float32), 2 * np.asarray(jnp.sum(wts, 1))[:, None]
                             * np.ones(x.shape), rtol=1e-2)


def test_explicit_pallas_gpu_rejects_float32():
  x, w = operands(0, 64, 64, 64, 2)
  with pytest.raises(ValueError, match="bfloat16"):
    moe.gmm(x.astype(jnp.float32), w.astype(jnp.float32), jnp.array([32, 32]),
            implementation="pallas_gpu")


def _lower(backend, platform):
  x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16)
  gs = jax.ShapeDtypeStruct((4,), jnp.int32)

  def f(x, w, gs):
    return jax.grad(lambda x, w: jnp.sum(pallas.gmm(x, w, gs, backend=backend).astype(jnp.float32)),
                    argnums=(0, 1))(x, w)

  return jax.jit(f).trace(x, w, gs).lower(lowering_platforms=(platform,)).as_text()


def test_tpu_lowering():
  with pallas_kernels.target_platform("tpu"):  # the compiled kernels, not interpret
    assert "tpu_custom_call" in _lower("tpu", "tpu")


def test_cuda_lowering(h200_lowering):
  assert "mosaic_gpu" in _lower("gpu", "cuda")


def test_row_tiles_match_python_loop():
  """The row-tile table against a plain loop over groups: empty groups, groups smaller than a
  tile, unaligned group starts and rows past the sum (the zero pseudo-group)."""
  sizes = [0, 150, 3, 0, 33, 1, 260, 0]
  m = 600  # sum 447: rows [447, 600) form the pseudo-group
  for block_m in (64, 128):
    table, count = gpu.row_tiles(jnp.asarray(sizes, jnp.int32), m, block_m)
    expect, start = [], 0
    for g, size in enumerate(sizes + [m - sum(sizes)]):
      first = start // 8 * 8
      r0 = first
      while size and r0 < start + size:  # an empty group has no tiles
        lo = max(r0, start)
        expect.append([min(g, len(sizes) - 1), r0, lo - r0, min(r0 + block_m, start + size) - lo,
                       int(g == len(sizes))])
        r0 += block_m
      start += size
    assert int(count[0]) == len(expect)
    assert np.asarray(table)[:, :len(expect)].T.tolist() == expect


TILINGS = [gpu.Tiles(block_m=128, band=3), gpu.Tiles(block_m=64, block_k=32, steps=3),
           gpu.Tiles(block_m=128, block_n=64, consumers=2, steps=3, band=2)]


@pytest.mark.parametrize("tiles", TILINGS, ids=["m128-band3", "m64-k32", "two-consumers"])
@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["fwd", "dlhs"])
def test_gmm_gpu_tilings_match_numpy(tiles, transpose_rhs):
  """Per-item (interpret) form of other tilings, forward and with rhs read transposed."""
  sizes = (0, 150, 3, 0, 33, 1)
  m, k, n = 208, 128, 128
  x, w = operands(4, m, k, n, len(sizes))
  rhs = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
  out = gpu.gmm(x, rhs, jnp.asarray(sizes, jnp.int32), transpose_rhs=transpose_rhs, config=tiles)
  ref = np_gmm(x, w, sizes)[0]
  assert rel_err(out, ref) < 1e-2
  assert np.all(np.asarray(out[sum(sizes):], np.float32) == 0)


def test_gmm_lowered_for_cuda_is_traced_again_here():
  """``gpu.gmm`` is a jitted function that picks its form (SM count, persistent pipeline,
  interpret mode) from the platform at trace time: lowered for CUDA under
  ``target_platform("gpu")``, it is traced again for this host, not reused."""
  sizes = (0, 150, 3, 0, 33, 1)
  x, w = operands(4, 208, 128, 128, len(sizes))
  gs = jnp.asarray(sizes, jnp.int32)
  with pallas_kernels.target_platform("gpu"):
    assert "mosaic_gpu" in gpu.gmm.trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
  assert rel_err(gpu.gmm(x, w, gs), np_gmm(x, w, sizes)[0]) < 1e-2


def test_default_tiles_fit_and_divide():
  for m, e, k, n in [(32768, 64, 2048, 1024), (65536, 32, 3584, 6144), (32768, 8, 1024, 512),
                     (4096, 256, 448, 192)]:
    tiles = gpu.default_tiles(m, e, k, n)
    tiles.check(k, n)
    assert tiles.block_m == (64 if m < 128 * e else 128)
  with pytest.raises(ValueError, match="does not divide"):
    gpu.Tiles(consumers=2).check(512, 384)


@pytest.mark.parametrize("tiles", [gpu.Tiles(band=8), gpu.Tiles(consumers=2, steps=3, band=4),
                                   gpu.Tiles(block_k=128, steps=3)],
                         ids=["band8", "two-consumers", "k128"])
def test_cuda_lowering_of_tilings(h200_lowering, tiles):
  x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 512, 512), jnp.bfloat16)
  gs = jax.ShapeDtypeStruct((4,), jnp.int32)
  for transpose_rhs in (False, True):
    f = lambda x, w, gs: gpu.gmm(x, w, gs, transpose_rhs=transpose_rhs, config=tiles)  # noqa: E731
    assert "mosaic_gpu" in jax.jit(f).trace(x, w, gs).lower(lowering_platforms=("cuda",)).as_text()
