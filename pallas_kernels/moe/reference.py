"""XLA reference for grouped matmuls, and the token permutation shared by every implementation.

The permutation never builds a ``[tokens, experts]`` one-hot: one stable sort of the ``N*k``
expert ids, its inverse (a scatter of an iota), and row gathers whose VJPs are row gathers with
the other permutation (no scatter-add, no dense ``[N*k, N]`` matrix in the gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None):
  """``lhs [M, K]`` (rows sorted by group) x ``rhs [E, K, N]`` -> ``[M, N]``."""
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                           preferred_element_type=preferred_element_type or lhs.dtype)
  return out


def looped_mlp(x, expert_ids, weights, w_gate_up, w_down, activation):
  """Routed experts one token-expert pair after another (``lax.map``): ``x [N, D]``, expert_ids
  and weights ``[N, k]``, ``w_gate_up [E, D, 2F]``, ``w_down [E, F, D]`` -> ``[N, D]`` (see
  ``pallas_kernels.moe.expert_mlp``; for few pairs on TPU). Each pair's expert weights are sliced
  where they lie and feed the products directly: a loop costs no kernel launches there, and XLA
  copies a gather of every pair's weights out whole (benchmarks/RESULTS.md, Serving: Kimi Linear
  48B's decode step, compile-only)."""
  n, k = expert_ids.shape
  acc = jnp.promote_types(x.dtype, jnp.float32)
  flat = expert_ids.reshape(-1)

  def pair(p):
    e = flat[p]
    gu = jnp.dot(x[p // k], w_gate_up[e], preferred_element_type=acc)
    h = activation(gu.astype(x.dtype)[None]).astype(x.dtype)[0]
    return jnp.dot(h, w_down[e], preferred_element_type=acc)
  y = jax.lax.map(pair, jnp.arange(n * k)).reshape(n, k, -1)
  return jnp.einsum("nkd,nk->nd", y, weights.astype(acc)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _expand(x, order, inverse, k):
  """``x [N, D]`` -> ``[N*k, D]``: row r is token ``order[r] // k``."""
  return jnp.take(x, order // k, axis=0)


def _expand_fwd(x, order, inverse, k):
  return _expand(x, order, inverse, k), (order, inverse)


def expand_grad(g, inverse, k):
  """The cotangent of the expansion ``x [N, D] -> [N*k, D]`` for ``g [N*k, D]``: each token's k
  rows gathered back by ``inverse`` and summed (float32 accumulation), in g's dtype."""
  n = inverse.shape[0] // k
  acc = jnp.promote_types(g.dtype, jnp.float32)
  return jnp.take(g, inverse, axis=0).reshape(n, k, -1).sum(axis=1, dtype=acc).astype(g.dtype)


def _expand_bwd(k, res, g):
  _, inverse = res
  return expand_grad(g, inverse, k), None, None


_expand.defvjp(_expand_fwd, _expand_bwd)


@jax.custom_vjp
def move_rows(y, index, inverse):
  """``y[index]`` (``[P, W]`` from ``y [M, W]``; an index out of range gives a zero row), where
  ``index`` and ``inverse [M]`` are inverse maps, a permutation or partial (row ``index[p]``
  lands at p iff ``inverse[index[p]] == p``; out of range: nowhere). Its transpose is the
  gather by ``inverse``, not a scatter-add into zeros: XLA makes the zero-filled bases of
  same-shaped scatters together (in K3's expert dispatch every layer's ``[R * C, L]`` at once,
  4.7 GB each at 1M context)."""
  return jnp.take(y, index, axis=0, mode="fill", fill_value=0)


def _move_rows_fwd(y, index, inverse):
  return move_rows(y, index, inverse), (index, inverse)


def _move_rows_bwd(res, g):
  index, inverse = res
  return move_rows(g, inverse, index), None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def permute(x, expert_ids, num_experts):
  """Sorts token-expert pairs by expert (stable) and gathers the tokens into that order.

  x: ``[N, D]``; expert_ids: ``[N, k]`` int. Returns (``xs [N*k, D]``, ``group_sizes [E]`` int32,
  ``order [N*k]`` int32: the flat pair index ``n*k + j`` of each sorted row).
  """
  order, inverse = sort_pairs(expert_ids)
  xs = _expand(x, order, inverse, expert_ids.shape[1])
  return xs, expert_counts(expert_ids, num_experts), order


def sort_pairs(expert_ids):
  """(``order [N*k]``: the flat pair index ``n*k + j`` of each row sorted by expert (stable),
  ``inverse``: its inverse permutation), both int32, for expert_ids ``[N, k]``."""
  n, k = expert_ids.shape
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  iota = jnp.arange(n * k, dtype=jnp.int32)
  _, order = jax.lax.sort((flat, iota), num_keys=1, is_stable=True)
  return order, inverse_map(order)


def expert_counts(expert_ids, num_experts, valid=None):
  """``[E]`` int32: token-expert pairs per expert, for expert_ids ``[N, k]`` (only the tokens
  where ``valid [N]`` is true, when given). One compare-and-sum reduction: no scatter-add
  contending for E counters, no searchsorted loop of small kernels."""
  hit = expert_ids[..., None] == jnp.arange(num_experts, dtype=expert_ids.dtype)  # [N, k, E]
  if valid is not None:
    hit = hit & valid[:, None, None]
  return jnp.sum(hit, axis=(0, 1), dtype=jnp.int32)


def inverse_map(index, size: int | None = None):
  """``[size]`` inverse of the map ``index [P]`` (one scatter of an iota): ``inverse[index[p]] =
  p``; entries of index ``>= size`` (dropped rows) land nowhere, and positions nothing lands on
  get P. With size None (= P) and a permutation, its inverse permutation."""
  p = index.shape[0]
  iota = jnp.arange(p, dtype=index.dtype)
  if size is None:  # a permutation: every index distinct
    return jnp.full((p,), p, index.dtype).at[index].set(iota, unique_indices=True)
  return jnp.full((size,), p, index.dtype).at[index].set(iota, mode="drop")


def unpermute(y, order, weights):
  """Inverse of :func:`permute`: ``y [N*k, D]`` in sorted order, weighted sum over each token's k
  experts with ``weights [N, k]`` (float32 accumulation, or float64 for float64 inputs). Returns ``[N, D]`` in y's dtype."""
  n, k = weights.shape
  pairs = move_rows(y, inverse_map(order), order)  # pair order
  acc = jnp.promote_types(y.dtype, jnp.float32)
  out = jnp.einsum("nkd,nk->nd", pairs.reshape(n, k, -1).astype(acc), weights.astype(acc))
  return out.astype(y.dtype)
