"""What only the Pallas TPU KDA kernel has (TPU interpret mode on CPU): bf16 inputs with a float32
state, its head-dim check and its TPU lowering. Values and gradients on the shared cases:
``test_kda_backends.py``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda as kda_ops
from pallas_kernels.kda import tpu

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
