"""The KDA case table, its input generator and the check every backend passes: values, final
state and gradients of every input against float64 (the NumPy token loop of ``kda_numpy`` for
values, the token recurrence (``naive``) in float64 for gradients, itself checked against the
NumPy loop's values and central differences)."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from kda_numpy import numpy_kda, preprocess
from pallas_kernels.kda import kda

ORDER = ("q", "k", "v", "g", "beta", "s0", "A_log", "dt_bias")
IMPLEMENTATIONS = ("naive", "chunked", "pallas_gpu", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class Case:
  """One KDA problem: batch 1, T tokens, H query/key heads, HV value heads, head dims K, V."""
  name: str
  t: int
  h: int
  hv: int
  kd: int
  vd: int
  chunk: int
  gate: str | None  # None: g is the log decay itself
  fused: bool  # L2 norm of q, k and the beta sigmoid in the op (else done here)
  cuts: tuple = ()  # segment starts
  lower_bound: float = -5.0
  shift: float = 0.0  # added to the raw gate
  tol: float = 2e-4  # gradients: relative, and absolute of the largest
  cos: float = 0.0  # keys of about this cosine similarity (after the L2 norm), beta near 1
  # (scale, offset) of the raw gate in a quarter of value head 1's channels (saturated gates)
  saturate: tuple | None = None
  slow_decay: bool = False  # dt_bias around -4: most channels decay slowly across chunks
  initial_state: bool = True

  def names(self) -> tuple[str, ...]:
    """The inputs of this case in ``ORDER`` (A_log / dt_bias only with a gate in the op)."""
    return tuple(n for n in ORDER if (n != "s0" or self.initial_state)
                 and (self.gate or n not in ("A_log", "dt_bias")))


CASES = [
    Case("bounded_fused_segments_grouped", 40, 1, 2, 16, 32, 32, "bounded", True, (7, 27)),
    Case("softplus_fused_short", 5, 1, 1, 32, 16, 16, "softplus", True),
    Case("unfused_segments_T37", 37, 2, 2, 16, 16, 16, None, False, (3, 16, 17)),
    # the dense (bounded-gate) path at the production chunk: 4 row blocks, two K slices
    Case("bounded_chunk64_K128_T100", 100, 1, 2, 128, 32, 64, "bounded", True, (30, 64, 65)),
    Case("bounded_chunk64_K64_T1", 1, 1, 1, 64, 16, 64, "bounded", True),
    # the dense path's split kernels at a single 16-row block (T < 16) and with grouped heads,
    # segments and a partial last chunk at chunk 32
    Case("bounded_chunk16_T9_segments", 9, 1, 1, 32, 16, 16, "bounded", True, (4,)),
    Case("bounded_chunk32_grouped_T45", 45, 1, 2, 64, 16, 32, "bounded", True, (1, 31, 32)),
    # the dense path with q, k normalised and beta in (0, 1) by the caller (no fused L2 norm)
    Case("bounded_unfused_l2_chunk64_T70", 70, 1, 1, 64, 16, 64, "bounded", False, (33,)),
    # the gate near its lower bound (most steps below -4.5), so the 32-row reference blocks come
    # near their largest exponents (+-80); a lower bound of -8 takes 16-row blocks. The gate's
    # gradients are then sums of terms e^80 apart: float32 keeps them to ~1e-3
    Case("bounded_saturated_chunk64", 80, 1, 1, 64, 16, 64, "bounded", True, (50,), -5.0, 4.0,
         2e-3),
    Case("bounded_lb8_chunk64", 70, 1, 1, 32, 16, 64, "bounded", True, (20,), -8.0, 3.0, 2e-3),
    # keys of cosine similarity ~0.98, gates near 0 and beta near 1: (I + diag(beta) A_kk) with
    # entries near 1 across the chunk (the inverse's hard case)
    Case("bounded_chunk64_similar_keys", 64, 1, 1, 64, 16, 64, "bounded", True, (), -5.0, -8.0,
         2e-4, 0.98),
    # restarts inside chunks (3, 21) and at a chunk edge (32) of 16; some channels saturate at
    # g = lower_bound or 0, so the TPU fast path's tile exponents reach 16 * 5 = 80
    Case("bounded_saturated_segments_chunk16", 40, 1, 2, 64, 64, 16, "bounded", True,
         (3, 21, 32), tol=1e-4, saturate=(1e3, 0.0), slow_decay=True),
    # the second chunk 6 tokens and 26 padding, a restart at the chunk edge; decays of up to
    # ~1e2 per token (~3e3 in a chunk), which only the safe (general) paths survive
    Case("softplus_large_decay_padded", 38, 1, 2, 64, 64, 32, "softplus", True, (9, 32),
         tol=1e-4, saturate=(30.0, 8.0), slow_decay=True),
    # T < 16, g and beta given directly (no gate, L2 norm or sigmoid in the op)
    Case("unfused_short_T5_no_state", 5, 1, 2, 64, 64, 16, None, False, tol=1e-4,
         initial_state=False),
    # Kimi Linear's gate on the dense kernels' 16-token sub-chunks at the production chunk: four
    # sub-chunks, two K slices, grouped values, restarts inside a chunk and at its edge, an odd
    # T, and a quarter of the channels decaying by ~1e2 per token (no reference but the
    # sub-chunks' keeps their exponents finite)
    Case("softplus_subchunks_chunk64_K128_T77", 77, 1, 2, 128, 32, 64, "softplus", True,
         (30, 64, 65), tol=1e-4, saturate=(30.0, 8.0), slow_decay=True),
    # a precomputed g likewise, and a single token
    Case("unfused_subchunks_chunk64_T83", 83, 1, 2, 64, 16, 64, None, False, (17, 40)),
    Case("softplus_chunk64_T1", 1, 1, 2, 64, 16, 64, "softplus", True),
]


def supports(case: Case, impl: str) -> str | None:
  """Why ``impl`` cannot take ``case`` (None: it can)."""
  if impl == "pallas_tpu" and not (case.kd in (64, 128) and case.vd in (64, 128)):
    return "pallas_tpu takes K, V in (64, 128)"
  return None


def inputs(case: Case) -> tuple[dict, np.ndarray, dict]:
  """(float32 inputs by name as NumPy arrays, segment ids ``[1, T]``, the op's keywords)."""
  r = np.random.default_rng(len(case.name))
  n = lambda *s: r.standard_normal(s).astype(np.float32)
  t, h, hv, kd, vd = case.t, case.h, case.hv, case.kd, case.vd
  x = dict(q=n(1, t, h, kd), k=n(1, t, h, kd), v=n(1, t, hv, vd), g=n(1, t, hv, kd),
           beta=n(1, t, hv), s0=n(1, hv, kd, vd), A_log=0.5 * n(hv), dt_bias=0.5 * n(hv * kd))
  x["g"] += case.shift
  if not case.initial_state:
    x["s0"] = np.zeros_like(x["s0"])
  if case.slow_decay:
    x["dt_bias"] = 4 * x["dt_bias"] - 4.0
  if case.saturate:
    scale, offset = case.saturate
    part = (slice(None), slice(None), min(1, hv - 1), slice(kd // 4))
    x["g"][part] = scale * x["g"][part] + offset
  if case.cos:  # keys of cosine similarity about cos (after the L2 norm), beta near 1
    common = np.random.default_rng(7).standard_normal((1, 1, h, kd)).astype(np.float32)
    x["k"] = np.sqrt(case.cos) * common + np.sqrt(1 - case.cos) * x["k"]
    x["beta"] += 3
  if case.gate is None:  # g is the log decay
    x["g"] = -np.exp(x["g"] - 1.0)
  if not case.fused:  # beta in (0, 1), q/k pre-normalised
    x["beta"] = 1 / (1 + np.exp(-x["beta"]))
    x["q"], x["k"] = (y / np.linalg.norm(y, axis=-1, keepdims=True) for y in (x["q"], x["k"]))
  seg = np.zeros((1, t), np.int32)
  for c in case.cuts:
    seg[:, c:] += 1
  opts = dict(scale=kd ** -0.5, use_qk_l2norm=case.fused, gate=case.gate,
              lower_bound=case.lower_bound, beta_is_logit=case.fused, chunk_size=case.chunk)
  return x, seg, opts


def run(impl, seg, opts, x, **kw):
  """``kda`` with the final state, from the inputs ``x`` by name."""
  return kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x.get("s0"),
             output_final_state=True, segment_ids=seg, A_log=x.get("A_log"),
             dt_bias=x.get("dt_bias"), implementation=impl, **opts, **kw)


def _weights(case):
  """The loss weights of the output and the final state (float64)."""
  shape_o, shape_s = (1, case.t, case.hv, case.vd), (1, case.hv, case.kd, case.vd)
  return (np.random.default_rng(1).standard_normal(shape_o),
          np.random.default_rng(2).standard_normal(shape_s))


@functools.lru_cache(maxsize=None)
def reference(case: Case):
  """float64 (o, final state) of the NumPy loop and the gradients of the loss
  ``sum(o wo) + sum(s ws)`` from the token recurrence in float64, whose values are checked
  against the NumPy loop's and its gradients against a central difference of the NumPy loop
  along a random direction."""
  x, seg, opts = inputs(case)
  wo, ws = _weights(case)

  def np_run(y):
    q, k, g, beta = preprocess(y["q"], y["k"], y["g"], y["beta"], hv=case.hv, l2=case.fused,
                               gate=case.gate, A_log=y["A_log"], dt_bias=y["dt_bias"],
                               lb=case.lower_bound, beta_logit=case.fused)
    return numpy_kda(q, k, y["v"], g, beta, opts["scale"], y["s0"], seg)

  o, s = np_run(x)
  names = case.names()

  def loss(y):
    o_, s_ = run("naive", seg, opts, y)
    return jnp.sum(o_ * wo) + jnp.sum(s_ * ws), (o_, s_)

  with jax.enable_x64(True):
    (_, (o64, s64)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        {m: jnp.asarray(x[m], jnp.float64) for m in names})
    grads = {m: np.asarray(d) for m, d in grads.items()}
  np.testing.assert_allclose(o64, o, rtol=1e-10, atol=1e-10, err_msg=f"{case.name}: naive o")
  np.testing.assert_allclose(s64, s, rtol=1e-10, atol=1e-10, err_msg=f"{case.name}: naive state")
  rng = np.random.default_rng(3)
  dirs = {m: rng.standard_normal(x[m].shape) for m in names}

  def np_loss(eps):
    o_, s_ = np_run({m: x[m] + eps * dirs[m] if m in dirs else x[m] for m in x})
    return (o_ * wo).sum() + (s_ * ws).sum()

  fd = (np_loss(1e-5) - np_loss(-1e-5)) / 2e-5
  ad = sum(float(np.sum(grads[m] * dirs[m])) for m in names)
  assert abs(ad - fd) <= 1e-5 * max(1.0, abs(fd)), (case.name, ad, fd)
  return o, s, grads


# Tolerances of the values (rtol, atol) and gradients (rtol, atol; None: the case's tolerance
# of the largest gradient) of each backend against float64
VALUE_TOL = {"chunked": (1e-4, 2e-5), "pallas_gpu": (1e-4, 1e-4), "pallas_tpu": (1e-4, 2e-5)}
GRAD_TOL = {"pallas_tpu": (1e-4, 5e-5)}


def check(case: Case, impl: str, **kw):
  """Values, final state and every gradient of ``impl`` (``kw`` to ``kda``) against
  :func:`reference`; ``naive``, the reference's own, in float64 there."""
  if impl == "naive":
    reference(case)
    return
  x, seg, opts = inputs(case)
  wo, ws = (w.astype(np.float32) for w in _weights(case))

  def loss(y):
    o, s = run(impl, seg, opts, y, **kw)
    return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)

  (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      {m: jnp.asarray(x[m]) for m in case.names()})
  o_ref, s_ref, g_ref = reference(case)
  chex.assert_shape(o, o_ref.shape)
  chex.assert_shape(s, s_ref.shape)
  chex.assert_type([o, s], jnp.float32)  # o in v's dtype, the state float32
  rtol, atol = VALUE_TOL[impl]
  np.testing.assert_allclose(o, o_ref, rtol=rtol, atol=atol, err_msg="o")
  np.testing.assert_allclose(s, s_ref, rtol=rtol, atol=atol, err_msg="final state")
  for name, want in g_ref.items():
    got = grads[name]
    rtol, atol = GRAD_TOL.get(impl, (case.tol, None))
    atol = case.tol * float(np.abs(want).max()) if atol is None else atol
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"d{name}")
