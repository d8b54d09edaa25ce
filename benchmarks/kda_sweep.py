"""Tuning sweeps of the KDA chunk kernels (``benchmarks/kda.py --sweep``): warps per kernel,
chunk_dqkg's K slices, gate-gradient dot algorithms, bf16 stores and chunk loops, each variant
timed beside the default and checked where it changes numerics. Every function takes ``k``, the
``benchmarks/kda.py`` module (its ``check`` and ``emit``), and a ``Parts`` of the shape."""

from __future__ import annotations

import jax

from timing import median_ms as jtime

WARP_SWEEP = {"chunk_dqkg": (4, 16), "chunk_a": (4, 16), "chunk_dwy": (4, 16)}
DQKG_SLICES = {16: (4,), 64: (4, 8)}  # K slice widths of chunk_dqkg other than the default: warps
_P = jax.lax.DotAlgorithmPreset
GATE_DOTS = {"all_x3": ((_P.BF16_BF16_F32_X3,) * 2,) * 2,  # gate-gradient variants
             "all_bf16": ((_P.BF16_BF16_F32,) * 2,) * 2}
STORES = {"f32": (), "+dg": ("h", "dh", "dvn", "dy", "dqk", "dg")}  # bf16_stores variants
_STORE_USERS = ("chunk_dwy", "chunk_dqkg", "prep_vjp")


def sweep_stores(k, parts, tag, left):
  """The backward residuals stored in bf16 (``KdaGpuConfig.bf16_stores``) at each variant of
  ``STORES`` and the default: the check's gradient errors and the kernels that write or read
  them, each alone (the intermediates converted to the variant's dtypes)."""
  for name, stores in list(STORES.items()) + [("default", parts.cfg.tuning.bf16_stores)]:
    if left() < 40:
      return
    changes = {"bf16_stores": frozenset(stores)}
    try:
      errs = k.check(decode=False, tag=f"bf16 stores {name}", changes=changes)
      k.emit(name=f"sweep bf16 stores={name} {tag}",
           **{n: round(_time(k, parts, n, changes), 4) for n in _STORE_USERS},
           **{k: round(errs[k], 5) for k in ("df", "dA_log", "ddt_bias", "dq", "dk", "dv",
                                             "dbeta")})
    except Exception as e:  # noqa: BLE001
      print(f"sweep bf16 stores={name} FAILED", repr(e)[:800], flush=True)


def sweep_option(k, parts, tag, left, field, values, names):
  """The kernels ``names`` alone with the tuning's ``field`` at each of ``values``, and at its
  default."""
  default, row = getattr(parts.cfg.tuning, field), {}
  for val in list(values) + [default]:
    if left() < 15:
      break
    try:
      for n in names:
        row[f"{n} {val}{' (default)' if val == default else ''}"] = round(
            _time(k, parts, n, {field: val}), 4)
    except Exception as e:  # noqa: BLE001
      print(f"sweep {field}={val} FAILED", repr(e)[:800], flush=True)
  if row:
    k.emit(name=f"sweep {field} {tag}", **row)


LOOPS = ((1, 1), (4, 3), (16, 3), (32, 3), (16, 2))  # chunk_loop's (chunks per program, stages)


def sweep_loops(k, parts, tag, left, names):
  """Each dense chunk kernel of ``names`` alone with its programs walking several chunks
  (``LOOPS``), and at its default."""
  for name in names:
    row = {}
    for per, stages in LOOPS:
      if left() < 15:
        return
      try:
        row[f"{per}x{stages}"] = round(
            _time(k, parts, name, {"chunk_loop": {"kda_" + name: (per, stages)}}), 4)
      except Exception as e:  # noqa: BLE001
        print(f"sweep loop {name} {per}x{stages} FAILED", repr(e)[:800], flush=True)
    per, stages = parts.cfg.tuning.chunk_loop_of("kda_" + name)
    row[f"{per}x{stages} (default)"] = round(_time(k, parts, name), 4)
    k.emit(name=f"sweep chunks x stages {name} {tag}", **row)


def sweep(k, parts, shape, tag, left):
  """The variants of the kernels, most promising first: chunk_a's programs walking more chunks
  (``chunk_loop``), chunk_dqkg's cumulative sum of the gate as a scan and the Mosaic passes'
  128-wide V tile (single-buffered: one CTA per (batch, head)), each with the check's errors and
  the kernels' times (the default's are the parts' row), the sequential passes (Triton or Mosaic
  GPU, the latter's V tile and ring slots), the WY factors (Triton or Mosaic GPU, the latter's
  inverse in float16 or split bf16 products), the bf16 backward intermediates, chunk_dwy's and
  chunk_dqkg's programs walking several chunks, the dense path's reference blocks of 16 rows
  instead of the default (chunk_a, chunk_dqkg), chunk_dqkg at other warp counts and K slice
  widths, the gate gradient's matrix-unit algorithm (its check errors and the chunk_dqkg time),
  then the other kernels at other warp counts. Each kernel is timed alone; stops when
  ``left()`` is too small for the next step."""
  recur = ("recur_fwd", "recur_fwd_store", "recur_bwd")
  sweep_loops(k, parts, tag, left, ("chunk_a",))
  flipped = not parts.cfg.tuning.dqkg_dot_cumsum  # the gate's cumulative sum the other way
  sweep_checked(k, parts, tag, left, {"dqkg_dot_cumsum": flipped}, f"dqkg_dot_cumsum={flipped}")
  sweep_checked(k, parts, tag, left, {"mgpu_v_tile": 128}, "mgpu_v_tile=128", recur)
  sweep_option(k, parts, tag, left, "recurrence", ("triton", "mosaic"), recur)
  sweep_option(k, parts, tag, left, "mgpu_v_tile", (32, 64), recur)
  sweep_option(k, parts, tag, left, "mgpu_stages", (2,), recur)
  sweep_option(k, parts, tag, left, "chunk_wu", ("triton",), ("chunk_wu", "chunk_wu_keep"))
  sweep_option(k, parts, tag, left, "wu_split", (True,), ("chunk_wu", "chunk_wu_keep"))
  sweep_stores(k, parts, tag, left)
  sweep_loops(k, parts, tag, left, ("chunk_dwy", "chunk_dqkg"))
  k.emit(name=f"sweep diag_rows=16 (default {parts.cfg.diag_rows}) {tag}",
       **{n: round(_time(k, parts, n, diag_rows=16), 4) for n in ("chunk_a", "chunk_dqkg")})
  sweep_warps(k, parts, "chunk_dqkg", tag, left, (8,))
  for bk, warps in DQKG_SLICES.items():
    sweep_warps(k, parts, "chunk_dqkg", f"slice {bk} {tag}", left, warps, with_default=False,
                changes={"dqkg_slice_k": bk})
  for name, dot in GATE_DOTS.items():
    sweep_checked(k, parts, tag, left, {"gate_dot": dot}, f"gate_dot={name}")
  for name in ("chunk_a", "chunk_dwy"):
    sweep_warps(k, parts, name, tag, left)


def sweep_checked(k, parts, tag, left, changes, label, names=("chunk_dqkg",)):
  """The tuning with ``changes`` for a change the card must check: the check's errors (outputs
  and gradients against the float32 recurrence) and the kernels ``names`` timed alone."""
  if left() < 25:
    return
  try:
    errs = k.check(decode=False, tag=label, changes=changes)
    k.emit(name=f"sweep {label} {tag}", **{n: round(_time(k, parts, n, changes), 4) for n in names},
         **{k: round(v, 5) for k, v in errs.items()})
  except Exception as e:  # noqa: BLE001
    print(f"sweep {label} FAILED", repr(e)[:800], flush=True)


def sweep_warps(k, parts, name, tag, left, warps=None, with_default=True, changes=None):
  """One kernel alone (its tuning with ``changes``) at other warp counts (``WARP_SWEEP``), and
  at its default."""
  key, changes = "kda_" + name, changes or {}
  default = parts.cfg.tuning.warps_of(key)
  row = {}
  for w in warps or WARP_SWEEP[name]:
    if left() < 12:
      break
    try:
      row[f"w{w}"] = round(_time(k, parts, name, {**changes, "warps": {key: w}}), 4)
    except Exception as e:  # noqa: BLE001
      print(f"sweep {name} w{w} {tag} FAILED", repr(e)[:800], flush=True)
  if with_default and row:
    row[f"w{default} (default)"] = round(_time(k, parts, name, changes), 4)
  if row:
    k.emit(name=f"sweep warps {name} {tag}", **row)


def _time(k, parts, name, changes=None, diag_rows=None):
  """One kernel alone at the tuning with ``changes`` (and ``diag_rows`` reference blocks)."""
  fn, args = parts.fns(changes, diag_rows)[name]
  return jtime(fn, *args)
