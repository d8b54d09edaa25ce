"""The XLA MLA references against NumPy loops: causal and segment masks, paged decode, the merge
of partial attention by log-sum-exps."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import mla_attention, mla_decode, reference


def _np_attention(q, k, v, seg, scale):
  b, t, h, _ = q.shape
  out = np.zeros((b, t, h, v.shape[-1]))
  for bi in range(b):
    for hi in range(h):
      for i in range(t):
        js = [j for j in range(i + 1) if seg is None or seg[bi, j] == seg[bi, i]]
        s = np.array([q[bi, i, hi] @ k[bi, j, hi] * scale for j in js])
        p = np.exp(s - s.max())
        p /= p.sum()
        out[bi, i, hi] = sum(pj * v[bi, j, hi] for pj, j in zip(p, js))
  return out


def test_causal_and_segment_masks():
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 2, 11, 3, 12))
  v = rng.normal(size=(2, 11, 3, 8))
  seg = np.array([[1] * 4 + [2] * 7, [1] * 6 + [5] * 5])
  for s in (None, seg):
    got = mla_attention(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                        segment_ids=None if s is None else jnp.asarray(s), scale=0.3, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), _np_attention(q, k, v, s, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_decode_ragged_lengths_and_page_tables(dtype):
  """Against a float64 loop; bf16 inputs (XLA's CPU runtime has no bf16 x bf16 -> f32 batched
  dot: several rows used to fail there) within bf16 rounding of the output."""
  rng = np.random.default_rng(1)
  r, dr, h, ps = 8, 4, 2, 4
  cache = np.asarray(jnp.asarray(rng.normal(size=(10, ps, r + dr)), dtype), np.float64)
  table = np.array([[7, 2, 9], [0, 5, 1]])
  lengths = np.array([11, 5])
  tn = 2
  q = np.asarray(jnp.asarray(rng.normal(size=(2, tn, h, r + dr)), dtype), np.float64)
  got = np.asarray(mla_decode(jnp.asarray(q, dtype), jnp.asarray(cache, dtype), jnp.asarray(table),
                              jnp.asarray(lengths), kv_lora_rank=r, scale=0.5, implementation="xla"),
                   np.float64)
  tol = 1e-5 if dtype == "float32" else 1e-2
  for n in range(2):
    kv = np.concatenate([cache[p] for p in table[n]])
    for i in range(tn):
      pos = lengths[n] - tn + i
      for hi in range(h):
        s = kv[:pos + 1] @ q[n, i, hi] * 0.5
        p = np.exp(s - s.max())
        p /= p.sum()
        np.testing.assert_allclose(got[n, i, hi], p @ kv[:pos + 1, :r], rtol=tol, atol=tol)


@pytest.mark.parametrize("base2", [False, True])
def test_merge_partials_and_its_log_sum_exp(base2):
  """Parts merged by their log-sum-exps (float32) against a float64 loop: each row's weights
  ``b**(lse_i - L)`` with ``L = log_b sum_i b**lse_i``; a part that sees no key (``-inf``) adds
  nothing, a row no part sees gives zeros and ``-inf``."""
  rng = np.random.default_rng(5)
  o = rng.normal(size=(3, 4, 6, 8))  # parts along axis 1
  lse = rng.normal(size=(3, 4, 6)) * 3
  lse[0, 1, 2] = -np.inf
  lse[1, :, 4] = -np.inf
  got_o, got_lse = reference.merge_partials(jnp.asarray(o), jnp.asarray(lse), 1, base2=base2,
                                            return_lse=True)
  b = 2.0 if base2 else np.e
  want_o, want_lse = np.zeros((3, 6, 8)), np.full((3, 6), -np.inf)
  for i in range(3):
    for r in range(6):
      seen = np.isfinite(lse[i, :, r])
      if seen.any():
        want_lse[i, r] = np.log(sum(b ** lse[i, p, r] for p in np.flatnonzero(seen))) / np.log(b)
        for p in np.flatnonzero(seen):
          want_o[i, r] += b ** (lse[i, p, r] - want_lse[i, r]) * o[i, p, r]
  np.testing.assert_allclose(np.asarray(got_lse), want_lse, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got_o), want_o, rtol=1e-5, atol=1e-6)
  assert np.isneginf(np.asarray(got_lse)[1, 4]) and not np.asarray(got_o)[1, 4].any()
