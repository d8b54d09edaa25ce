"""Sigmoid top-k routing with a selection-only bias, and the bias updates that balance it.

Quantile Balancing (SPEC section 5): with N tokens, E experts and top-k, each expert's target
load is ``q = N*k/E``. For token i the cutoff ``alpha_i`` is its (k+1)-th largest biased score;
the margin ``m_ij = s_ij - alpha_i``; the next bias is ``b_j = -((q+1)-th largest of m_.j)``,
mean-centred. At scale the same quantile is read from per-expert histograms of
``alpha_i - s_ij`` (bins over ``[min b - 1, max b + 1]``), which sum across micro-batches and
ranks. The baseline it replaces: ``b_j += gamma * sign(mean_load - load_j)``.

With the tokens split over a mesh (:func:`sharded_bias_stat`), ``quantile_hist`` builds each
device's histogram ``[E, bins]`` of its own tokens and one ``psum`` over every token axis sums
them: ``E * bins`` int32 per step and layer, whatever the batch. The bins depend only on the
current bias, which is replicated, so every rank reads the same counts and computes the same next
bias. The other modes take the global arrays (GSPMD inserts their collectives).

All functions are pure; the bias is non-trainable state that the train step updates.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from k3jax.config import MoEConfig
from pallas_kernels import select
from pallas_kernels.moe import reference as moe_reference
from sharding.rules import token_spec, token_sum


def route(scores: jax.Array, bias: jax.Array, cfg: MoEConfig):
  """Top-k selection on ``scores + bias``; weights from the unbiased scores.

  scores: ``[N, E]`` sigmoid scores (float32); bias: ``[E]``.
  Returns (expert ids ``[N, k]`` int32, weights ``[N, k]`` float32).
  """
  _, ids = jax.lax.top_k(scores + bias.astype(scores.dtype), cfg.top_k)
  w = jnp.take_along_axis(scores, ids, axis=-1)
  if cfg.renormalize and cfg.top_k > 1:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  return ids.astype(jnp.int32), w * cfg.routed_scaling_factor


def expert_load(ids: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
  """``[E]`` float32: routed token slots per expert (padding tokens excluded)."""
  return moe_reference.expert_counts(ids, num_experts, valid).astype(jnp.float32)


def _margins(scores, bias, top_k, valid):
  """``alpha_i - s_ij`` ``[N, E]`` (float32) with alpha_i the (k+1)-th largest biased score;
  +inf on padding tokens so they never count."""
  biased = scores + bias.astype(scores.dtype)
  alpha = jax.lax.top_k(biased, top_k + 1)[0][:, -1:]
  d = alpha - scores
  if valid is not None:
    d = jnp.where(valid[:, None], d, jnp.inf)
  return d


def _target(n_valid, cfg: MoEConfig):
  return jnp.floor(n_valid * cfg.top_k / cfg.num_experts).astype(jnp.int32)


def kth_smallest(x: jax.Array, k, implementation: str | None = None) -> jax.Array:
  """``jnp.sort(x, axis=0)[k]`` ``[E]`` for ``x [N, E]`` (as float32) and an int ``0 <= k < N``
  (traced or not), exactly and without a sort: :func:`pallas_kernels.select.kth_smallest`, a
  radix select over the floats' order-preserving uint32 keys (one Triton kernel on GPU, fused XLA
  reductions elsewhere; ``implementation`` picks one). No NaNs."""
  return select.kth_smallest(x.astype(jnp.float32), k, implementation=implementation)


def quantile_bias(scores, bias, cfg: MoEConfig, valid=None, implementation=None) -> jax.Array:
  """Exact Quantile Balancing: the next bias ``[E]`` from one batch.

  One QB step takes the cutoffs ``alpha_i`` at the current bias (SPEC: one step per batch,
  installed for the next). The selection then shifts every token's cutoff, so
  ``cfg.balancing_iters > 1`` repeats the step on the same batch, each time from the bias the
  previous one produced: one step takes a strongly skewed batch from max/mean load 2.4 to about
  1.15, four to about 1.03. In training the bias carries over, so successive batches refine it.
  """
  n_valid = scores.shape[0] if valid is None else jnp.sum(valid)
  q = _target(n_valid, cfg)
  for _ in range(cfg.balancing_iters):
    d = _margins(scores, bias, cfg.top_k, valid)
    # b_j = -((q+1)-th largest margin) = (q+1)-th smallest of alpha - s
    new = kth_smallest(d, jnp.minimum(q, d.shape[0] - 1), implementation)
    bias = new - jnp.mean(new)
  return bias


def hist_edges(bias: jax.Array, bins: int) -> tuple[jax.Array, jax.Array]:
  lo = jnp.min(bias) - 1.0
  hi = jnp.max(bias) + 1.0
  return lo, (hi - lo) / bins


def quantile_histogram(scores, bias, cfg: MoEConfig, valid=None) -> jax.Array:
  """``[E, bins]`` int32 per-expert histogram of ``alpha_i - s_ij`` over
  ``[min b - 1, max b + 1]`` (values outside land in the edge bins; padding is not counted)."""
  bins = cfg.balancing_bins
  d = _margins(scores, bias, cfg.top_k, valid)
  lo, width = hist_edges(bias, bins)
  idx = jnp.clip(jnp.floor((d - lo) / width), 0, bins - 1).astype(jnp.int32)
  e = d.shape[1]
  flat = (jnp.arange(e)[None, :] * bins + idx).reshape(-1)
  ones = jnp.isfinite(d).astype(jnp.int32).reshape(-1)
  return jnp.zeros((e * bins,), jnp.int32).at[flat].add(ones).reshape(e, bins)


def bias_from_histogram(hist: jax.Array, bias: jax.Array, cfg: MoEConfig) -> jax.Array:
  """The (q+1)-th smallest value of each expert's histogram by cumulative count, with linear
  interpolation inside the bin; mean-centred."""
  bins = hist.shape[1]
  n_valid = jnp.sum(hist[0])
  q = _target(n_valid, cfg).astype(jnp.float32)
  lo, width = hist_edges(bias, bins)
  cum = jnp.cumsum(hist, axis=1).astype(jnp.float32)  # [E, bins]
  rank = q + 1.0
  j = jnp.argmax(cum >= rank, axis=1)  # first bin whose cumulative count reaches the rank
  before = jnp.where(j > 0, jnp.take_along_axis(cum, (j - 1)[:, None], 1)[:, 0], 0.0)
  count = jnp.take_along_axis(hist, j[:, None], 1)[:, 0].astype(jnp.float32)
  frac = jnp.clip((rank - before - 0.5) / jnp.maximum(count, 1.0), 0.0, 1.0)
  new = lo + (j.astype(jnp.float32) + frac) * width
  return new - jnp.mean(new)


def bias_stat(scores, bias, ids, cfg: MoEConfig, valid=None, implementation=None):
  """What :func:`next_bias` needs from one micro-batch, by ``cfg.balancing``."""
  if cfg.balancing == "quantile":
    return quantile_bias(scores, bias, cfg, valid, implementation)
  if cfg.balancing == "quantile_hist":
    return quantile_histogram(scores, bias, cfg, valid)
  return expert_load(ids, cfg.num_experts, valid)


def sharded_bias_stat(scores, bias, ids, cfg: MoEConfig, valid=None):
  """:func:`bias_stat` for scores ``[N, E]``, ids ``[N, k]``, valid ``[N]`` whose N is split over
  the token axes of the current mesh (whole without one). There exact QB selects with XLA's
  reductions, which GSPMD splits too, rather than the one-device Pallas kernel (which would
  gather every rank's margins first)."""
  split = token_spec()[0] is not None
  if cfg.balancing != "quantile_hist" or not split:
    return bias_stat(scores, bias, ids, cfg, valid, implementation="xla" if split else None)
  if valid is None:
    return token_sum(lambda s, b: quantile_histogram(s, b, cfg), (scores,), (bias,))
  return token_sum(lambda s, v, b: quantile_histogram(s, b, cfg, v), (scores, valid), (bias,))


def sign_update(bias, load, rate: float) -> jax.Array:
  """The baseline: ``b_j += rate * sign(mean_load - load_j)``."""
  return bias + rate * jnp.sign(jnp.mean(load) - load)


def next_bias(cfg: MoEConfig, bias: jax.Array, stats: Sequence[dict]) -> jax.Array:
  """The bias for the next batch from the stats of one or more micro-batches.

  stats: ``aux["moe"][layer]`` dicts (``bias_stat`` and ``load``), already summed across
  devices. Exact QB averages the micro-batch biases; histogram QB sums the histograms; the sign
  baseline sums the loads.
  """
  if cfg.balancing == "none":
    return bias
  if cfg.balancing == "quantile":
    return jnp.mean(jnp.stack([s["bias_stat"] for s in stats]), axis=0).astype(bias.dtype)
  total = sum(s["bias_stat"] for s in stats)
  if cfg.balancing == "quantile_hist":
    return bias_from_histogram(total, bias, cfg).astype(bias.dtype)
  return sign_update(bias, total, cfg.sign_update_rate).astype(bias.dtype)
