"""``kda(..., output_states_every=M)``: the recurrent states at every M-th chunk boundary from
the chunked forward (serving's prefix cache), against the float64 NumPy loop run up to each
boundary, on every implementation that has it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kda_cases import Case, inputs
from kda_numpy import numpy_kda, preprocess
from pallas_kernels.kda import kda

# grouped values, restarts inside a chunk and at a chunk edge, an initial state, odd T
CASES = [Case("softplus_states", 77, 1, 2, 32, 16, 16, "softplus", True, (5, 32)),
         Case("precomputed_g_states", 50, 2, 2, 16, 16, 16, None, False, (20,))]


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _run(case, impl, every):
  x, seg, opts = inputs(case)
  return jax.jit(lambda y: kda(
      y["q"], y["k"], y["v"], y["g"], y["beta"], initial_state=y["s0"], output_final_state=True,
      segment_ids=seg, A_log=y.get("A_log"), dt_bias=y.get("dt_bias"), implementation=impl,
      output_states_every=every, **opts))(x)


def _want(case, upto):
  """float64 state after the first ``upto`` tokens (the NumPy loop)."""
  x, seg, opts = inputs(case)
  q, k, g, beta = preprocess(x["q"], x["k"], x["g"], x["beta"], hv=case.hv, l2=case.fused,
                             gate=case.gate, A_log=x["A_log"], dt_bias=x["dt_bias"],
                             lb=case.lower_bound, beta_logit=case.fused)
  cut = lambda a: a[:, :upto]
  return numpy_kda(cut(q), cut(k), cut(x["v"]), cut(g), cut(beta), opts["scale"], x["s0"],
                   cut(seg))[1]


@pytest.mark.parametrize("impl", ["naive", "chunked", "pallas_gpu"])
@pytest.mark.parametrize("case, every", [(CASES[0], 2), (CASES[1], 1)],
                         ids=["softplus_every2", "precomputed_g_every1"])
def test_states_match_float64(case, impl, every):
  """State m is the state after token (m + 1) M C, for every whole boundary inside T; the output
  and final state are those of the call without states."""
  o, s, states = _run(case, impl, every)
  span = every * case.chunk
  assert states.shape == (1, case.t // span, case.hv, case.kd, case.vd)
  assert states.dtype == jnp.float32
  for m in range(states.shape[1]):
    np.testing.assert_allclose(states[:, m], _want(case, (m + 1) * span), rtol=1e-4, atol=1e-4,
                               err_msg=f"state {m}")
  o_ref, s_ref = _run(case, impl, None)
  np.testing.assert_allclose(o, o_ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(s, s_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["naive", "chunked", "pallas_gpu"])
def test_no_whole_boundary_gives_no_states(impl):
  """T = 1 and T shorter than M chunks: no states, the final state as usual."""
  for t, every in ((1, 1), (40, 3)):
    case = dataclasses.replace(CASES[0], t=t, cuts=())
    _, s, states = _run(case, impl, every)
    assert states.shape == (1, 0, case.hv, case.kd, case.vd)
    np.testing.assert_allclose(s, _want(case, t), rtol=1e-4, atol=1e-4)


def test_chunked_states_are_differentiable():
  """The XLA chunked path's states carry gradients (a scan of scans): they match the token
  recurrence's."""
  case = CASES[1]
  x, seg, opts = inputs(case)
  w = jnp.asarray(np.random.default_rng(5).standard_normal((1, 3, case.hv, case.kd, case.vd)),
                  jnp.float32)

  def grad(impl):
    def loss(v):
      return jnp.sum(kda(x["q"], x["k"], v, x["g"], x["beta"], segment_ids=seg,
                         implementation=impl, output_states_every=1, **opts)[2] * w)
    return jax.jit(jax.grad(loss))(jnp.asarray(x["v"]))

  np.testing.assert_allclose(grad("chunked"), grad("naive"), rtol=1e-4, atol=1e-5)


def test_bad_uses_are_rejected():
  case = CASES[1]
  with pytest.raises(ValueError, match="output_states_every"):
    _run(case, "chunked", 0)
  with pytest.raises(ValueError, match="pallas_tpu"):
    _run(case, "pallas_tpu", 1)
  x, seg, opts = inputs(case)
  loss = lambda v: jnp.sum(kda(x["q"], x["k"], v, x["g"], x["beta"], implementation="pallas_gpu",
                               output_states_every=1, **opts)[0])
  with pytest.raises(ValueError, match="forward only"):
    jax.grad(loss)(jnp.asarray(x["v"]))


def test_states_lower_for_cuda(h200_lowering):
  """The forward pass that writes the states (Triton's) lowers for an H200 (bf16, K = 128)."""
  b, t, h, kd = 1, 300, 2, 128
  sd = jax.ShapeDtypeStruct
  f = lambda q, k, v, g, beta: kda(q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.zeros(h),
                                   dt_bias=jnp.zeros(h * kd), gate="softplus", beta_is_logit=True,
                                   implementation="pallas_gpu", output_states_every=2)
  args = [sd((b, t, h, kd), jnp.bfloat16)] * 4 + [sd((b, t, h), jnp.bfloat16)]
  lowered = jax.jit(f).trace(*args)
  assert lowered.out_info[2].shape == (b, t // 128, h, kd, kd)
  text = lowered.lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "kda_fwd_recurrence"' in text
