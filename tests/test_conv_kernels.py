"""Causal short conv + SiLU (pallas_kernels.conv): the XLA reference and the Pallas GPU kernels
(interpret mode on CPU) against an independent float64 NumPy loop, values and gradients; equality
with ``k3jax.kda.short_conv``; input checks; the kernels' Triton lowering for an H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err

from k3jax.kda import short_conv
from pallas_kernels import conv
from pallas_kernels.conv import gpu


def np_conv(x, w, seg, dy):
  """Float64 loop: y = silu(z), dx and dw of sum(y * dy). x [B, T, C], w [W, C], seg [B, T]."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  bsz, t, _ = x.shape
  width = w.shape[0]
  z = np.zeros_like(x)
  pairs = []  # (b, output t, source u, tap j)
  for b in range(bsz):
    for i in range(t):
      for j in range(width):
        u = i - (width - 1 - j)
        if u >= 0 and (seg is None or seg[b, u] == seg[b, i]):
          pairs.append((b, i, u, j))
  for b, i, u, j in pairs:
    z[b, i] += w[j] * x[b, u]
  sig = 1 / (1 + np.exp(-z))
  dz = dy * sig * (1 + z * (1 - sig))
  dx, dw = np.zeros_like(x), np.zeros_like(w)
  for b, i, u, j in pairs:
    dx[b, u] += w[j] * dz[b, i]
    dw[j] += x[b, u] * dz[b, i]
  return z * sig, dx, dw


def packed_segments(t, starts):
  """[2, T] int32 ids: row 0 starts documents at ``starts``, row 1 is one document."""
  row = np.zeros(t, np.int32)
  for s in starts:
    row[s:] += 1
  return jnp.asarray(np.stack([row + 7, np.zeros(t, np.int32)]))


def operands(seed, t, c, width, dtype):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (2, t, c), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (width, c), jnp.float32) / np.sqrt(width)).astype(dtype)
  dy = jax.random.normal(kd, (2, t, c), jnp.float32).astype(dtype)
  return x, w, dy


# (T, C, W, dtype, document starts in batch row 0 or None): T=1; T not a multiple of the 64 /
# 16-row tiles with documents starting inside a tile (19, 70) and one of length 1 (45);
# C not a multiple of the 128-channel tile; W=2.
CASES = [
    (1, 128, 4, jnp.float32, None),
    (83, 160, 4, jnp.bfloat16, (19, 45, 46, 70)),
    (83, 128, 4, jnp.float32, (19, 45, 46, 70)),
    (40, 96, 2, jnp.float32, (3, 4, 21)),
]
IDS = ["T1", "T83_bf16_docs", "T83_f32_docs", "W2_docs"]


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_values_and_grads_match_numpy(case, impl):
  t, c, width, dtype, starts = case
  x, w, dy = operands(t + c + width, t, c, width, dtype)
  seg = None if starts is None else packed_segments(t, starts)
  f = jax.jit(lambda x, w: jax.vjp(
      lambda x, w: conv.causal_conv_silu(x, w, seg, implementation=impl), x, w))
  y, vjp = f(x, w)
  dx, dw = vjp(dy)
  assert y.dtype == dx.dtype == dtype and dw.dtype == dtype
  ry, rdx, rdw = np_conv(x, w, None if seg is None else np.asarray(seg), dy)
  tol = 1e-5 if dtype == jnp.float32 else 8e-3
  for name, got, want in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw)):
    assert rel_err(got, want) < tol, (name, rel_err(got, want))


@pytest.mark.parametrize("width", [4, 1])
def test_small_tiles_cross_program_boundaries(width):
  """Several programs along T and C in both kernels (documents crossing them, a partial last
  tile each way, halo rows read from the neighbouring programs' rows), loads of 4 and 2 rows at
  a time: dw partials summed; and a single tap (no halo)."""
  t, c = 83, 100
  x, w, dy = operands(5, t, c, width, jnp.float32)
  seg = packed_segments(t, (15, 16, 33, 60))
  cfg = gpu.Config(rows=16, bc=32, bwd_rows=16, bwd_bc=64, unroll=4, bwd_unroll=2)
  y, vjp = jax.vjp(lambda x, w: gpu.causal_conv_silu(x, w, seg, cfg), x, w)
  for name, got, want in zip(("y", "dx", "dw"), (y, *vjp(dy)), np_conv(x, w, np.asarray(seg), dy)):
    assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))


@pytest.mark.parametrize("case", CASES[1:3], ids=IDS[1:3])
def test_short_conv_routes_agree(case):
  """``short_conv``'s two routes: the fused op (no tail; each implementation) against the XLA
  form over an explicit zero tail (segment ids keep taps out of the tail either way)."""
  t, c, width, dtype, starts = case
  x, w, _ = operands(1, t, c, width, dtype)
  seg = packed_segments(t, starts)
  tail = jnp.zeros((2, width - 1, c), dtype)
  want = np.asarray(short_conv(x, w, seg, tail)[0], np.float64)
  ulp = 1e-6 if dtype == jnp.float32 else 8e-3
  for impl in ("xla", "pallas_gpu"):
    got = np.asarray(short_conv(x, w, seg, implementation=impl)[0], np.float64)
    np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp, err_msg=impl)


def test_bad_shapes_raise():
  x = jnp.ones((2, 8, 16), jnp.float32)
  with pytest.raises(ValueError, match="same C"):
    conv.causal_conv_silu(x, jnp.ones((4, 32), jnp.float32))
  with pytest.raises(ValueError, match="segment_ids"):
    conv.causal_conv_silu(x, jnp.ones((4, 16), jnp.float32), jnp.zeros((2, 9), jnp.int32))
  with pytest.raises(ValueError, match="unknown implementation"):
    conv.causal_conv_silu(x, jnp.ones((4, 16), jnp.float32), implementation="cuda")


def test_resolve():
  assert conv.resolve(None) == "xla"  # CPU
  assert conv.resolve("pallas") == "pallas_gpu"
  import pallas_kernels
  with pallas_kernels.target_platform("tpu"):
    assert conv.resolve("pallas") == "xla" and conv.resolve(None) == "xla"
  # None's default follows the target too (on this CPU host it is "xla" either way without it)
  with pallas_kernels.target_platform("gpu"):
    assert conv.resolve(None) == "pallas_gpu"


@pytest.mark.parametrize("c,segmented", [(1024, True), (160, False)], ids=["C1024_seg", "C160"])
def test_lowers_for_cuda(h200_lowering, c, segmented):
  """Forward and backward kernels through Pallas' Triton path for an H200, without a GPU, at the
  benchmark shape (inputs as shapes only) and with a partial channel tile."""
  x = jax.ShapeDtypeStruct((16, 4096, c), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, c), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((16, 4096), jnp.int32) if segmented else None
  f = lambda x, w, s: conv.causal_conv_silu(x, w, s, implementation="pallas_gpu")
  loss = lambda x, w, s: jnp.sum(f(x, w, s).astype(jnp.float32))
  text = jax.jit(f).trace(x, w, seg).lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "conv_silu_fwd"' in text
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w, seg).lower(
      lowering_platforms=("cuda",)).as_text()
  assert 'name = "conv_silu_bwd"' in text
