"""The k-th smallest value of each column as one Triton kernel through Pallas (interpret mode off
GPU).

XLA first maps ``x [N, E]`` to order-preserving uint32 keys (:func:`reference.to_keys`),
transposed, padded with ``0xFFFFFFFF`` (never below any threshold, so never counted) and viewed as
``[E, Np / C, C]`` (``C = 128 * warps``: each thread owns 4 adjacent columns). One program per
expert then finds, without a sort, the largest key ``P`` with ``#{key < P} <= k``, which is the
k-th smallest key: ``bits`` bits per pass from the top, each pass streaming the keys in
``[rows, C]`` steps and counting, for the ``2**bits - 1`` thresholds ``P + d * 2**shift``
(d >= 1), the keys below each into ``[C]`` int32 counters (a sum over the step's rows, within
each thread), summed after the pass; ``P`` grows by the largest d whose count is at most k. Only
compares and adds, no digit masks: a pass costs about ``2 * (2**bits - 1)`` integer ops per key.

The first ``full_bits`` bits take passes over the whole row; one more pass then copies the
candidates, the keys in ``[P, P + 2**(32 - full_bits))``, into a scratch output (column j's to the
first rows of column j), and the remaining passes, ``cand_bits`` bits each, read only those,
counting the keys below ``P`` from the passes before. On QB's margins 12 bits (sign, exponent, 3
mantissa bits) leave a few percent of the row; ties or a narrow column leave more, up to the
whole row (still exact, only slower).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend
from pallas_kernels.select import reference

_PAD = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class Config:
  """``bits`` per pass (1, 2 or 4: ``4 * (2**bits - 1)`` int32 counters per thread), ``full_bits``
  found by passes over the whole row (a multiple of ``bits``, in (0, 32)), ``cand_bits`` per pass
  over the candidates (1, 2 or 4, dividing ``32 - full_bits``), ``prefetch`` (the passes over the
  row load a step ahead), ``rows`` of
  ``C = 128 * warps`` keys per loop step (``4 * rows`` keys per thread in flight; both powers of
  two, shrunk for small N), Triton ``warps`` and ``stages``."""
  bits: int = 2
  full_bits: int = 12
  cand_bits: int = 4
  prefetch: bool = True
  rows: int = 8
  warps: int = 8
  stages: int = 1


def _interpret() -> bool:
  return default_backend() != "gpu"


def _count_pass(load, steps, prefix, below, k, shift, bits, cols, base, prefetch):
  """One radix pass: the prefix and ``#{key < prefix}`` after fixing ``bits`` more bits at
  ``shift``. ``load(i)``: the i-th ``[rows, C]`` step of keys (any rows), of ``steps``; with
  ``prefetch`` a step is loaded while the one before is counted (twice the key registers); base:
  keys below every threshold that ``load`` does not return."""
  thresholds = [prefix + jnp.uint32(d << shift) for d in range(1, 1 << bits)]

  def count(keys, counts):  # int32 sums: under x64 an integer sum widens to int64
    return tuple(c + jnp.sum(keys < t, axis=0, dtype=jnp.int32)
                 for c, t in zip(counts, thresholds))

  def step(i, carry):  # carry: (this step's keys, counters); the next step's loads go first
    keys, counts = carry
    return load(jnp.minimum(i + 1, steps - 1)), count(keys, counts)

  zeros = tuple(jnp.zeros((cols,), jnp.int32) for _ in thresholds)
  if prefetch:
    _, counts = jax.lax.fori_loop(0, steps, step, (load(0), zeros))
  else:
    counts = jax.lax.fori_loop(0, steps, lambda i, c: count(load(i), c), zeros)
  counts = [base + jnp.sum(c, dtype=jnp.int32) for c in counts]
  ok = [c <= k for c in counts]  # #{key < threshold} <= k: the answer is at or above it
  d = functools.reduce(jnp.add, [o.astype(jnp.uint32) for o in ok])
  below = functools.reduce(jnp.maximum, [jnp.where(o, c, below) for o, c in zip(ok, counts)])
  return prefix + (d << shift), below


def _kernel(k_ref, key_ref, out_ref, cand_ref, *, steps, rows, bits, full_bits, cand_bits,
            prefetch):
  """k_ref: ``[1]`` int32; key_ref: ``[R, C]`` uint32 (this program's expert); out_ref: ``[1]``
  uint32, the k-th smallest key; cand_ref: ``[R, C]`` uint32 scratch, column j's candidates in
  its first rows."""
  k = k_ref[0]
  cols = key_ref.shape[1]
  shifts = list(range(32 - bits, -1, -bits))
  full = lambda i: key_ref[pl.ds(i * rows, rows), :]
  prefix, below = jnp.uint32(0), jnp.int32(0)  # below: #{key < prefix}
  for shift in shifts[:full_bits // bits]:
    prefix, below = _count_pass(full, steps, prefix, below, k, shift, bits, cols, 0, prefetch)

  col_ids = jnp.arange(cols, dtype=jnp.int32)
  window = jnp.uint32(1 << (32 - full_bits))

  # An offset of 0 that Triton cannot prove aligned: the compaction's and the candidates' loads
  # then take the one key per thread layout of the scattered stores and of ``found`` (no layout
  # conversions through shared memory).
  zero = jnp.minimum(jnp.maximum(k, 0), 0)

  def compact(i, found):  # found: [C] candidates so far per column
    rows_in = [key_ref[i * rows + r, col_ids + zero] for r in range(rows)]  # all loads first
    for keys in rows_in:
      hit = (keys - prefix) < window  # prefix <= key < prefix + window
      plgpu.store(cand_ref.at[found, col_ids], keys, mask=hit)
      found = found + hit.astype(jnp.int32)
    return found

  found = jax.lax.fori_loop(0, steps, compact, jnp.zeros((cols,), jnp.int32))
  # a reduction across warps: a barrier between the stores above and the loads below
  longest = jnp.max(found)

  def cand(i):  # rows [i * rows, (i + 1) * rows) of the candidates, [rows, C]
    r = i * rows + jnp.arange(rows, dtype=jnp.int32)
    return plgpu.load(cand_ref.at[r[:, None], (col_ids + zero)[None, :]],
                      mask=r[:, None] < found[None, :], other=jnp.uint32(_PAD))

  base = below
  for shift in range(32 - full_bits - cand_bits, -1, -cand_bits):
    prefix, below = _count_pass(cand, (longest + rows - 1) // rows, prefix, below, k, shift,
                                cand_bits, cols, base, False)
  out_ref[...] = jnp.full((1,), prefix, jnp.uint32)


def kth_keys(keys: jax.Array, k: jax.Array, config: Config = Config()) -> jax.Array:
  """``[E]`` uint32: the k-th smallest key of each expert in ``keys [E, R, C]`` (R a multiple of
  ``config.rows``, C a power of two); k: ``[1]`` int32 with ``0 <= k < R * C``."""
  e, r, c = keys.shape
  if (config.bits not in (1, 2, 4) or config.cand_bits not in (1, 2, 4)
      or config.full_bits % config.bits or (32 - config.full_bits) % config.cand_bits
      or not 0 < config.full_bits < 32 or r % config.rows):
    raise ValueError(f"select: bits {config.bits} and cand_bits {config.cand_bits} must be 1, 2 "
                     f"or 4, full_bits {config.full_bits} in (0, 32) a multiple of bits and "
                     f"32 - full_bits of cand_bits, the rows {r} a multiple of config.rows "
                     f"{config.rows}")
  if config.warps < 2 and not _interpret():
    raise ValueError("select: warps must be >= 2 on a GPU (the barrier between the candidates' "
                     "stores and loads is a reduction across warps)")
  kern = functools.partial(_kernel, steps=r // config.rows, rows=config.rows, bits=config.bits,
                           full_bits=config.full_bits, cand_bits=config.cand_bits,
                           prefetch=config.prefetch)
  out, _ = pl.pallas_call(
      kern, grid=(e,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)),
                pl.BlockSpec((None, r, c), lambda i: (i, 0, 0))],
      out_specs=[pl.BlockSpec((1,), lambda i: (i,)),
                 pl.BlockSpec((None, r, c), lambda i: (i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((e,), jnp.uint32),
                 jax.ShapeDtypeStruct(keys.shape, jnp.uint32)],
      interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=config.warps, num_stages=config.stages),
      name="kth_smallest")(k, keys)
  return out


def kth_smallest(x: jax.Array, k, config: Config = Config()) -> jax.Array:
  """See :func:`pallas_kernels.select.kth_smallest` (checked there). x: ``[N, E]`` float32,
  ``0 <= k < N``. Returns ``[E]`` float32."""
  n, e = x.shape
  cols = min(128 * config.warps, pl.next_power_of_2(n))
  rows = min(config.rows, pl.next_power_of_2(-(-n // cols)))
  r = -(-n // (rows * cols)) * rows
  keys = jnp.pad(reference.to_keys(x).T, ((0, 0), (0, r * cols - n)),
                 constant_values=jnp.uint32(_PAD)).reshape(e, r, cols)
  k = jnp.reshape(jnp.asarray(k, jnp.int32), (1,))
  return reference.from_keys(kth_keys(keys, k, dataclasses.replace(config, rows=rows)))
