"""The Mosaic GPU WY-factor kernel of the chunked KDA (``pallas_kernels.kda.wu_mgpu``), in GPU
interpret mode on CPU, against float64 NumPy (the exact inverse, W and U from its bf16-rounded
``X diag(beta)``); its CUDA lowering; and its use by the op."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numerics import max_rel_err
from pallas_kernels.kda import chunk_dense, chunk_ops, config, wu_mgpu

C = wu_mgpu.CHUNK
BF16 = jnp.bfloat16


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _keys(rng, b, tp, hv, kd, cos):
  """Unit-norm keys ``[B, Tp, HV, K]`` whose pairs have cosine similarity about ``cos``."""
  common = rng.normal(size=(b, 1, hv, kd))
  k = np.sqrt(cos) * common + np.sqrt(1 - cos) * rng.normal(size=(b, tp, hv, kd))
  return k / np.linalg.norm(k, axis=-1, keepdims=True)


def _pkk(k, seg, decay):
  """P_kk ``[B, Tp, HV, C]``: k_i . k_j e^(G_i - G_j) for j < i in one chunk and segment, with
  per-channel decays ``decay`` ``[B, Tp, HV, K]`` in (0, 1]."""
  b, tp, hv, _ = k.shape
  pkk = np.zeros((b, tp, hv, C))
  for ci in range(tp // C):
    r = slice(ci * C, (ci + 1) * C)
    gcum = np.cumsum(np.log(decay[:, r]), axis=1)
    prod = np.einsum("bihk,bjhk->bihj", k[:, r] * np.exp(gcum), k[:, r] * np.exp(-gcum))
    same = seg[r][:, None] == seg[r][None, :]
    pkk[:, r] = np.where(np.tril(same, -1)[None, :, None, :], prod, 0.0)
  return pkk


def _inputs(seed, b, nc, hv, kd, vd, cuts, cos):
  """Keys of cosine similarity ``cos`` with decays in (0.99, 1), so P_kk has entries near
  ``cos`` and every level of the inverse matters; segments start at ``cuts`` (P_kk zero across
  them, cont 0 after the first in a chunk)."""
  rng = np.random.default_rng(seed)
  tp = nc * C
  seg = np.zeros(tp, int)
  for cut in cuts:
    seg[cut:] += 1
  k = _keys(rng, b, tp, hv, kd, cos)
  pkk = _pkk(k, seg, rng.uniform(0.99, 1.0, size=k.shape))
  kg = jnp.asarray(rng.normal(size=(b, tp, hv, kd)) * 0.5, BF16)
  v = jnp.asarray(rng.normal(size=(b, tp, hv, vd)), BF16)
  beta = rng.uniform(0.5, 1.0, size=(b, hv, tp))
  prev = seg[np.maximum(np.arange(tp) // C * C - 1, 0)]
  cont = np.broadcast_to((seg == prev).astype(np.float64), (b, tp))
  return pkk, kg, v, beta, cont


def _loop(pkk, kg, v, beta, cont):
  """float64 X = (I + diag(beta) P_kk)^-1, W = cont * bf16(X diag(beta)) KG, U = ... v."""
  kg, v = _f64(kg), _f64(v)
  b, tp, hv, _ = kg.shape
  x, w, u = np.zeros_like(pkk), np.zeros_like(kg), np.zeros_like(v)
  for bi in range(b):
    for hi in range(hv):
      for ci in range(tp // C):
        r = slice(ci * C, (ci + 1) * C)
        xc = np.linalg.inv(np.eye(C) + beta[bi, hi, r][:, None] * pkk[bi, r, hi])
        xb = _f64(jnp.asarray(xc * beta[bi, hi, r][None, :], jnp.float32).astype(BF16))
        x[bi, r, hi] = xc
        w[bi, r, hi] = cont[bi, r][:, None] * (xb @ kg[bi, r, hi])
        u[bi, r, hi] = xb @ v[bi, r, hi]
  return x, w, u


def _err(got, want):
  return max_rel_err(_f64(got), want)


# (batch, chunks, value heads, K, V, segment starts, key similarity): K 64 and 128, V down to 32,
# two segments inside the second chunk (P_kk block diagonal, cont zero after the cut), keys
# independent and nearly parallel
@pytest.mark.slow
@pytest.mark.parametrize("b,nc,hv,kd,vd,cuts,cos", [
    (1, 1, 1, 64, 128, (), 0.0), (2, 2, 2, 128, 32, (70, 100), 0.95)])
def test_matches_float64(b, nc, hv, kd, vd, cuts, cos):
  pkk, kg, v, beta, cont = _inputs(kd + vd, b, nc, hv, kd, vd, cuts, cos)
  x_want, w_want, u_want = _loop(pkk, kg, v, beta, cont)
  args = (jnp.asarray(pkk, jnp.float32), kg, v, jnp.asarray(beta, jnp.float32),
          jnp.asarray(cont, jnp.float32))
  # split-bf16 products keep about 16 bits (one bf16 product per level errs by ~1e-4 to 1e-3),
  # float16 products 11 (TF32's rounding: 1e-4 to 8e-4)
  for split, tol in ((True, 3e-5), (False, 1.5e-3)):
    w, u, x = wu_mgpu.chunk_wu(*args, keep=True, split=split, interpret=True)
    assert _err(x, x_want) < tol, (split, _err(x, x_want))
    assert _err(w, w_want) < 8e-3 and _err(u, u_want) < 8e-3  # bf16 results
    w2, u2 = wu_mgpu.chunk_wu(*args, keep=False, split=split, interpret=True)
    np.testing.assert_array_equal(np.asarray(w2, np.float32), np.asarray(w, np.float32))
    np.testing.assert_array_equal(np.asarray(u2, np.float32), np.asarray(u, np.float32))


@pytest.mark.parametrize("c", [16, 64])
def test_triton_inverse_is_stable_for_similar_keys(c):
  """``chunk_ops.lower_inverse`` (float32 products) within 1e-5 of the float64 inverse for keys of
  cosine similarity 0.99 without decay (beta 1): the powers of A reach ~1e17 here, and the
  former nilpotent series lost 7e-4 in float32 (and everything in TF32)."""
  rng = np.random.default_rng(c)
  k = _keys(rng, 1, c, 1, 128, 0.99)
  a = np.tril(k[0, :, 0] @ k[0, :, 0].T, -1)
  want = np.linalg.inv(np.eye(c) + a)
  with jax.default_matmul_precision("highest"):
    got = chunk_ops.lower_inverse(jnp.asarray(a, jnp.float32), c)
  assert _err(got, want) < 1e-5, _err(got, want)


def test_lowers_for_cuda():
  """At the benchmark shape (B1 T16384 HV32 K=V=128, both precisions) and the narrowest K and
  V, with and without X, lowered for an H200 on the CPU (layout inference, register operands,
  SMEM)."""
  sds = jax.ShapeDtypeStruct
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    for b, tp, hv, kd, vd, keep, split in ((1, 16384, 32, 128, 128, True, False),
                                           (1, 16384, 32, 128, 128, True, True),
                                           (2, 128, 2, 16, 32, False, False)):
      args = (sds((b, tp, hv, C), jnp.float32), sds((b, tp, hv, kd), BF16),
              sds((b, tp, hv, vd), BF16), sds((b, hv, tp), jnp.float32),
              sds((b, tp), jnp.float32))
      fn = lambda *a: wu_mgpu.chunk_wu(*a, keep=keep, split=split, interpret=False)
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert "kda_chunk_wu_mgpu" in text


def test_the_op_takes_it_where_supported(monkeypatch, h200_lowering):
  """``chunk_dense.chunk_wu`` takes the Mosaic kernel for bf16 64-token chunks with K, V <= 128
  on a Hopper GPU (or in interpret mode), Triton's otherwise or with ``chunk_wu="triton"``."""
  calls = []  # which kernel each call traced (spies on both)
  monkeypatch.setattr(wu_mgpu, "chunk_wu", lambda *a, **k: calls.append(1) or (None,) * 2)
  monkeypatch.setattr(chunk_dense, "call", lambda *a, **k: calls.append(0) or (None,) * 2)
  hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0", core_count=132)
  tok = lambda d, dt=BF16: jnp.zeros((1, 128, 2, d), dt)
  beta, seg = jnp.zeros((1, 128, 2), BF16), jnp.zeros((1, 128), jnp.int32)

  def run(kd, device=hopper, **changes):
    tuning = dataclasses.replace(config.default_config(tok(128).shape, device=device), **changes)
    cfg = config.KdaOptions(scale=1.0, chunk=64, use_qk_l2norm=True, gate="bounded",
                            lower_bound=-5.0, beta_is_logit=True, diag_rows=32, dtype="bfloat16",
                            tuning=tuning)
    chunk_dense.chunk_wu(cfg, tok(64, jnp.float32), tok(kd), tok(128), beta, seg, 100, False)

  run(128)
  run(256)  # K 256
  run(128, chunk_wu="triton")
  run(128, device=types.SimpleNamespace(platform="gpu", compute_capability="8.0"))
  assert calls == [1, 0, 0, 0]
