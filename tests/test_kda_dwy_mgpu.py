"""The Mosaic GPU ``kda_chunk_dwy`` (``pallas_kernels.kda.dwy_mgpu``, ``KdaGpuConfig.chunk_dwy``):
in GPU interpret mode on CPU its outputs against a float64 NumPy loop (segments inside a chunk,
odd T and T = 1, two value heads), the op's bf16 gradients with it beside Triton's, the choice
of kernel, and its CUDA lowering."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_cases import Case, inputs, reference, run
from kda_cases import _weights as weights
from numerics import max_rel_err
from pallas_kernels.kda import chunk_dense, config, dwy_mgpu
from pallas_kernels.kda.chunk_ops import gpu_rounding
from test_kda_a_mgpu import LOWERINGS, lowered

C = dwy_mgpu.CHUNK
HV = 2


def _inputs(seed, t, kd, vd, cut):
  """v, KG, S, dV' (bf16), beta logits, X (unit lower triangular), P_kk (strictly lower) and
  segment ids (a restart at ``cut``) of ``ceil(t / C)`` chunks."""
  rng = np.random.default_rng(seed)
  tp = -(-t // C) * C
  nc = tp // C
  n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  low = lambda a: jnp.tril(a.transpose(0, 2, 1, 3).reshape(1, HV, nc, C, C), -1).reshape(
      1, HV, tp, C).transpose(0, 2, 1, 3)
  bf16 = jnp.bfloat16
  eye = jnp.tile(jnp.eye(C, dtype=jnp.float32), (nc, 1))[None, :, None, :]
  x = low(0.3 * n(1, tp, HV, C)) + eye
  seg = jnp.asarray((np.arange(tp) >= cut)[None], jnp.int32)
  return dict(v=n(1, tp, HV, vd).astype(bf16), kg=n(1, tp, HV, kd).astype(bf16),
              hs=n(1, nc, HV, kd, vd).astype(bf16), dvn=n(1, tp, HV, vd).astype(bf16),
              beta=n(1, tp, HV), x=x, pkk=low(n(1, tp, HV, C)), seg=seg)


def _loop(a, t):
  """float64 (dpkk, dy, dv, dbeta) by chunk (beta a sigmoid of the logits, zero after T)."""
  f64 = lambda y: np.asarray(jnp.asarray(y, jnp.float32), np.float64)
  v, kg, s, dvn, x, pkk = (f64(a[m]) for m in ("v", "kg", "hs", "dvn", "x", "pkk"))
  beta = 1 / (1 + np.exp(-f64(a["beta"])))
  beta[:, t:] = 0.0
  seg = np.asarray(a["seg"])
  _, tp, _, vd = v.shape
  out = [np.zeros((1, tp, HV, C)), np.zeros((1, tp, HV, kg.shape[-1])), np.zeros(v.shape),
         np.zeros((1, tp, HV))]
  for j in range(HV):
    for ci in range(tp // C):
      r = slice(ci * C, (ci + 1) * C)
      sg = seg[0, r]
      cont = (sg == seg[0, max(ci * C - 1, 0)]).astype(float)[:, None]
      strict = (sg[:, None] == sg[None, :]) & np.tri(C, k=-1, dtype=bool)
      b, xc, d = beta[0, r, j][:, None], x[0, r, j], dvn[0, r, j]
      dz = xc.T @ d
      dw = -cont * d @ s[0, ci, j].T
      dy = xc.T @ dw
      dx = d @ (b * v[0, r, j]).T + dw @ (b * kg[0, r, j]).T
      da = np.where(strict, -(xc.T @ dx) @ xc.T, 0.0)
      out[0][0, r, j], out[1][0, r, j], out[2][0, r, j] = b * da, dy, b * dz
      out[3][0, r, j] = ((dz * v[0, r, j]).sum(1) + (dy * kg[0, r, j]).sum(1)
                         + (da * pkk[0, r, j]).sum(1))
  return out


def _cfg(chunk_dwy="mosaic", chunk=C, dtype="bfloat16"):
  return config.KdaOptions(scale=1.0, chunk=chunk, use_qk_l2norm=True, gate="bounded",
                           lower_bound=-5.0, beta_is_logit=True, diag_rows=32, dtype=dtype,
                           tuning=config.KdaGpuConfig(chunk_dwy=chunk_dwy))


@pytest.mark.parametrize("t, kd, vd, cut", [(100, 128, 128, 30), (1, 64, 64, 0), (64, 64, 128, 70)],
                         ids=["T100_segments", "T1", "T64_K64"])
def test_matches_float64(t, kd, vd, cut):
  """Every output against the float64 loop: the bf16 ones (dpkk, dy, dv) to their rounding, the
  float32 dbeta to ~1e-5 (two-part bf16 operands)."""
  a = _inputs(t + kd, t, kd, vd, cut)
  assert dwy_mgpu.supported(_cfg(), a["v"], a["kg"], a["hs"], a["dvn"], a["x"])
  got = chunk_dense.chunk_dwy(_cfg(), a["v"], a["beta"], a["seg"], a["x"], a["pkk"], a["kg"],
                              a["hs"], a["dvn"], t)
  for name, x, want, tol in zip(("dpkk", "dy", "dv", "dbeta"), got, _loop(a, t),
                                (8e-3, 8e-3, 8e-3, 5e-5)):
    if name != "dpkk" or t > 1:  # (one token: no pairs)
      err = max_rel_err(np.asarray(x, np.float32)[:, :t], want[:, :t])
      assert err < tol, (name, err)


@pytest.mark.slow
def test_bf16_gradients_as_triton():
  """bf16 inputs with the matrix units' roundings emulated: every gradient of the op with the
  Mosaic kernel is about as close to float64 (of the float32 inputs) as with Triton's."""
  case = Case("bf16_bounded_chunk64_K128_V128_T70", 70, 1, 1, 128, 128, 64, "bounded", True,
              (20, 64))
  x, seg, opts = inputs(case)
  _, _, want = reference(case)
  wo, ws = (jnp.asarray(w, jnp.float32) for w in weights(case))

  def grads(choice):
    tuning = dataclasses.replace(config.default_config(
        (1, case.t, case.hv, case.vd), use_qk_l2norm=True, beta_is_logit=True), chunk_dwy=choice)

    def loss(y):
      y = {m: y[m].astype(jnp.bfloat16) if m in ("q", "k", "v", "g") else y[m] for m in y}
      o, s = run("pallas_gpu", seg, opts, y, config=tuning)
      return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(s * ws)
    with gpu_rounding():
      return jax.jit(jax.grad(loss))({m: jnp.asarray(x[m]) for m in case.names()})

  ours, theirs = grads("mosaic"), grads("triton")
  for name in case.names():
    err, base = max_rel_err(ours[name], want[name]), max_rel_err(theirs[name], want[name])
    assert err < 1.25 * base + 2e-3, (name, err, base)


def test_the_op_takes_it_where_asked_and_supported(monkeypatch):
  """``chunk_dense.chunk_dwy`` takes the Mosaic kernel with ``chunk_dwy="mosaic"`` for 64-token
  chunks, K and V of 64 or 128 and bf16 operands; Triton's otherwise."""
  calls = []  # which kernel each call traced (spies on both)
  monkeypatch.setattr(dwy_mgpu, "chunk_dwy", lambda *a, **k: calls.append(1) or (None,) * 4)
  monkeypatch.setattr(chunk_dense, "call", lambda *a, **k: calls.append(0) or (None,) * 4)

  def run_one(kd=128, vd=128, chunk=C, dtype=jnp.bfloat16, choice="mosaic"):
    tok = lambda d, dt=dtype: jnp.zeros((1, 128, 2, d), dt)
    states = jnp.zeros((1, 128 // chunk, 2, kd, vd), dtype)
    chunk_dense.chunk_dwy(_cfg(choice, chunk, jnp.dtype(dtype).name), tok(vd), tok(1)[..., 0],
                          jnp.zeros((1, 128), jnp.int32), tok(chunk, jnp.float32),
                          tok(chunk, jnp.float32), tok(kd), states, tok(vd), 100)

  run_one()
  run_one(kd=64, vd=64)
  run_one(kd=256)
  run_one(vd=32)
  run_one(chunk=32)
  run_one(dtype=jnp.float32)
  run_one(choice="triton")
  assert calls == [1, 1, 0, 0, 0, 0, 0]
  with pytest.raises(ValueError, match="chunk_dwy"):
    config.KdaGpuConfig(chunk_dwy="cuda")


@LOWERINGS
def test_lowers_for_cuda(h200_lowering, gate, shape, dtype):
  """The op's backward with ``chunk_dwy="mosaic"`` lowers for an H200 on the CPU with the
  Mosaic kernel in place of Triton's kda_chunk_dwy at the benchmark shape for both gates;
  float32 operands keep Triton's."""
  text = lowered(gate, shape, dtype, chunk_dwy="mosaic")
  assert ("kda_chunk_dwy_mgpu" in text) == (dtype == jnp.bfloat16)
  assert ('name = "kda_chunk_dwy"' in text) == (dtype != jnp.bfloat16)
