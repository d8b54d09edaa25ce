"""Context parallelism: the sequence is split into contiguous pieces over the ``context`` axis.

KDA (SPEC section 2): a piece maps its incoming state affinely, ``S_out = M S_in + N``. Each rank
runs the KDA op twice on its piece: once from a zero state (its outputs ``o0`` and ``N``) and
once on zero values from the identity state, which gives ``M`` as the final state and
``P_t = scale * q_t^T M_t`` as the outputs. The ``(M, N)`` of all ranks are all-gathered (a fixed
``[K, K + V]`` per head, independent of the sequence length), prefix-composed with a
log-depth parallel scan (:func:`prefix_compose`) and each rank reads its exact incoming state
``S_in``; then ``o = o0 + P S_in``. A document that starts inside a piece zeroes ``M`` from
there on (the op restarts the state); one that starts exactly at a piece boundary zeroes ``M``
and ``S_in``. Gradients flow through the collectives by autodiff.

MLA (SPEC section 3): the normalised latent ``[c, k_r]`` (kv_lora + rope values per token: 576
for K3) is all-gathered along the context axis and expanded to keys and values locally. The
queries are load-balanced for causal masking: the sequence is cut into ``2C`` halves and rank
``r`` computes halves ``r`` and ``2C-1-r`` (one early, one late), exchanged with two
``ppermute``s and sent back after the attention. Each half attends the whole gathered sequence
at its own (traced) offset through :func:`pallas_kernels.mla.mla_attention`, whose flash kernels
skip the key blocks past the half's end and those holding none of its documents. Keys and values
exist only ``KEY_BLOCK`` tokens at a time: the gathered latents are up-projected block by block,
and each block's attention is merged into the running output by log-sum-exps. The backward
(a custom VJP) gathers the latents again, rebuilds each block's keys and values and runs the
attention's backward kernels with the whole output and log-sum-exp, as ring attention does: no
block's output is kept or recomputed, and of the gathered sequence only the rank's own latents
are saved, so the whole sequence's keys and values (``[B, S, H, 192 + 128]`` per layer) never
exist at once.

Both are single calls from the model layers and run only when the current mesh has a
``context`` axis larger than 1.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels.kda as kda_ops
import pallas_kernels.mla as mla_ops
from pallas_kernels.mla import reference as mla_reference
from sharding.rules import logical_spec

AXIS = "context"
# Gathered keys up-projected at a time by the context-parallel MLA: K3's 96 heads of 192 + 128
# dims at 131,072 keys are 7.5 GiB of bf16 keys and values (and as much for their gradients).
KEY_BLOCK = 131072


def axis_size(name: str = AXIS) -> int:
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or name not in mesh.axis_names:
    return 1
  return dict(zip(mesh.axis_names, mesh.axis_sizes))[name]


def active() -> bool:
  """True when the current mesh splits the sequence (a ``context`` axis larger than 1)."""
  return axis_size(AXIS) > 1


def _compose(a, b):
  """``b o a`` for affine maps ``S -> M S + N`` (a applied first); leading axes broadcast."""
  ma, na = a
  mb, nb = b
  mm = jnp.einsum("...ij,...jk->...ik", mb, ma, precision=jax.lax.Precision.HIGHEST)
  nn = jnp.einsum("...ij,...jv->...iv", mb, na, precision=jax.lax.Precision.HIGHEST) + nb
  return mm, nn


def prefix_compose(ms, ns):
  """Inclusive prefix compositions of the affine maps ``(ms[i], ns[i])`` (``[C, ..., K, K]``,
  ``[C, ..., K, V]``, i = 0 applied first): element i becomes map i o ... o map 0.

  A log-depth (Hillis-Steele) parallel scan with static shifts. ``jax.lax.associative_scan``
  computes the same thing, but the XLA CPU compiler of jax 0.11.2 crashes (segfault) on its
  gradient inside ``shard_map``, so it is not used here.
  """
  c = ms.shape[0]
  eye = jnp.broadcast_to(jnp.eye(ms.shape[-1], dtype=ms.dtype), ms.shape)
  off = 1
  while off < c:
    prev = (jnp.concatenate([eye[:off], ms[:-off]]),
            jnp.concatenate([jnp.zeros_like(ns[:off]), ns[:-off]]))
    ms, ns = _compose(prev, (ms, ns))
    off *= 2
  return ms, ns


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        segment_ids=None, use_qk_l2norm=False, A_log=None, dt_bias=None, gate=None,
        lower_bound=-5.0, beta_is_logit=False, chunk_size=64, save_residuals=True,
        implementation=None):
  """:func:`pallas_kernels.kda.kda` with the sequence split over the ``context`` axis (same
  arguments and results; q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]``,
  beta ``[B, T, HV]``). The final state is the state after the last token of the whole sequence,
  replicated over the context axis."""
  acc = jnp.promote_types(v.dtype, jnp.float32)
  b, t, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  scale = kd ** -0.5 if scale is None else scale
  c = axis_size()
  if t % c:
    raise ValueError(f"context-parallel KDA: sequence length {t} is not divisible by the "
                     f"context axis size {c}")
  seq = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  s0 = jnp.zeros((b, hv, kd, vd), acc) if initial_state is None else initial_state.astype(acc)
  tok = logical_spec(("batch", "length", "heads", None))
  row = logical_spec(("batch", "length"))
  st = P(tok[0], tok[2], None, None)  # the state's heads split like the tokens' heads
  # The gate and beta pre-processing are per token: each piece runs them inside its kernels (the
  # bounded-gate fast path), with A_log and dt_bias split by heads like the tokens.
  op = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
            implementation=implementation, gate=gate, lower_bound=lower_bound,
            beta_is_logit=beta_is_logit, save_residuals=save_residuals)
  # In the accumulation dtype, so that their gradients are summed over the pieces in it.
  gate_params = () if gate is None else (A_log.astype(acc).reshape(hv),
                                         dt_bias.astype(acc).reshape(hv, kd))
  gate_specs = () if gate is None else (P(tok[2]), P(tok[2], None))

  def body(q, k, v, g, beta, seg, s0, *gate_params):
    pk = {} if gate is None else dict(A_log=gate_params[0], dt_bias=gate_params[1].reshape(-1))
    idx = jax.lax.axis_index(AXIS)
    bl, tl = seg.shape
    # A document starting exactly at this piece's first token does not see the previous piece.
    last = jax.lax.all_gather(seg[:, -1], AXIS)  # [C, B]
    fresh = (idx > 0) & (seg[:, 0] != last[jnp.maximum(idx - 1, 0)])  # [B]
    o0, n = kda_ops.kda(q, k, v, g, beta, output_final_state=True, segment_ids=seg, **op, **pk)
    eye = jnp.broadcast_to(jnp.eye(kd, dtype=acc), (bl, v.shape[2], kd, kd))
    pm, m = kda_ops.kda(q, k, jnp.zeros(v.shape[:3] + (kd,), acc), g, beta, initial_state=eye,
                        output_final_state=True, segment_ids=seg, **op, **pk)
    m = jnp.where(fresh[:, None, None, None], 0.0, m)
    ms = jax.lax.all_gather(m[None], AXIS, axis=0, tiled=True)  # [C, B, HV, K, K]
    ns = jax.lax.all_gather(n.astype(acc)[None], AXIS, axis=0, tiled=True)  # [C, B, HV, K, V]
    mc, nc = prefix_compose(ms, ns)  # compositions of pieces 0..i
    before = jnp.maximum(idx - 1, 0)
    s_in = jnp.where(idx > 0, _compose((s0, s0), (mc[before], nc[before]))[1], s0)
    s_in = jnp.where(fresh[:, None, None, None], 0.0, s_in)
    o = o0.astype(acc) + jnp.einsum("bthk,bhkv->bthv", pm.astype(acc), s_in,
                                    precision=jax.lax.Precision.HIGHEST)
    final = _compose((s0, s0), (mc[-1], nc[-1]))[1]
    return o.astype(v.dtype), final

  fn = jax.shard_map(body, in_specs=(tok, tok, tok, tok, P(*tok[:3]), row, st, *gate_specs),
                     out_specs=(tok, st), check_vma=False)
  wsc = jax.lax.with_sharding_constraint  # lay the inputs out as the shard_map takes them
  o, final = fn(*(wsc(x, tok) for x in (q, k, v, g)), wsc(beta, P(*tok[:3])), wsc(seq, row),
                wsc(s0, st), *(wsc(x, sp) for x, sp in zip(gate_params, gate_specs)))
  return o, (final if output_final_state else None)


def _half_tables(c: int):
  """Zigzag: half ``h`` of ``2C`` goes to rank ``h`` (h < C) or ``2C-1-h``. Returns the two
  ppermute permutations (first / second local half) and, per rank, the global half index of the
  half it receives from each."""
  dest = lambda hh: hh if hh < c else 2 * c - 1 - hh
  perm_a = [(r, dest(2 * r)) for r in range(c)]
  perm_b = [(r, dest(2 * r + 1)) for r in range(c)]
  recv_a = np.zeros(c, np.int32)
  recv_b = np.zeros(c, np.int32)
  for r in range(c):
    recv_a[dest(2 * r)] = 2 * r
    recv_b[dest(2 * r + 1)] = 2 * r + 1
  return perm_a, perm_b, recv_a, recv_b


def key_block(s: int, most: int = KEY_BLOCK) -> int:
  """Keys per block for a gathered length ``s``: its largest divisor that is at most ``most``."""
  return max(d for d in range(1, min(s, most) + 1) if s % d == 0)


class _Blocks(NamedTuple):
  """The static side of :func:`_gathered_attention`: keys per block and the attention's."""
  keys: int
  nope_dim: int
  scale: float
  implementation: str | None


def _keys_values(cfg: _Blocks, w, lat_b):
  """Latents ``[B, kb, R + rope]`` and w ``[R, H, nope + v]`` -> keys ``[B, kb, H, nope + rope]``
  (the shared rope part broadcast over heads) and values ``[B, kb, H, v]``."""
  r = w.shape[0]
  kv = jnp.einsum("btr,rhd->bthd", lat_b[..., :r], w.astype(lat_b.dtype))
  k_r = jnp.broadcast_to(lat_b[:, :, None, r:], kv.shape[:3] + (lat_b.shape[-1] - r,))
  return jnp.concatenate([kv[..., :cfg.nope_dim], k_r], -1), kv[..., cfg.nope_dim:]


def _block(cfg: _Blocks, lat_all, seg_all, i):
  """Key block i of the gathered sequence: latents ``[B, kb, D]``, segment ids ``[B, kb]`` and
  its first key's position."""
  k0 = i * cfg.keys
  return (jax.lax.dynamic_slice_in_dim(lat_all, k0, cfg.keys, axis=1),
          jax.lax.dynamic_slice_in_dim(seg_all, k0, cfg.keys, axis=1), k0)


def _piece_segments(queries, starts, seg_all):
  """Each query piece's segment ids ``[B, Tq]``, cut from the gathered ``seg_all [B, T]``."""
  return [jax.lax.dynamic_slice_in_dim(seg_all, start, piece.shape[1], axis=1)
          for piece, start in zip(queries, starts)]


def _block_masks(cfg: _Blocks, qseg, start, seg_b, k0):
  """The attention op's masks for a piece (segment ids ``qseg``, from ``start``) against the
  key block from ``k0`` with segment ids ``seg_b``."""
  return dict(segment_ids=qseg, kv_segment_ids=seg_b, q_offset=start - k0, causal=True,
              scale=cfg.scale, implementation=cfg.implementation)


def _over_blocks(cfg: _Blocks, t: int, step, first):
  """``step(i, carry)`` for key blocks 1 .. nb - 1 from the carry ``first`` (block 0's): a loop
  whose carries start from data, not from zeros. (XLA makes every layer's zero-filled loop
  buffers in one fusion at the start, all live at once: benchmarks/RESULTS.md, MLA, "What grew
  per layer".)"""
  nb = t // cfg.keys
  return first if nb == 1 else jax.lax.fori_loop(1, nb, step, first)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered_attention(cfg: _Blocks, queries, starts, w, seg_all, lat):
  """Each query piece ``[B, Tq, H, nope + rope]`` (at global position ``starts[i]``) attends the
  whole sequence, whose latents the ranks hold in pieces ``lat [B, T/C, R + rope]``; inside a
  ``shard_map`` over :data:`AXIS`. Returns the pieces' outputs ``[B, Tq, H, v]``.

  Forward: the gathered latents are up-projected ``cfg.keys`` at a time and each block's
  attention is merged into the running output by log-sum-exps. Backward: the latents are
  gathered again and each block's keys and values rebuilt; the attention's backward kernels run
  with the whole output and log-sum-exp (``mla_attention_grad``: no block's own forward or output
  is kept or recomputed); each block's latent gradient replaces its latents in the gathered
  buffer, which is reduce-scattered back to the ranks. Saved for the backward: the queries,
  outputs and log-sum-exps and the rank's own latents."""
  return _gathered_attention_fwd(cfg, queries, starts, w, seg_all, lat)[0]


def _gathered_attention_fwd(cfg: _Blocks, queries, starts, w, seg_all, lat):
  lat_all = jax.lax.all_gather(lat, AXIS, axis=1, tiled=True)  # [B, T, D]
  acc = jnp.promote_types(queries[0].dtype, jnp.float32)
  qsegs = _piece_segments(queries, starts, seg_all)

  def attend(i):
    lat_b, seg_b, k0 = _block(cfg, lat_all, seg_all, i)
    keys, values = _keys_values(cfg, w, lat_b)
    return [mla_ops.mla_attention(piece, keys, values, return_lse=True,
                                  **_block_masks(cfg, qseg, start, seg_b, k0))
            for piece, qseg, start in zip(queries, qsegs, starts)]

  def step(i, carry):
    return [mla_reference.merge_partials(jnp.stack([o, o_b.astype(acc)]), jnp.stack([lse, lse_b]),
                                         0, return_lse=True)
            for (o, lse), (o_b, lse_b) in zip(carry, attend(i))]

  first = [(o.astype(acc), lse.astype(acc)) for o, lse in attend(0)]
  final = _over_blocks(cfg, lat_all.shape[1], step, first)
  outs = tuple(o.astype(p.dtype) for (o, _), p in zip(final, queries))
  return outs, (queries, starts, w, seg_all, lat, outs, tuple(lse for _, lse in final))


def _gathered_attention_bwd(cfg: _Blocks, res, douts):
  queries, starts, w, seg_all, lat, outs, lses = res
  acc = jnp.promote_types(queries[0].dtype, jnp.float32)
  qsegs = _piece_segments(queries, starts, seg_all)

  def grads(i, buf):
    """Block i's shares of the queries' and w's gradients, and buf with block i's latents
    (still unread there) replaced by their gradient."""
    lat_b, seg_b, k0 = _block(cfg, buf, seg_all, i)
    (keys, values), pull = jax.vjp(functools.partial(_keys_values, cfg), w, lat_b)
    dkeys, dvalues, dqs = 0.0, 0.0, []
    for piece, qseg, start, o, lse, do in zip(queries, qsegs, starts, outs, lses, douts):
      dq_b, dk_b, dv_b = mla_ops.mla_attention_grad(
          piece, keys, values, o, lse, do, **_block_masks(cfg, qseg, start, seg_b, k0))
      dqs.append(dq_b.astype(acc))
      dkeys, dvalues = dkeys + dk_b.astype(acc), dvalues + dv_b.astype(acc)
    dw_b, dlat_b = pull((dkeys.astype(keys.dtype), dvalues.astype(values.dtype)))
    return dqs, dw_b.astype(acc), jax.lax.dynamic_update_slice_in_dim(buf, dlat_b, k0, axis=1)

  def step(i, carry):
    dqs, dw, buf = carry
    dqs_b, dw_b, buf = grads(i, buf)
    return [a + b for a, b in zip(dqs, dqs_b)], dw + dw_b, buf

  lat_all = jax.lax.all_gather(lat, AXIS, axis=1, tiled=True)  # [B, T, D]
  dqs, dw, dlat = _over_blocks(cfg, lat_all.shape[1], step, grads(0, lat_all))
  dlat = jax.lax.psum_scatter(dlat, AXIS, scatter_dimension=1, tiled=True)
  return (tuple(dq.astype(p.dtype) for dq, p in zip(dqs, queries)), None, dw.astype(w.dtype),
          None, dlat.astype(lat.dtype))


_gathered_attention.defvjp(_gathered_attention_fwd, _gathered_attention_bwd)


def mla_attention(q, latent, w_kv, *, segment_ids=None, scale, nope_dim: int, balanced=True,
                  implementation=None, block_keys: int = KEY_BLOCK):
  """Causal MLA attention with the sequence split over the ``context`` axis.

  q: ``[B, T, H, nope + rope]``; latent: ``[B, T, R + rope]`` (normalised ``c`` then the shared
  ``k_r``); w_kv: ``[R, H, nope + v]`` (``kv_b_proj`` per head: nope then v); segment_ids
  ``[B, T]`` or None; implementation: :func:`pallas_kernels.mla.mla_attention`'s (one that
  returns the log-sum-exp and has ``mla_attention_grad``: ``"cudnn"`` has neither). Only the
  latent crosses ranks. Each local query piece (with ``balanced``, the two zigzag halves) attends
  the whole gathered sequence at its own offset, so the attention op's block tables skip the key
  blocks past the piece's end and those holding none of its documents; the gathered keys are
  up-projected :func:`key_block` ``(T, block_keys)`` at a time, forward and backward
  (:func:`_gathered_attention`). Returns ``[B, T, H, v]`` in q's dtype.
  """
  t = q.shape[1]
  c = axis_size()
  if t % (2 * c):
    raise ValueError(f"context-parallel MLA: sequence length {t} must be divisible by twice the "
                     f"context axis size ({2 * c})")
  cfg = _Blocks(key_block(t, block_keys), nope_dim, float(scale), implementation)
  seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  perm_a, perm_b, recv_a, recv_b = _half_tables(c)
  qs = logical_spec(("batch", "length", "heads", None))
  ls = logical_spec(("batch", "length", None))
  ws = P(None, qs[2], None)  # w_kv: whole latent dim, heads split like the queries' heads

  def body(q, lat, w, seg):
    idx = jax.lax.axis_index(AXIS)
    seg_all = jax.lax.all_gather(seg, AXIS, axis=1, tiled=True)  # [B, T]
    if balanced:
      half = q.shape[1] // 2
      ha, hb = jnp.asarray(recv_a)[idx], jnp.asarray(recv_b)[idx]
      queries = (jax.lax.ppermute(q[:, :half], AXIS, perm_a),
                 jax.lax.ppermute(q[:, half:], AXIS, perm_b))
      starts = (ha * half, hb * half)
    else:  # query rows at global positions start .. start + len - 1
      queries, starts = (q,), (idx * q.shape[1],)
    outs = _gathered_attention(cfg, queries, starts, w, seg_all, lat)
    if not balanced:
      return outs[0]
    inv = lambda perm: [(d, s) for s, d in perm]
    return jnp.concatenate([jax.lax.ppermute(outs[0], AXIS, inv(perm_a)),
                            jax.lax.ppermute(outs[1], AXIS, inv(perm_b))], axis=1)

  fn = jax.shard_map(body, in_specs=(qs, ls, ws, logical_spec(("batch", "length"))),
                     out_specs=qs, check_vma=False)
  return fn(q, latent, w_kv, seg)


__all__ = ["active", "axis_size", "kda", "key_block", "mla_attention"]
