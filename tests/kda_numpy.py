"""Independent float64 NumPy references for the KDA tests (SPEC section 2)."""

import numpy as np


def preprocess(q, k, g, beta, *, hv, l2, gate, A_log, dt_bias, lb, beta_logit):
  """The optional L2 norm, gate (``"bounded"``/``"softplus"`` from raw f) and beta sigmoid."""
  q, k, g, beta = (np.asarray(x, np.float64) for x in (q, k, g, beta))
  if l2:
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
  if gate is not None:
    x = g + np.asarray(dt_bias, np.float64).reshape(hv, -1)
    a = np.exp(np.asarray(A_log, np.float64))[:, None]
    g = lb / (1 + np.exp(-a * x)) if gate == "bounded" else -a * np.log1p(np.exp(x))
  if beta_logit:
    beta = 1 / (1 + np.exp(-beta))
  return q, k, g, beta


def numpy_kda(q, k, v, g, beta, scale, s0, segment_ids):
  """Token loop on pre-processed inputs; the state restarts from zero where the segment changes.
  Returns (o ``[B, T, HV, V]``, final state ``[B, HV, K, V]``)."""
  q, k, v, g, beta, s0 = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0))
  b, t, h = q.shape[:3]
  hv = v.shape[2]
  o = np.zeros(v.shape)
  s = s0.copy()
  for bi in range(b):
    for j in range(hv):
      st = s[bi, j]
      for ti in range(t):
        if ti > 0 and segment_ids[bi, ti] != segment_ids[bi, ti - 1]:
          st = np.zeros_like(st)
        kt, qt = k[bi, ti, j * h // hv], q[bi, ti, j * h // hv]
        st = st * np.exp(g[bi, ti, j])[:, None]
        st = st + beta[bi, ti, j] * np.outer(kt, v[bi, ti, j] - kt @ st)
        o[bi, ti, j] = scale * (qt @ st)
      s[bi, j] = st
  return o, s
