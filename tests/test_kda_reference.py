"""KDA references: the chunked XLA form against the token recurrence and a float64 NumPy loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kda as kda_ops
from kda_numpy import numpy_kda

B, H, HV, K, V = 2, 1, 2, 32, 16  # grouped values: HV = 2 H


def segments(t, cuts):
  """``[B, T]`` segment ids: row 0 restarts at ``cuts``, row 1 at every 23rd token."""
  ids0 = np.searchsorted(np.asarray(sorted(c for c in cuts if c < t)), np.arange(t), side="right")
  ids1 = np.arange(t) // 23
  return np.stack([ids0, ids1]).astype(np.int32)


# Row 0 restarts inside a chunk (5, 30, 100, 101: a one-token segment), at chunk edges (64, 128)
# and at 16-token sub-tile edges (48, 160).
CUTS = (5, 30, 48, 64, 100, 101, 128, 160)


def raw_inputs(t, dtype=np.float32, seed=0):
  """Unnormalised q, k, raw gate input f, beta logits, A_log, dt_bias and an initial state, as
  NumPy arrays (no eager JAX ops: each would cost a compilation). With dt_bias around -4 most
  channels decay slowly, so the carried state matters across chunks."""
  rng = np.random.default_rng(seed)

  def n(*shape, mean=0.0, std=1.0):
    return (mean + std * rng.standard_normal(shape)).astype(dtype)

  return dict(q=n(B, t, H, K), k=n(B, t, H, K), v=n(B, t, HV, V), g=n(B, t, HV, K),
              beta=n(B, t, HV), A_log=n(HV, std=0.5), dt_bias=n(HV * K, mean=-4.0, std=2.0),
              initial_state=n(B, HV, K, V))


def run_kda(x, impl, gate, segment_ids, chunk_size=64):
  return kda_ops.kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"],
                     dt_bias=x["dt_bias"], initial_state=x["initial_state"],
                     segment_ids=segment_ids, gate=gate, use_qk_l2norm=True, beta_is_logit=True,
                     output_final_state=True, chunk_size=chunk_size, implementation=impl)


@functools.partial(jax.jit, static_argnames=("impl", "gate", "chunk_size"))
def jit_kda(x, segment_ids, impl, gate, chunk_size=64):
  return run_kda(x, impl, gate, segment_ids, chunk_size)


@pytest.mark.parametrize("t, gate", [(200, "bounded")])  # short T: test_kda_backends.py
def test_chunked_equals_naive(t, gate):
  """Two rows segmented differently over several chunks."""
  x = raw_inputs(t, seed=t)
  seg = segments(t, CUTS)
  o_n, s_n = jit_kda(x, seg, impl="naive", gate=gate)
  o_c, s_c = jit_kda(x, seg, impl="chunked", gate=gate)
  assert o_c.shape == (B, t, HV, V) and s_c.shape == (B, HV, K, V)
  np.testing.assert_allclose(o_c, o_n, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(s_c, s_n, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_float64_numpy_loop_agrees(gate):
  t = 70
  with jax.enable_x64(True):
    x = raw_inputs(t, np.float64, seed=11)
    seg = segments(t, CUTS)
    o_n, s_n = jit_kda(x, seg, impl="naive", gate=gate)
    o_c, s_c = jit_kda(x, seg, impl="chunked", gate=gate)
    q, k, g, beta = jax.jit(functools.partial(
        kda_ops.prepare_inputs, use_qk_l2norm=True, gate=gate, lower_bound=-5.0,
        beta_is_logit=True))(
            x["q"], x["k"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"])
    assert o_c.dtype == s_c.dtype == jnp.float64
  o_r, s_r = numpy_kda(q, k, x["v"], g, beta, K ** -0.5, x["initial_state"], np.asarray(seg))
  for got in (o_n, o_c):
    np.testing.assert_allclose(got, o_r, atol=1e-10, rtol=1e-10)
  for got in (s_n, s_c):
    np.testing.assert_allclose(got, s_r, atol=1e-10, rtol=1e-10)


def test_large_softplus_decay_no_segments_no_state():
  """Decays of up to ~1e4 per step (no overflow anywhere in the chunked form), chunks of 32, no
  segment ids, no initial state."""
  x = raw_inputs(40, seed=5)
  x["g"] = 30 * x["g"] + 4
  x["A_log"] = x["A_log"] + 4
  x["initial_state"] = None
  o_n, s_n = jit_kda(x, None, impl="naive", gate="softplus")
  o_c, s_c = jit_kda(x, None, impl="chunked", gate="softplus", chunk_size=32)
  assert np.isfinite(o_c).all() and np.isfinite(s_c).all()
  np.testing.assert_allclose(o_c, o_n, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(s_c, s_n, atol=2e-5, rtol=1e-4)


def test_split_with_carried_state_equals_one_pass():
  t, cut = 90, 45
  x = raw_inputs(t, seed=7)
  seg = segments(t, (20, 64))
  o, s = jit_kda(x, seg, impl="chunked", gate="bounded")
  first = {n: (a[:, :cut] if a.ndim > 1 and a.shape[1] == t else a) for n, a in x.items()}
  second = {n: (a[:, cut:] if a.ndim > 1 and a.shape[1] == t else a) for n, a in x.items()}
  o1, s1 = jit_kda(first, seg[:, :cut], impl="chunked", gate="bounded")
  second["initial_state"] = s1
  o2, s2 = jit_kda(second, seg[:, cut:], impl="chunked", gate="bounded")
  np.testing.assert_allclose(np.concatenate([o1, o2], 1), o, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(s2, s, atol=2e-5, rtol=1e-4)


def test_gradients_chunked_equal_naive():
  """Gradients of every input (incl. A_log, dt_bias through the gate, the initial state). The
  gate is applied before either form, so one gate kind covers both."""
  gate = "bounded"
  t = 40
  with jax.enable_x64(True):
    x = raw_inputs(t, np.float64, seed=13)
    seg = segments(t, (5, 16, 30))
    rng = np.random.default_rng(1)
    w_o, w_s = rng.standard_normal((B, t, HV, V)), rng.standard_normal((B, HV, K, V))

    def loss(x, impl):
      o, s = run_kda(x, impl, gate, seg, chunk_size=16)
      return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_n, g_c = grad(x, "naive"), grad(x, "chunked")
  for name in x:
    assert np.abs(g_n[name]).max() > 0, name
    np.testing.assert_allclose(g_c[name], g_n[name], atol=1e-10, rtol=1e-9, err_msg=name)


def test_bounded_gate_stays_in_range():
  f = np.array([-1e30, -1e4, -15.0, -1.0, 0.0, 1.0, 15.0, 1e4, 1e30], np.float32)
  f = np.broadcast_to(f[:, None, None], (9, 1, 4))
  a_log, dt_bias = np.zeros(1, np.float32), np.zeros(4, np.float32)

  def gate(f):
    return kda_ops.kda_gate(f, a_log, dt_bias, "bounded", -5.0)

  g, grad = jax.jit(lambda f: (gate(f), jax.grad(lambda f: gate(f).sum())(f)))(f)
  assert np.isfinite(g).all() and np.isfinite(grad).all()
  assert (g >= -5.0).all() and (g <= 0.0).all()
  # Where float32 can represent it the bound is strict (sigmoid(|x| > 17) rounds to 0 or 1).
  assert (g[2:7] > -5.0).all() and (g[2:7] < 0.0).all()


def test_decode_slots_equal_naive_rows():
  n_pool, t = 5, 3
  x = raw_inputs(t, seed=17)
  pool = np.random.default_rng(3).standard_normal((n_pool, HV, V, K)).astype(np.float32)
  slots = np.array([3, 0], np.int32)
  kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], gate="softplus", use_qk_l2norm=True,
            beta_is_logit=True)
  o, new_pool = jax.jit(functools.partial(kda_ops.kda_decode, implementation="chunked", **kw))(
      x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots=slots)
  o_ref, s_ref = jax.jit(functools.partial(kda_ops.kda, output_final_state=True,
                                           implementation="naive", **kw))(
      x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool[slots].swapaxes(-1, -2))
  np.testing.assert_allclose(o, o_ref, atol=1e-5, rtol=1e-5)
  new_pool = np.asarray(new_pool)  # K-last: [S, HV, V, K]
  np.testing.assert_allclose(new_pool[slots], np.swapaxes(s_ref, -1, -2), atol=1e-5, rtol=1e-5)
  untouched = np.array([1, 2, 4])
  np.testing.assert_array_equal(new_pool[untouched], pool[untouched])
