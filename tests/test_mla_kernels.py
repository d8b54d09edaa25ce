"""Pallas MLA kernels (interpret mode on CPU) against float64 NumPy loops and the XLA reference:
prefill values and gradients (causal, packed documents, ragged T, a query window at a traced
offset into longer keys with separate key segment ids), paged decode (ragged lengths, shuffled
page tables, several new tokens), block skipping, and TPU / GPU lowering."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import (decode, fast_forward_pallas_grad, mla_attention,
                                mla_attention_grad, padded_dot_product_attention, prefill,
                                reference)

SMALL = prefill.Blocks(fwd_q=16, fwd_k=16, dkv_q=16, dkv_k=16, dq_q=16, dq_k=16)


def np_attention(q, k, v, seg, causal, scale, do, kv_seg=None, off=None, dlse=None):
  """Float64 attention and its gradients, one (batch, head) at a time: ``o, dq, dk, dv``.
  Query i sits at key position ``off + i`` (default ``S - T``); kv_seg defaults to seg. With
  ``dlse`` (``[B, T, H]``, the cotangent of each row's log-sum-exp) ``o, lse, dq, dk, dv``."""
  q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
  b, t, h, _ = q.shape
  s = k.shape[1]
  o, lse = np.zeros(do.shape), np.full((b, t, h), -np.inf)
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  i = np.arange(t)[:, None] + (s - t if off is None else off)
  j = np.arange(s)[None, :]
  kv_seg = seg if kv_seg is None else kv_seg
  for bi in range(b):
    mask = (j <= i) if causal else np.ones((t, s), bool)
    if seg is not None:
      mask = mask & (seg[bi][:, None] == kv_seg[bi][None, :])
    for hi in range(h):
      qq, kk, vv, dd = q[bi, :, hi], k[bi, :, hi], v[bi, :, hi], do[bi, :, hi]
      logits = np.where(mask, qq @ kk.T * scale, -np.inf)
      top = np.where(mask.any(1, keepdims=True), logits.max(1, keepdims=True), 0.0)
      p = np.exp(logits - top) * mask
      total = p.sum(1)
      lse[bi, total > 0, hi] = (top[:, 0] + np.log(np.maximum(total, 1e-300)))[total > 0]
      p /= np.maximum(total[:, None], 1e-300)
      o[bi, :, hi] = p @ vv
      dp = dd @ vv.T
      ds = p * (dp - (dp * p).sum(1, keepdims=True))
      if dlse is not None:
        ds += p * np.asarray(dlse, np.float64)[bi, :, hi, None]
      dq[bi, :, hi] = ds @ kk * scale
      dk[bi, :, hi] = ds.T @ qq * scale
      dv[bi, :, hi] = p.T @ dd
  return (o, dq, dk, dv) if dlse is None else (o, lse, dq, dk, dv)


def np_paged_decode(q, cache, table, lengths, r, scale):
  """Float64 loop over requests, new tokens and heads -> ``[N, Tn, H, R]``."""
  q, cache = np.asarray(q, np.float64), np.asarray(cache, np.float64)
  n, tn, h, _ = q.shape
  out = np.zeros((n, tn, h, r))
  for ni in range(n):
    kv = np.concatenate([cache[p] for p in np.asarray(table)[ni]])
    for ti in range(tn):
      pos = int(lengths[ni]) - tn + ti
      for hi in range(h):
        logit = kv[:pos + 1] @ q[ni, ti, hi] * scale
        p = np.exp(logit - logit.max())
        out[ni, ti, hi] = (p / p.sum()) @ kv[:pos + 1, :r]
  return out


def _inputs(seed, b, t, s, h, dk, dv):
  ks = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(ks[0], (b, t, h, dk)), jax.random.normal(ks[1], (b, s, h, dk)),
          jax.random.normal(ks[2], (b, s, h, dv)), jax.random.normal(ks[3], (b, t, h, dv)))


def _check_prefill(backend, *, b, t, s, h, dk, dv, seg, causal, seed=0):
  q, k, v, do = _inputs(seed, b, t, s, h, dk, dv)
  scale = dk ** -0.5
  f = lambda q, k, v: prefill.mla_attention(q, k, v, segment_ids=seg, causal=causal, scale=scale,
                                            backend=backend, blocks=SMALL)
  o, vjp = jax.vjp(f, q, k, v)
  got = (o, *vjp(do))
  want = np_attention(q, k, v, None if seg is None else np.asarray(seg), causal, scale, do)
  for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4, err_msg=name)
  ref = reference.attention(q, k, v, segment_ids=seg, causal=causal, scale=scale)
  np.testing.assert_allclose(np.asarray(o), np.asarray(ref), rtol=2e-4, atol=2e-4)


# Row 0: three documents, the second crossing the 16-token block edges; row 1: one document.
DOCS = jnp.array([[0] * 5 + [1] * 23 + [2] * 12, [7] * 40], jnp.int32)


def test_prefill_gpu_packed_documents_ragged_t():
  _check_prefill("gpu", b=2, t=40, s=40, h=1, dk=48, dv=32, seg=DOCS, causal=True)


def test_prefill_gpu_not_causal_longer_keys():
  _check_prefill("gpu", b=1, t=24, s=40, h=2, dk=48, dv=32, seg=None, causal=False, seed=1)


def test_prefill_gpu_single_token():
  _check_prefill("gpu", b=2, t=1, s=1, h=2, dk=64, dv=32, seg=None, causal=True, seed=2)


def test_prefill_tpu_packed_documents_ragged_t():
  _check_prefill("tpu", b=2, t=40, s=40, h=1, dk=48, dv=32, seg=DOCS, causal=True, seed=3)


def test_block_tables_visit_exactly_the_visible_blocks():
  t, bq, bk = 200, 32, 16
  seg = jnp.asarray(np.repeat(np.arange(5), [30, 50, 7, 90, 23])[None])
  tp = 224
  seg_p = jnp.pad(seg, ((0, 0), (0, tp - t)), mode="edge")
  rows, cols = prefill.block_tables(seg_p, t=t, s=t, tp=tp, sp=tp, bq=bq, bk=bk, causal=True)
  i, j = np.arange(tp)[:, None], np.arange(tp)[None, :]
  sid = np.asarray(seg_p[0])
  vis = (j <= i) & (sid[:, None] == sid[None, :]) & (i < t) & (j < t)
  _assert_tables_visit(rows[0], cols[0], vis.reshape(tp // bq, bq, tp // bk, bk))


def _assert_tables_visit(rows, cols, blocks):
  """The ``[lo, a, b, hi)`` tables visit exactly the block pairs with a visible element of
  ``blocks [nq, bq, nk, bk]`` and leave only fully visible ones unmasked."""
  any_vis, all_vis = blocks.any((1, 3)), blocks.all((1, 3))
  for table, a_v, a_f in ((rows, any_vis, all_vis), (cols, any_vis.T, all_vis.T)):
    for r, (lo, a, b, hi) in enumerate(np.asarray(table)):
      visited = np.zeros(a_v.shape[1], bool)
      visited[lo:hi] = True
      np.testing.assert_array_equal(visited, a_v[r])  # sorted documents: nothing extra visited
      plain = np.zeros_like(visited)
      plain[a:b] = True
      assert not (plain & ~a_f[r]).any()  # unmasked blocks are fully visible
      assert lo <= a <= b <= hi


# Keys (S=100) of two rows: row 0 has a document from 20 to 64 that starts before the query
# window [50, 87) and continues into it, one from 64 to 71 starting inside a 16-key block and
# another crossing the window's end; row 1 has a document ending inside the window's first block.
KV_DOCS = np.stack([np.repeat([0, 1, 2, 3, 4], [20, 44, 7, 13, 16]),
                    np.repeat([5, 6, 7], [52, 40, 8])]).astype(np.int32)


def _check_window(backend, *, t, s, off, kv_seg, causal=True, h=1, seed=0):
  """Queries at key positions ``off .. off + t - 1`` of ``kv_seg``, off passed traced into jit:
  values and dq, dk, dv (random cotangent) against the float64 loop, and so are the values of the
  XLA reference and of the cuDNN path's dense mask (run by XLA)."""
  b = kv_seg.shape[0]
  q, k, v, do = _inputs(seed, b, t, s, h, 48, 32)
  scale = 48 ** -0.5
  q_seg = kv_seg[:, off:off + t]

  @jax.jit
  def run(q, k, v, do, off):
    f = lambda q, k, v: prefill.mla_attention(
        q, k, v, segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=off, causal=causal,
        scale=scale, backend=backend, blocks=SMALL)
    o, vjp = jax.vjp(f, q, k, v)
    masks = dict(segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=off, causal=causal,
                 scale=scale)
    refs = (mla_attention(q, k, v, **masks, implementation="xla"),
            padded_dot_product_attention(q, k, v, **masks, implementation="xla"))
    return (o, *vjp(do)), refs

  got, refs = run(q, k, v, do, jnp.int32(off))
  want = np_attention(q, k, v, q_seg, causal, scale, do, kv_seg=kv_seg, off=off)
  for name, g, w in zip(("o", "dq", "dk", "dv", "xla", "dense mask"), got + refs,
                        want + (want[0],) * 2):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4, err_msg=name)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_prefill_window_at_traced_offset_into_longer_keys(backend):
  _check_window(backend, t=37, s=100, off=50, kv_seg=KV_DOCS, seed=10)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "xla"])
def test_log_sum_exp_output_and_its_gradient(impl):
  """``return_lse``: each row's log-sum-exp (``-inf`` for the rows whose document has no key in
  the window) and the gradients of a loss of both outputs, against the float64 loop, for a
  query window at a traced offset into longer keys."""
  t, s, off, h = 29, 80, 40, 2
  q, k, v, do = _inputs(12, 2, t, s, h, 48, 32)
  dl = jax.random.normal(jax.random.key(13), (2, t, h))
  kv_seg = jnp.asarray(KV_DOCS[:, :s])
  q_seg = kv_seg[:, off:off + t].at[0, 3:6].set(99)  # a document with no key: no visible key
  scale = 48 ** -0.5
  seen = np.asarray(q_seg != 99)[..., None]

  @jax.jit
  def run(q, k, v, off):
    def f(q, k, v):
      return mla_attention(q, k, v, segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=off,
                           scale=scale, implementation=impl, return_lse=True)
    (o, lse), vjp = jax.vjp(f, q, k, v)
    return o, lse, *vjp((do, jnp.where(jnp.isfinite(lse), dl, 0.0)))

  got = run(q, k, v, jnp.int32(off))
  want = np_attention(q, k, v, np.asarray(q_seg), True, scale, do, kv_seg=np.asarray(kv_seg),
                      off=off, dlse=np.where(seen, np.asarray(dl), 0.0))
  assert np.isneginf(np.asarray(got[1])[~np.broadcast_to(seen, got[1].shape)]).all()
  for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4, err_msg=name)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "xla"])
def test_backward_over_key_blocks_sums_to_the_whole_gradient(impl):
  """``mla_attention_grad`` per key block, given the whole attention's output and log-sum-exp:
  the blocks' dq sum to the float64 loop's dq over all keys, and each block's dk, dv are that
  loop's rows for its keys. A traced offset into longer keys, packed documents, a block edge
  inside a document, rows whose document has no key in a block, and rows with no key at all."""
  t, s, off, h, cut = 29, 80, 40, 2, 52
  q, k, v, do = _inputs(14, 2, t, s, h, 48, 32)
  kv_seg = jnp.asarray(KV_DOCS[:, :s])
  q_seg = kv_seg[:, off:off + t].at[0, 3:6].set(99)  # a document with no key
  scale = 48 ** -0.5
  o, lse, dq, dk, dv = np_attention(q, k, v, np.asarray(q_seg), True, scale, do,
                                    kv_seg=np.asarray(kv_seg), off=off,
                                    dlse=np.zeros((2, t, h)))
  o_in, lse_in = jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32)

  @functools.partial(jax.jit, static_argnums=(0, 1))
  def part(lo, hi, off):
    return mla_attention_grad(q, k[:, lo:hi], v[:, lo:hi], o_in, lse_in, do, segment_ids=q_seg,
                              kv_segment_ids=kv_seg[:, lo:hi], q_offset=off - lo, scale=scale,
                              implementation=impl)

  parts = [(0, cut), (cut, s)]
  got = [part(lo, hi, jnp.int32(off)) for lo, hi in parts]
  np.testing.assert_allclose(np.asarray(got[0][0] + got[1][0]), dq, rtol=2e-4, atol=2e-4)
  for (lo, hi), (_, dk_part, dv_part) in zip(parts, got):
    np.testing.assert_allclose(np.asarray(dk_part), dk[:, lo:hi], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(dv_part), dv[:, lo:hi], rtol=2e-4, atol=2e-4)
  assert np.abs(np.asarray(got[1][0])).max() > 0.1  # both blocks carry a share of dq
  with pytest.raises(ValueError, match="expected o and do"):
    mla_attention_grad(q, k, v, o_in, lse_in[:, :-1], do, scale=scale, implementation=impl)


def test_prefill_gpu_window_single_token_and_not_causal():
  _check_window("gpu", t=1, s=100, off=70, kv_seg=KV_DOCS, h=2, seed=11)
  _check_window("gpu", t=37, s=100, off=50, kv_seg=KV_DOCS, causal=False, seed=12)


def test_block_tables_with_offset_and_key_segments_visit_exactly_the_visible_blocks():
  t, s, off, bq, bk = 70, 200, 113, 32, 16
  kseg = np.repeat(np.arange(5), [30, 90, 7, 50, 23])
  tp, sp = 96, 208
  kseg_p = np.pad(kseg, (0, sp - s), mode="edge")
  qseg_p = np.pad(kseg[off:off + t], (0, tp - t), mode="edge")
  rows, cols = jax.jit(lambda o: prefill.block_tables(
      jnp.asarray(qseg_p[None]), jnp.asarray(kseg_p[None]), t=t, s=s, tp=tp, sp=sp, bq=bq,
      bk=bk, causal=True, off=o))(jnp.int32(off))
  i, j = np.arange(tp)[:, None], np.arange(sp)[None, :]
  vis = (j <= i + off) & (qseg_p[:, None] == kseg_p[None, :]) & (i < t) & (j < s)
  _assert_tables_visit(rows[0], cols[0], vis.reshape(tp // bq, bq, sp // bk, bk))


def test_padded_cudnn_path_and_fast_forward_gradients():
  q, k, v, do = _inputs(4, 1, 20, 20, 2, 32, 16)
  scale = 0.2
  seg = jnp.array([[0] * 9 + [1] * 11])
  want = np_attention(q, k, v, np.asarray(seg), True, scale, do)
  got = padded_dot_product_attention(q, k, v, segment_ids=seg, scale=scale, implementation="xla")
  np.testing.assert_allclose(np.asarray(got), want[0], rtol=1e-5, atol=1e-5)
  want = np_attention(q, k, v, None, True, scale, do)
  f = lambda q, k, v: fast_forward_pallas_grad(q, k, v, True, scale, "xla")
  o, vjp = jax.vjp(f, q, k, v)
  for name, g, w in zip(("o", "dq", "dk", "dv"), (o, *vjp(do)), want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4, err_msg=name)


def _paged(seed, n, tn, h, r, dr, ps, lengths=(37, None, 64)):
  """Random q, cache, a shuffled table of 4 disjoint pages per request and ``lengths``
  (None = tn + 2)."""
  rng = np.random.default_rng(seed)
  lengths = np.array([tn + 2 if x is None else x for x in lengths][:n])
  pages = 12
  table = rng.permutation(pages)[:n * 4].reshape(n, 4).astype(np.int32)  # shuffled, disjoint
  cache = rng.normal(size=(pages, ps, r + dr)).astype(np.float32)
  q = rng.normal(size=(n, tn, h, r + dr)).astype(np.float32)
  return q, cache, table, lengths


@pytest.mark.parametrize("tn,splits", [(1, 3), (4, None)])
def test_decode_gpu_ragged_paged(tn, splits):
  q, cache, table, lengths = _paged(5 + tn, 3, tn, 2, 32, 16, 16)
  got = decode.mla_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table),
                          jnp.asarray(lengths), kv_lora_rank=32, scale=0.25, backend="gpu",
                          config=decode.DecodeConfig(num_splits=splits, block_rows=16,
                                                     step_tokens=16))
  np.testing.assert_allclose(np.asarray(got), np_paged_decode(q, cache, table, lengths, 32, 0.25),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tn,h,splits", [(1, 16, 2), (3, 24, None)])
def test_decode_gpu_mosaic_ragged_paged(tn, h, splits):
  """The Mosaic GPU kernel in GPU interpret mode (bf16): 1-4 steps of 64 tokens per request,
  rows (tn * h) in one or two 64-row programs (with tn=3 new token 2 straddles them: the second
  program holds its last 8 rows and 56 padding rows), split-K with an empty split (splits=2: the
  37-token request's second split has no step)."""
  q, cache, table, lengths = _paged(11 + tn, 3, tn, h, 128, 64, 64, lengths=(37, 200, 130))
  q, cache = jnp.asarray(q, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16)
  got = decode.mla_decode(q, cache, jnp.asarray(table), jnp.asarray(lengths), kv_lora_rank=128,
                          scale=0.1, backend="gpu",
                          config=decode.DecodeConfig(gpu_kernel="mosaic", num_splits=splits))
  want = np_paged_decode(np.asarray(q, np.float32), np.asarray(cache, np.float32), table,
                         lengths, 128, 0.1)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)
  assert np.linalg.norm(np.asarray(got, np.float32) - want) < 5e-3 * np.linalg.norm(want)


def test_decode_mosaic_lowers_for_cuda_and_checks_inputs():
  """CUDA lowering at the real shapes (H96, 576 = 512 + 64, page 64; Tn 2 and the benchmark's
  N256 Tn1): Mosaic GPU's layout inference and its shared-memory limit (227 KiB) are checked."""
  sds = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  dec = lambda q, c, t, l: decode.mla_decode(q, c, t, l, kv_lora_rank=512, scale=192 ** -0.5,
                                             backend="gpu", interpret=False,
                                             config=decode.DecodeConfig(gpu_kernel="mosaic"))
  for n, tn in ((4, 2), (256, 1)):
    args = (sds((n, tn, 96, 576), bf16), sds((64, 64, 576), bf16), sds((n, 16), jnp.int32),
            sds((n,), jnp.int32))
    with _lowering_context("cuda"):
      text = jax.jit(dec).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
  with pytest.raises(ValueError, match="mosaic"):
    decode.mla_decode(jnp.zeros((1, 1, 2, 192)), jnp.zeros((4, 64, 192)),
                      jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), kv_lora_rank=128,
                      scale=1.0, backend="gpu", config=decode.DecodeConfig(gpu_kernel="mosaic"))


def test_decode_tpu_ragged_paged():
  q, cache, table, lengths = _paged(9, 3, 4, 2, 32, 16, 16)
  got = decode.mla_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table),
                          jnp.asarray(lengths), kv_lora_rank=32, scale=0.25, backend="tpu",
                          config=decode.DecodeConfig(num_splits=2, step_tokens=16))
  want = np_paged_decode(q, cache, table, lengths, 32, 0.25)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
  ref = reference.paged_decode(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table),
                               jnp.asarray(lengths), kv_lora_rank=32, scale=0.25)
  np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-4, atol=1e-4)


def _lowering_context(platform):
  if platform != "cuda":
    return contextlib.nullcontext()
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lowering_bf16_mla_shapes(platform):
  backend = "tpu" if platform == "tpu" else "gpu"
  sds = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  q, k, v = sds((1, 1000, 2, 192), bf16), sds((1, 1000, 2, 192), bf16), sds((1, 1000, 2, 128), bf16)
  seg = sds((1, 1000), jnp.int32)

  def loss(q, k, v, seg):
    o = prefill.mla_attention(q, k, v, segment_ids=seg, causal=True, scale=192 ** -0.5,
                              backend=backend, interpret=False)
    return o.astype(jnp.float32).sum()

  dec = lambda q, c, t, l: decode.mla_decode(q, c, t, l, kv_lora_rank=512, scale=192 ** -0.5,
                                             backend=backend, interpret=False)
  with _lowering_context(platform):
    for f, args in ((jax.value_and_grad(loss, argnums=(0, 1, 2)), (q, k, v, seg)),
                    (dec, (sds((4, 2, 96, 576), bf16), sds((64, 64, 576), bf16),
                           sds((4, 16), jnp.int32), sds((4,), jnp.int32)))):
      text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
      assert "mla_" in text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_lowering_bf16_window_at_traced_offset(platform):
  """A context-parallel zigzag half: 4096 queries at a traced offset into 16384 keys with
  separate query / key segment ids, forward and backward."""
  backend = "tpu" if platform == "tpu" else "gpu"
  sds = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16

  def loss(q, k, v, q_seg, kv_seg, off):
    o = prefill.mla_attention(q, k, v, segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=off,
                              causal=True, scale=192 ** -0.5, backend=backend, interpret=False)
    return o.astype(jnp.float32).sum()

  args = (sds((1, 4096, 8, 192), bf16), sds((1, 16384, 8, 192), bf16),
          sds((1, 16384, 8, 128), bf16), sds((1, 4096), jnp.int32), sds((1, 16384), jnp.int32),
          sds((), jnp.int32))
  with _lowering_context(platform):
    text = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*args)
            .lower(lowering_platforms=(platform,)).as_text())
  for name in ("mla_fwd", "mla_bwd_dkv", "mla_bwd_dq"):
    assert name in text


def test_bad_inputs_raise():
  q = jnp.zeros((1, 8, 2, 40))
  with pytest.raises(ValueError, match="multiples of 16"):
    prefill.mla_attention(q, q, q, scale=1.0, backend="gpu")
  with pytest.raises(ValueError, match="segment_ids"):
    prefill.mla_attention(q[..., :32], q[:, :4, :, :32], q[:, :4, :, :32], scale=1.0,
                          segment_ids=jnp.zeros((1, 8), jnp.int32), backend="gpu")
  with pytest.raises(ValueError, match="kv_segment_ids"):
    prefill.mla_attention(q[..., :32], q[:, :4, :, :32], q[:, :4, :, :32], scale=1.0,
                          segment_ids=jnp.zeros((1, 8), jnp.int32),
                          kv_segment_ids=jnp.zeros((1, 8), jnp.int32), backend="gpu")
  with pytest.raises(ValueError, match="kv_segment_ids needs segment_ids"):
    prefill.mla_attention(q[..., :32], q[..., :32], q[..., :32], scale=1.0,
                          kv_segment_ids=jnp.zeros((1, 8), jnp.int32), backend="gpu")
  with pytest.raises(ValueError, match="q_offset"):
    prefill.mla_attention(q[..., :32], q[..., :32], q[..., :32], scale=1.0,
                          q_offset=jnp.zeros((2,), jnp.int32), backend="gpu")
  with pytest.raises(ValueError, match="page_size"):
    decode.mla_decode(jnp.zeros((1, 1, 2, 48)), jnp.zeros((4, 10, 48)),
                      jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), kv_lora_rank=32,
                      scale=1.0, backend="gpu")
  with pytest.raises(ValueError, match="unknown implementation"):
    mla_attention(q, q, q, implementation="flash")
