"""Pure-JAX references for Kimi Delta Attention (SPEC section 2).

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV, K]`` log-space decay
(``g <= 0``); beta ``[B, T, HV]``; state ``[B, HV, K, V]`` float32. ``HV`` is a multiple of ``H``
(grouped values): value head ``j`` reads query/key head ``j // (HV // H)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6
SUB_TILE = 16  # tokens per sub-tile of a chunk
_HI = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array) -> jax.Array:
  """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, computed in float32 (or float64)."""
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)).astype(x.dtype)


def kda_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array, kind: str,
             lower_bound: float = -5.0) -> jax.Array:
  """Log-space decay from the raw gate projection.

  f: ``[..., HV, K]``; A_log: ``[HV]``; dt_bias: ``[HV*K]``. Returns g with the dtype of f
  promoted to float32.
  - "softplus" (Kimi Linear): ``g = -exp(A_log) * softplus(f + dt_bias)``
  - "bounded" (K3): ``g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))`` in (lower_bound, 0)
  """
  dt = jnp.promote_types(f.dtype, jnp.float32)
  hv, kd = f.shape[-2:]
  x = f.astype(dt) + dt_bias.astype(dt).reshape(hv, kd)
  a = jnp.exp(A_log.astype(dt)).reshape(hv, 1)
  if kind == "softplus":
    return -a * jax.nn.softplus(x)
  if kind == "bounded":
    return lower_bound * jax.nn.sigmoid(a * x)
  raise ValueError(f"kda_gate: unknown gate kind {kind!r} (expected 'softplus' or 'bounded')")


def expand_heads(x: jax.Array, hv: int) -> jax.Array:
  """Repeats query/key heads ``[..., H, D]`` to the value heads ``[..., HV, D]``."""
  h = x.shape[-2]
  if hv % h:
    raise ValueError(f"value heads {hv} must be a multiple of query/key heads {h}")
  return x if hv == h else jnp.repeat(x, hv // h, axis=-2)


def restart_mask(segment_ids: jax.Array | None, b: int, t: int) -> jax.Array:
  """``[B, T]`` bool: True where a new segment starts (never at t=0: the row's first segment
  continues from the initial state)."""
  if segment_ids is None:
    return jnp.zeros((b, t), bool)
  return jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)


def scan_states(step, s0, xs, every, fill):
  """``lax.scan(step, s0, xs)`` over the leading axis (N steps) that also returns the carry after
  every ``every`` steps: ``(carry, ys, states [N // every, ...])``. The steps are scanned in groups
  of ``every`` (a scan of scans: only the group ends' carries are kept); the last group is padded
  with steps whose inputs are ``fill`` (one scalar per ``xs`` leaf), which must leave the carry
  unchanged, and their outputs are dropped."""
  n = xs[0].shape[0]
  groups = -(-n // every)
  pad = groups * every - n
  xs = tuple(jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], f, x.dtype)]) if pad else x
             for x, f in zip(xs, fill))
  xs = tuple(x.reshape((groups, every) + x.shape[1:]) for x in xs)

  def group(s, xg):
    s, ys = jax.lax.scan(step, s, xg)
    return s, (ys, s)

  s, (ys, states) = jax.lax.scan(group, s0, xs)
  return s, ys.reshape((groups * every,) + ys.shape[2:])[:n], states[:n // every]


def kda_naive(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None,
              states_every=None):
  """Token-by-token recurrence. Returns (o ``[B, T, HV, V]``, final state ``[B, HV, K, V]``)
  and with ``states_every = L`` (tokens) also the states after every L tokens
  ``[B, T // L, HV, K, V]``.

  At a segment start the state is reset to zero before the token is processed.
  """
  b, t, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  q = expand_heads(q, hv).astype(acc)
  k = expand_heads(k, hv).astype(acc)
  v, g, beta = v.astype(acc), g.astype(acc), beta.astype(acc)
  s0 = (jnp.zeros((b, hv, kd, vd), acc) if initial_state is None
        else initial_state.astype(acc))
  restart = restart_mask(segment_ids, b, t)

  def step(s, xs):
    qt, kt, vt, gt, bt, rt = xs  # [B,HV,K], [B,HV,K], [B,HV,V], [B,HV,K], [B,HV], [B]
    s = jnp.where(rt[:, None, None, None], 0.0, s)
    s = s * jnp.exp(gt)[..., None]
    pred = jnp.einsum("bhk,bhkv->bhv", kt, s)
    s = s + jnp.einsum("bhk,bhv->bhkv", kt, bt[..., None] * (vt - pred))
    o = scale * jnp.einsum("bhk,bhkv->bhv", qt, s)
    return s, o

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta, restart))
  if not states_every:
    s, o = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1), s
  # padding tokens (k = 0, g = 0, no restart) leave the state unchanged
  s, o, states = scan_states(step, s0, xs, states_every, (0, 0, 0, 0, 0, False))
  return jnp.moveaxis(o, 0, 1), s, jnp.moveaxis(states, 0, 1)


def pad_time(x: jax.Array, multiple: int) -> jax.Array:
  """Zero-pads axis 1 (time) of ``x`` up to a multiple of ``multiple``."""
  pad = -x.shape[1] % multiple
  if not pad:
    return x
  return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def masked_sums(mask: jax.Array, g: jax.Array) -> jax.Array:
  """``out[..., i, d] = sum_t mask[i, t] g[..., t, d]``: windowed sums over axis -2 as one 0/1
  matrix product (cheaper to compile and differentiate than nested cumsums). Each window is
  summed directly, so its rounding error is relative to its own size."""
  return jnp.einsum("it,...td->...id", mask.astype(g.dtype), g, precision=_HI)


def suffix_sum(g: jax.Array) -> jax.Array:
  """``sum_{t > i} g_t`` over axis -2 of ``g [..., C, D]``."""
  c = g.shape[-2]
  return masked_sums(jnp.arange(c)[None, :] > jnp.arange(c)[:, None], g)


def decay_products(a: jax.Array, b: jax.Array, g: jax.Array, sub: int = SUB_TILE) -> jax.Array:
  """``P[i, j] = sum_d a[i, d] b[j, d] exp(sum_{j < t <= i} g[t, d])`` for ``j <= i``, zero above
  the diagonal, without taking ``exp`` of any positive number.

  a, b, g: ``[..., C, D]`` (leading dims broadcast), g the per-token log-decay (``<= 0``), C a
  multiple of ``sub``. Returns ``[..., C, C]``.

  Diagonal ``sub x sub`` tiles sum the exponent of each pair ``i >= j`` directly. For row tile
  ``I >= 1`` the earlier columns factor through the reference point ``r_I``, the token just before
  the tile: ``exp(G_i - G_j) = exp(G_i - r_I) exp(r_I - G_j)``, both exponents <= 0 and each summed
  directly over its own tokens. No exponent is the difference of two large cumulative sums, so a
  huge decay early in the chunk does not cost precision on the later pairs.
  """
  c, d = g.shape[-2:]
  if c % sub:
    raise ValueError(f"decay_products: chunk length {c} must be a multiple of the sub-tile {sub}")
  n = c // sub
  lead = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2], g.shape[:-2])
  at, bt, gt = (x.reshape(*x.shape[:-2], n, sub, d) for x in (a, b, g))
  idx = jnp.arange(sub)
  i_, j_, t_ = idx[:, None, None], idx[None, :, None], idx[None, None, :]
  span = ((j_ < t_) & (t_ <= i_)).astype(g.dtype)  # [i, j, t]: token t lies in (j, i]
  pair = jnp.einsum("ijt,...td->...ijd", span, gt, precision=_HI)  # [..., n, i, j, D]
  pair = jnp.where((idx[:, None] >= idx[None, :])[:, :, None], pair, -jnp.inf)
  diag = jnp.einsum("...id,...jd,...ijd->...ij", at, bt, jnp.exp(pair), precision=_HI)
  rows = jnp.einsum("...Iij,IJ->...IiJj", diag, jnp.eye(n, dtype=diag.dtype), precision=_HI)
  rows = rows.reshape(*lead, n, sub, c)
  if n > 1:
    left = at[..., 1:, :, :] * jnp.exp(masked_sums(idx[None, :] <= idx[:, None], gt[..., 1:, :, :]))
    pos = jnp.arange(c)
    start = sub * jnp.arange(1, n)[:, None, None]  # [n-1, 1, 1]: first token of row tile I
    to_ref = jnp.einsum("Ijt,...td->...Ijd",  # [..., n-1, C, D]: sum_{j < t < start_I} g_t
                        ((pos[:, None] < pos[None, :]) & (pos[None, :] < start)).astype(g.dtype),
                        g, precision=_HI)
    before = pos[None, :, None] < start  # [n-1, C, 1]
    right = b[..., None, :, :] * jnp.exp(jnp.where(before, to_ref, -jnp.inf))
    off = jnp.einsum("...Iid,...Ijd->...Iij", left, right, precision=_HI)
    rows = rows.at[..., 1:, :, :].add(off)
  return rows.reshape(*lead, c, c)


def kda_chunked(q, k, v, g, beta, *, scale, initial_state=None, segment_ids=None, chunk_size=64,
                states_every=None):
  """Chunked KDA (SPEC section 2), same arguments and results as :func:`kda_naive`, except that
  ``states_every = M`` counts chunks: the states after every M chunks, ``[B, T // (M C), HV, K,
  V]``, from the same pass (the chunks scanned in groups of M).

  T is padded to a multiple of ``chunk_size`` with tokens of ``g = 0, beta = 0, k = q = v = 0``,
  which leave the state unchanged; their outputs are sliced off.

  Within a chunk of C tokens with cumulative log-decay ``G`` (from the chunk start) and carried
  state ``S`` (G is only used as ``exp(G)``, whose rounding is relative to its own size), the
  corrected values ``V' = beta (V - (K e^G) S - A V')`` (A: the strictly lower
  ``k_i . k_j e^(G_i - G_j)``) are ``V' = U - W S`` with ``U, W`` from one unit-lower triangular
  solve of ``I + diag(beta) A``. Then ``O = scale ((Q e^G) S + mask(Q K^T decay) V')`` and
  ``S <- e^(G_C) S + (K e^(G_C - G))^T V'``. Only ``exp`` of non-positive numbers is ever taken
  and every decay exponent is summed directly over the tokens it spans (``G_C - G`` by
  :func:`suffix_sum`; pairs by :func:`decay_products`), so the unbounded softplus gate can neither
  overflow nor lose precision to cancellation.

  Segment restarts inside a chunk: tokens get a local segment index (restarts counted from the
  chunk start). Intra-chunk matrices are masked to same-segment pairs; only tokens of local
  segment 0 read the carried state; only tokens of the chunk's last segment write the outgoing
  state, and the carried state survives only when the chunk has no restart.

  The pairwise work is vectorised over all chunks; a ``lax.scan`` carries the state across chunks.
  Accumulation is float32 (float64 for float64 inputs).
  """
  b, t, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  if chunk_size <= 0 or chunk_size % SUB_TILE:
    raise ValueError(f"kda_chunked: chunk_size {chunk_size} must be a positive multiple of "
                     f"{SUB_TILE}")
  acc = jnp.promote_types(q.dtype, jnp.float32)
  c = chunk_size
  restart = pad_time(restart_mask(segment_ids, b, t), c)
  n = restart.shape[1] // c

  def chunks(x):  # [B, T, HV, D] -> [B, HV, N, C, D]
    return jnp.moveaxis(pad_time(x.astype(acc), c).reshape(b, n, c, hv, -1), 3, 1)

  q, k = chunks(expand_heads(q, hv)), chunks(expand_heads(k, hv))
  v, g = chunks(v), chunks(g)
  beta = chunks(beta[..., None])[..., 0]  # [B, HV, N, C]
  seg = jnp.cumsum(restart.reshape(b, 1, n, c), axis=-1)  # [B, 1, N, C] local segment index
  fresh = (seg == 0).astype(acc)  # reads the carried state
  last = (seg == seg[..., -1:]).astype(acc)  # writes the outgoing state
  same = seg[..., :, None] == seg[..., None, :]
  lower = jnp.tril(jnp.ones((c, c), bool))

  G = masked_sums(lower, g)  # cumulative decay from the chunk start
  p_kk, p_qk = decay_products(jnp.stack([k, q]), k, g)
  a_kk = jnp.where(same & lower & ~jnp.eye(c, dtype=bool), p_kk, 0.0)
  a_qk = jnp.where(same & lower, p_qk, 0.0) * scale
  m = jnp.eye(c, dtype=acc) + beta[..., None] * a_kk
  rhs = beta[..., None] * jnp.concatenate([v, k * jnp.exp(G) * fresh[..., None]], axis=-1)
  uw = jax.scipy.linalg.solve_triangular(m, rhs, lower=True, unit_diagonal=True)
  u, w = uw[..., :vd], uw[..., vd:]
  qe = scale * q * jnp.exp(G) * fresh[..., None]
  kd_out = k * jnp.exp(suffix_sum(g)) * last[..., None]
  carry = jnp.exp(G[..., -1, :]) * fresh[..., -1:]  # [B, HV, N, K]

  def step(s, xs):
    u, w, qe, a_qk, kd_out, carry = xs
    vp = u - jnp.einsum("bhck,bhkv->bhcv", w, s, precision=_HI)
    o = (jnp.einsum("bhck,bhkv->bhcv", qe, s, precision=_HI)
         + jnp.einsum("bhcj,bhjv->bhcv", a_qk, vp, precision=_HI))
    s = carry[..., None] * s + jnp.einsum("bhck,bhcv->bhkv", kd_out, vp, precision=_HI)
    return s, o

  s0 = (jnp.zeros((b, hv, kd, vd), acc) if initial_state is None else initial_state.astype(acc))
  xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, qe, a_qk, kd_out, carry))
  if states_every:  # padding chunks (no values, decay 1) leave the state unchanged
    s, o, states = scan_states(step, s0, xs, states_every, (0, 0, 0, 0, 0, 1))
  else:
    s, o = jax.lax.scan(step, s0, xs)  # o: [N, B, HV, C, V]
  o = jnp.moveaxis(o, 0, 2).reshape(b, hv, n * c, vd)[:, :, :t]
  if not states_every:
    return jnp.moveaxis(o, 1, 2), s
  return jnp.moveaxis(o, 1, 2), s, jnp.moveaxis(states, 0, 1)[:, :t // (states_every * c)]
