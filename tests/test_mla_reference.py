"""The XLA MLA references against NumPy loops: causal and segment masks, paged decode."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels.mla import mla_attention, mla_decode


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


def test_paged_decode_ragged_lengths_and_page_tables():
  rng = np.random.default_rng(1)
  r, dr, h, ps = 8, 4, 2, 4
  cache = rng.normal(size=(10, ps, r + dr))
  table = np.array([[7, 2, 9], [0, 5, 1]])
  lengths = np.array([11, 5])
  tn = 2
  q = rng.normal(size=(2, tn, h, r + dr))
  got = np.asarray(mla_decode(jnp.asarray(q, jnp.float32), jnp.asarray(cache, jnp.float32), jnp.asarray(table),
                              jnp.asarray(lengths), kv_lora_rank=r, scale=0.5, implementation="xla"))
  for n in range(2):
    kv = np.concatenate([cache[p] for p in table[n]])
    for i in range(tn):
      pos = lengths[n] - tn + i
      for hi in range(h):
        s = kv[:pos + 1] @ q[n, i, hi] * 0.5
        p = np.exp(s - s.max())
        p /= p.sum()
        np.testing.assert_allclose(got[n, i, hi], p @ kv[:pos + 1, :r], rtol=1e-5, atol=1e-5)
