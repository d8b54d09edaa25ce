"""MoE ops: grouped matmuls and token permutation.

``implementation``: ``"xla"`` (``jax.lax.ragged_dot``, the reference), ``"pallas_gpu"`` (Mosaic GPU
kernels for Hopper, :mod:`pallas_kernels.moe.gpu`), ``"pallas_tpu"`` (megablox,
:mod:`pallas_kernels.moe.tpu`), ``"pallas"`` (the current platform's) or ``None``: Pallas on
GPU/TPU where the kernels take the operands (GPU: bf16/f16, K and N multiples of 64), else XLA.
An explicit Pallas implementation raises on operands its kernels do not take. On a CPU backend the
Pallas kernels run in interpret mode.

The token permutation has GPU kernels (:mod:`pallas_kernels.moe.permute_gpu`, Triton) for
:func:`permute`'s row gather and :func:`unpermute`'s backward; ``"pallas_tpu"`` (and ``"pallas"``
or ``None`` on TPU) means XLA for them.
"""

from __future__ import annotations

import jax

from pallas_kernels import default_backend, resolve_implementation
from pallas_kernels.moe import reference

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu", "pallas")


def resolve(implementation: str | None) -> str:
  """The concrete implementation name for ``implementation`` on the current backend."""
  return resolve_implementation("moe", implementation, IMPLEMENTATIONS,
                                {"gpu": "pallas", "tpu": "pallas", "cpu": "xla"})


def gmm(lhs, rhs, group_sizes, *, implementation=None, preferred_element_type=None):
  """Grouped matmul: rows of ``lhs [M, K]`` sorted by group, ``rhs [E, K, N]``,
  ``group_sizes [E]`` int32 (sum <= M; rows past the sum give zeros). Returns ``[M, N]``.
  Differentiable in lhs and rhs."""
  impl = resolve(implementation)
  if impl != "xla":
    from pallas_kernels.moe import pallas as _pallas
    backend = impl.removeprefix("pallas_")
    if implementation is not None or _pallas.supported(lhs, rhs, group_sizes, backend):
      return _pallas.gmm(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                         backend=backend)
  return reference.gmm(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def expert_mlp(x, expert_ids, weights, w_gate_up, w_down, activation, *, implementation=None):
  """Routed experts on tokens ``x [N, D]``.

  expert_ids, weights: ``[N, k]``; w_gate_up: ``[E, D, 2F]`` (gate then up); w_down: ``[E, F, D]``;
  activation: ``gu [M, 2F] -> h [M, F]`` (gate then up, packed). Sorts the N*k token-expert
  pairs by expert (stable), runs the GLU with two grouped matmuls and scatters back with the
  routing weights. Returns ``[N, D]``. ``implementation`` picks the grouped matmuls' kernels and
  the permutation's (:func:`permute`'s gather, :func:`unpermute`'s backward).

  On TPU, with fewer pairs than a quarter of the experts (decoding a few requests), the pairs run
  one after another (:func:`reference.looped_mlp`), each expert's weights sliced where they lie:
  a loop costs no kernel launches there, and XLA copies any gather of the pairs' weights out
  whole. GPUs and CPUs take the grouped path at every size: XLA turns a gathered formulation
  into column reductions far from the card's bandwidth (benchmarks/RESULTS.md, Serving: the few
  pairs on the grouped path), while the grouped matmuls read each picked expert once.
  """
  n, k = expert_ids.shape
  if 4 * n * k <= w_gate_up.shape[0] and default_backend() == "tpu":
    with jax.named_scope("looped_experts"):
      return reference.looped_mlp(x, expert_ids, weights, w_gate_up, w_down, activation)
  with jax.named_scope("permute"):
    xs, group_sizes, order = permute(x, expert_ids, w_gate_up.shape[0],
                                     implementation=implementation)
  with jax.named_scope("experts"):
    h = gmm(xs, w_gate_up, group_sizes, implementation=implementation)
    h = activation(h).astype(x.dtype)
    y = gmm(h, w_down, group_sizes, implementation=implementation)
  with jax.named_scope("unpermute"):
    return unpermute(y, order, weights, implementation=implementation)


def _permute_kernels(implementation, *arrays) -> bool:
  """Whether the permutation's GPU kernels run for these operands (see the module docstring)."""
  if resolve(implementation) != "pallas_gpu":
    return False
  from pallas_kernels.moe import permute_gpu
  return implementation is not None or all(a.dtype in permute_gpu.DTYPES for a in arrays)


def permute(x, expert_ids, num_experts, *, implementation=None):
  """Sorts token-expert pairs by expert (stable) and gathers the tokens into that order.

  x: ``[N, D]``; expert_ids: ``[N, k]`` int. Returns (``xs [N*k, D]``, ``group_sizes [E]`` int32,
  ``order [N*k]`` int32: the flat pair index ``n*k + j`` of each sorted row). The gather is
  :func:`reference.permute`'s (XLA) or, with ``"pallas_gpu"`` (``None`` on GPU), one Triton
  kernel."""
  if not _permute_kernels(implementation, x):
    return reference.permute(x, expert_ids, num_experts)
  from pallas_kernels.moe import permute_gpu
  order, inverse = reference.sort_pairs(expert_ids)
  xs = permute_gpu.expand(x, order, inverse, expert_ids.shape[1])
  return xs, reference.expert_counts(expert_ids, num_experts), order


def unpermute(y, order, weights, *, implementation=None):
  """Inverse of :func:`permute`: ``y [N*k, D]`` rows sorted by expert, ``order [N*k]`` int32 (the
  pair ``n*k + j`` of each sorted row), ``weights [N, k]``. Returns ``out [N, D]`` in y's dtype,
  ``out[n] = sum_j weights[n, j] * y[row of pair n*k + j]`` accumulated in float32.

  The forward is always :func:`reference.unpermute` (XLA, the meaning of ``"xla"``);
  ``"pallas_gpu"`` computes both cotangents (dy, dweights) in one Triton kernel; ``None`` takes it
  on GPU where it takes the operands (float32/bf16/f16), XLA elsewhere."""
  if not _permute_kernels(implementation, y, weights):
    return reference.unpermute(y, order, weights)
  from pallas_kernels.moe import permute_gpu
  return permute_gpu.unpermute(y, order, weights)


__all__ = ["gmm", "expert_mlp", "permute", "unpermute", "resolve", "IMPLEMENTATIONS"]
