"""Kimi Delta Attention ops: ``kda`` (training/prefill) and ``kda_decode`` (serving).

``implementation``:
  - ``"naive"``: token recurrence (pure JAX), the reference;
  - ``"chunked"``: XLA chunked form (chunk 64, 16-token sub-tiles), the CPU default;
  - ``"pallas_gpu"`` / ``"pallas_tpu"``: Pallas kernels (interpret mode on CPU);
  - ``"pallas"``: the Pallas backend of the current platform;
  - ``None``: ``"pallas"`` on GPU and TPU, ``"chunked"`` on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import resolve_implementation
from pallas_kernels.kda import reference
from pallas_kernels.kda.reference import kda_gate, l2norm

IMPLEMENTATIONS = ("naive", "chunked", "pallas_gpu", "pallas_tpu", "pallas")


def resolve(implementation: str | None) -> str:
  """The concrete implementation name for ``implementation`` on the current backend."""
  return resolve_implementation("kda", implementation, IMPLEMENTATIONS,
                                {"gpu": "pallas", "tpu": "pallas", "cpu": "chunked"})


def prepare_inputs(q, k, g, beta, *, use_qk_l2norm, A_log, dt_bias, gate, lower_bound,
                   beta_is_logit):
  """Applies the unfused pre-processing (L2 norm, gate, beta sigmoid) in JAX."""
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  if gate is not None:
    g = kda_gate(g, A_log, dt_bias, gate, lower_bound)
  if beta_is_logit:
    beta = jax.nn.sigmoid(beta.astype(jnp.promote_types(beta.dtype, jnp.float32)))
  return q, k, g, beta


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        segment_ids=None, use_qk_l2norm=False, A_log=None, dt_bias=None, gate=None,
        lower_bound=-5.0, beta_is_logit=False, chunk_size=64, save_residuals=True,
        implementation=None, config=None, output_states_every=None):
  """Kimi Delta Attention over a sequence.

  Args:
    q, k: ``[B, T, H, K]``.
    v: ``[B, T, HV, V]`` with ``HV`` a multiple of ``H``.
    g: ``[B, T, HV, K]``: the log-space decay, or with ``gate`` set, the raw gate projection
      ``f`` from which the decay is computed with ``A_log [HV]`` and ``dt_bias [HV*K]``.
    beta: ``[B, T, HV]`` in (0, 1), or logits with ``beta_is_logit``.
    scale: defaults to ``K ** -0.5``.
    initial_state: ``[B, HV, K, V]`` (float32), the state before the first token of each row.
    output_final_state: return the state after the last token (else None).
    segment_ids: ``[B, T]`` int; the recurrence restarts from zero where the id changes.
    use_qk_l2norm: L2-normalise q and k first.
    gate: None, ``"bounded"`` or ``"softplus"`` (see :func:`kda_gate`).
    save_residuals: ``pallas_gpu`` under differentiation: the forward keeps its chunk factors,
      states and V' for the backward (about 2.6 KB per token and value head at K = V = 128 in
      bf16; faster fwd+bwd); False recomputes them in the backward.
    config: ``pallas_gpu``'s tuning, a :class:`pallas_kernels.kda.config.KdaGpuConfig` (default
      ``default_config`` of the shapes and device); the other implementations take none.
    output_states_every: M (a static int >= 1): also the states after every M chunks of
      ``chunk_size`` tokens, the state after token ``(m + 1) M chunk_size`` for ``m < T // (M
      chunk_size)``, from the same pass (serving's prefix cache). ``pallas_gpu``: forward only
      (no gradient through such a call); ``pallas_tpu``: not supported.
  Returns:
    ``(o [B, T, HV, V], final_state [B, HV, K, V] float32 or None)``; o has v's dtype. With
    ``output_states_every`` a third element, the states ``[B, T // (M chunk_size), HV, K, V]``
    float32.
  """
  impl = resolve(implementation)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  every = output_states_every
  if every is not None and (not isinstance(every, int) or every < 1):
    raise ValueError(f"kda: output_states_every {every!r} must be an int >= 1 (chunks)")
  if impl in ("pallas_gpu", "pallas_tpu"):
    from pallas_kernels.kda import pallas as _pallas  # imported lazily: Pallas is heavy
    o, s, *states = _pallas.kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
        use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, gate=gate,
        lower_bound=lower_bound, beta_is_logit=beta_is_logit, chunk_size=chunk_size,
        save_residuals=save_residuals, config=config, states_every=every,
        backend=impl.removeprefix("pallas_"))
  else:
    q, k, g, beta = prepare_inputs(q, k, g, beta, use_qk_l2norm=use_qk_l2norm, A_log=A_log,
                                   dt_bias=dt_bias, gate=gate, lower_bound=lower_bound,
                                   beta_is_logit=beta_is_logit)
    if impl == "naive":  # the same boundaries, counted in tokens
      fn, kwargs = reference.kda_naive, {"states_every": every and every * chunk_size}
    else:
      fn, kwargs = reference.kda_chunked, {"chunk_size": chunk_size, "states_every": every}
    o, s, *states = fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       segment_ids=segment_ids, **kwargs)
  state_dtype = jnp.promote_types(v.dtype, jnp.float32)
  out = (o.astype(v.dtype), s.astype(state_dtype) if output_final_state else None)
  return out + tuple(x.astype(state_dtype) for x in states)


def kda_decode(q, k, v, g, beta, state, *, slots=None, scale=None, use_qk_l2norm=False,
               A_log=None, dt_bias=None, gate=None, lower_bound=-5.0, beta_is_logit=False,
               implementation=None):
  """A few new tokens for N requests against a pool of recurrent states.

  Args:
    q, k: ``[N, Tn, H, K]``; v: ``[N, Tn, HV, V]``; g: ``[N, Tn, HV, K]``; beta: ``[N, Tn, HV]``
      (pre-processing flags as in :func:`kda`).
    state: ``[S, HV, V, K]`` float32 pool of per-request states (S >= N), K-last: the transpose
      of :func:`kda`'s ``[B, HV, K, V]`` states (:func:`to_pool` / :func:`from_pool`).
    slots: ``[N]`` int32 pool index of each request (default ``arange(N)``).
  Returns:
    ``(o [N, Tn, HV, V], state)``: the pool with the N slots advanced by Tn tokens. Donate the
    pool (``jax.jit(..., donate_argnums=...)``) to update it in place.
  """
  impl = resolve(implementation)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  n = q.shape[0]
  slots = jnp.arange(n, dtype=jnp.int32) if slots is None else slots
  kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                gate=gate, lower_bound=lower_bound, beta_is_logit=beta_is_logit)
  if impl in ("pallas_gpu", "pallas_tpu"):
    from pallas_kernels.kda import decode as _decode
    return _decode.kda_decode(q, k, v, g, beta, state, slots=slots,
                              backend=impl.removeprefix("pallas_"), **kwargs)
  return decode_xla(q, k, v, g, beta, state, slots, **kwargs)


def to_pool(state: jax.Array) -> jax.Array:
  """:func:`kda` states ``[..., K, V]`` -> the decode pool's K-last ``[..., V, K]``. (The decode
  kernel reduces over K once per token; with K last those reductions stay inside a warp.)"""
  return jnp.swapaxes(state, -1, -2)


from_pool = to_pool  # its inverse: pool ``[..., V, K]`` -> :func:`kda` states ``[..., K, V]``


def decode_xla(q, k, v, g, beta, state, slots, *, scale, **prep):
  """The XLA token recurrence of :func:`kda_decode` on the K-last pool ``state [S, HV, V, K]``."""
  q, k, g, beta = prepare_inputs(q, k, g, beta, **prep)
  o, s = reference.kda_naive(q, k, v, g, beta, scale=scale, initial_state=from_pool(state[slots]))
  return o.astype(v.dtype), state.at[slots].set(to_pool(s).astype(state.dtype))


__all__ = ["kda", "kda_decode", "decode_xla", "prepare_inputs", "to_pool", "from_pool",
           "kda_gate", "l2norm", "resolve", "IMPLEMENTATIONS"]
