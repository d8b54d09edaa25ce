"""Pallas TPU KDA kernel in TPU interpret mode against the references, and its TPU lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda as kda_ops
from pallas_kernels.kda import tpu
from kda_numpy import numpy_kda

B, H, HV, K, V = 1, 1, 2, 64, 64  # grouped values: HV = 2 H


def inputs(t, seed, dtype=np.float32):
  """Raw kernel inputs as NumPy arrays (A_log, dt_bias float32); dt_bias around -4 keeps most
  channels slowly decaying, so state carried across chunks matters."""
  rng = np.random.default_rng(seed)

  def n(*shape, mean=0.0, std=1.0, dt=dtype):
    return (mean + std * rng.standard_normal(shape)).astype(dt)

  return dict(q=n(B, t, H, K), k=n(B, t, H, K), v=n(B, t, HV, V), g=n(B, t, HV, K),
              beta=n(B, t, HV), A_log=n(HV, std=0.5, dt=np.float32),
              dt_bias=n(HV * K, mean=-4.0, std=2.0, dt=np.float32),
              initial_state=n(B, HV, K, V, dt=np.float32))


def segment_ids(t, cuts):
  return np.searchsorted(np.asarray(cuts), np.arange(t), side="right")[None].astype(np.int32)


def run(x, seg, impl, gate, chunk_size):
  fused = gate is not None
  return kda_ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x.get("A_log"),
                     dt_bias=x.get("dt_bias"), initial_state=x.get("initial_state"),
                     segment_ids=seg, gate=gate, use_qk_l2norm=fused, beta_is_logit=fused,
                     output_final_state=True, chunk_size=chunk_size, implementation=impl)


def check(x, seg, gate, chunk_size, grads=True):
  """Kernel vs naive, chunked and the float64 loop: outputs, final state and all gradients."""
  fwd = {impl: jax.jit(functools.partial(run, seg=seg, impl=impl, gate=gate,
                                         chunk_size=chunk_size))(x)
         for impl in ("pallas_tpu", "naive", "chunked")}
  o, s = fwd["pallas_tpu"]
  assert o.dtype == x["v"].dtype and s.dtype == jnp.float32
  for impl in ("naive", "chunked"):
    np.testing.assert_allclose(o, fwd[impl][0], atol=2e-5, rtol=1e-4, err_msg=impl)
    np.testing.assert_allclose(s, fwd[impl][1], atol=2e-5, rtol=1e-4, err_msg=impl)
  if gate is None:
    q, k, g, beta = x["q"], x["k"], x["g"], x["beta"]
  else:
    q, k, g, beta = jax.jit(functools.partial(
        kda_ops._prepare, use_qk_l2norm=True, gate=gate, lower_bound=-5.0, beta_is_logit=True))(
            x["q"], x["k"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"])
  s0 = x.get("initial_state", np.zeros((B, HV, K, V)))
  seg_np = np.zeros(q.shape[:2], int) if seg is None else np.asarray(seg)
  o_r, s_r = numpy_kda(q, k, x["v"], g, beta, K ** -0.5, s0, seg_np)
  np.testing.assert_allclose(o, o_r, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(s, s_r, atol=2e-5, rtol=1e-4)
  if not grads:
    return
  rng = np.random.default_rng(1)
  w_o, w_s = rng.standard_normal(o.shape, np.float32), rng.standard_normal(s.shape, np.float32)

  def loss(x, impl):
    o, s = run(x, seg, impl, gate, chunk_size)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s)

  g_k = jax.jit(jax.grad(functools.partial(loss, impl="pallas_tpu")))(x)
  g_n = jax.jit(jax.grad(functools.partial(loss, impl="naive")))(x)
  for name in x:
    assert np.abs(g_n[name]).max() > 0, name
    np.testing.assert_allclose(g_k[name], g_n[name], atol=5e-5, rtol=1e-4, err_msg=name)


def saturate(x, values):
  """Replaces the gate input of a quarter of value head 1's channels by ``values(f)``."""
  x["g"][:, :, 1, :K // 4] = values(x["g"][:, :, 1, :K // 4])
  return x


def test_bounded_fast_path_segments_in_and_at_chunk_edges():
  """T=40 in chunks of 16: restarts inside chunks (3, 21) and at a chunk edge (32). Some channels
  saturate at g = lower_bound or 0, so fast-path tile exponents reach 16 * 5 = 80."""
  t = 40
  x = saturate(inputs(t, seed=0), lambda f: 1e3 * f)
  check(x, segment_ids(t, [3, 21, 32]), "bounded", chunk_size=16)


def test_softplus_safe_path_padded_chunk():
  """T=70 in chunks of 64 (the second chunk: 6 tokens, 58 padding); restarts at 9 and at the
  chunk edge 64. Some channels decay by up to ~1e2 per token: cumulative decays of ~1e4 in a
  chunk, which only the safe path survives."""
  t = 70
  x = saturate(inputs(t, seed=1), lambda f: 30 * f + 8)  # decays up to ~1e2 per token
  check(x, segment_ids(t, [9, 64]), "softplus", chunk_size=64)


def test_short_sequence_unfused_inputs():
  """T=5 < 16 with g and beta given directly (no gate, L2 norm or sigmoid in the kernel), no
  initial state, no segments."""
  x = inputs(5, seed=2)
  x = dict(q=x["q"] / np.linalg.norm(x["q"], axis=-1, keepdims=True),
           k=x["k"] / np.linalg.norm(x["k"], axis=-1, keepdims=True), v=x["v"],
           g=-np.logaddexp(x["g"] - 3, 0), beta=1 / (1 + np.exp(-x["beta"])))
  check(x, None, None, chunk_size=16)


def test_bf16_inputs_float32_state():
  t = 20
  x = inputs(t, seed=3, dtype=jnp.bfloat16)
  seg = segment_ids(t, [11])
  o, s = jax.jit(functools.partial(run, seg=seg, impl="pallas_tpu", gate="bounded",
                                   chunk_size=16))(x)
  o_r, s_r = jax.jit(functools.partial(run, seg=seg, impl="chunked", gate="bounded",
                                       chunk_size=16))(x)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_r, np.float32), atol=2e-2,
                             rtol=2e-2)
  np.testing.assert_allclose(s, s_r, atol=2e-2, rtol=2e-2)


def test_bad_head_dim_is_rejected():
  x = inputs(4, seed=4)
  with pytest.raises(ValueError, match="head dims"):
    tpu.kda(x["q"][..., :32], x["k"][..., :32], x["v"], x["g"][..., :32], x["beta"],
            scale=1.0, initial_state=None, segment_ids=None, use_qk_l2norm=False, A_log=None,
            dt_bias=None, gate=None, lower_bound=-5.0, beta_is_logit=False, chunk_size=64)


@pytest.mark.parametrize("gate, d", [("bounded", 128), ("softplus", 128), ("bounded", 64)])
def test_lowers_for_tpu(gate, d):
  """Forward and backward lower for TPU: bf16 inputs, K = V = d, grouped values, segments."""
  b, t, h, hv = 1, 200, 2, 4
  sd = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  args = (sd((b, t, h, d), bf), sd((b, t, h, d), bf), sd((b, t, hv, d), bf), sd((b, t, hv, d), bf),
          sd((b, t, hv), bf), sd((hv,), jnp.float32), sd((hv * d,), jnp.float32),
          sd((b, hv, d, d), jnp.float32), sd((b, t), jnp.int32))

  def f(q, k, v, g, beta, a_log, dt_bias, s0, seg):
    o, s = tpu.kda(q, k, v, g, beta, scale=d ** -0.5, initial_state=s0, segment_ids=seg,
                   use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias, gate=gate,
                   lower_bound=-5.0, beta_is_logit=True, chunk_size=64, interpret=False)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

  for fn in (f, jax.grad(f, argnums=tuple(range(8)))):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
