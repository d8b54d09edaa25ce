"""Shared by the benchmark scripts: median wall-clock timing and result rows saved as they come."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp


def kernel_bench_args(p: argparse.ArgumentParser, budget: float):
  """Parses ``p`` with the options the kernel benchmarks share: ``--dtype``, ``--budget`` (seconds
  after which optional steps are skipped), ``--no-sweep`` and ``--interpret`` (a CPU run of the
  check path, kernels interpreted); without a GPU and ``--interpret`` it exits. Returns (args,
  ``elapsed()`` seconds since parsing, ``left()`` seconds of the budget, :func:`median_ms`
  keywords: one sample when interpreted)."""
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--budget", type=float, default=budget)
  p.add_argument("--no-sweep", action="store_true")
  p.add_argument("--interpret", action="store_true", help="allow a CPU run (kernels interpreted)")
  a = p.parse_args()
  t0 = time.perf_counter()
  if jax.default_backend() != "gpu" and not a.interpret:
    sys.exit(f"{p.prog}: no GPU (pass --interpret to run the check path on CPU)")
  elapsed = lambda: time.perf_counter() - t0
  reps = dict(reps=1, inner=1) if a.interpret else dict(reps=9, inner=20)
  return a, elapsed, lambda: a.budget - elapsed(), reps


def replace_options(config, specs):
  """``config`` (a frozen dataclass of kernel options) with each ``NAME=VALUE`` of ``specs``
  replaced, VALUE a Python literal (``warps={'kda_chunk_a': 4}``, ``recurrence='triton'``);
  ValueError naming an option ``config`` does not have."""
  import ast
  fields = {f.name for f in dataclasses.fields(config)}
  changes = {}
  for spec in specs:
    name, sep, value = spec.partition("=")
    if not sep or name not in fields:
      raise ValueError(f"--set {spec!r}: {type(config).__name__} has no option {name!r}; "
                       f"expected one of {sorted(fields)}")
    changes[name] = ast.literal_eval(value)
  return dataclasses.replace(config, **changes)


def median_ms(fn, *args, reps: int = 15, inner: int = 5,
              max_sample_s: float | None = None) -> float:
  """Median milliseconds per call of ``fn(*args)``: ``reps`` samples of ``inner`` back-to-back
  calls (launch overhead hidden), after one warm-up call, each sample synchronised. With
  ``max_sample_s``, ``inner`` shrinks (to 1 at least) so that one sample takes about that long at
  the warm-up's speed: long calls are not repeated hundreds of times."""
  jax.block_until_ready(fn(*args))
  if max_sample_s is not None:
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    inner = max(1, min(inner, int(max_sample_s / max(time.perf_counter() - t, 1e-9))))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / inner)
  return statistics.median(ts) * 1e3


@jax.jit
def _rel_err(a, b):
  a, b = a.astype(jnp.float32).reshape(-1), b.astype(jnp.float32).reshape(-1)
  return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def rel_err(a, b) -> float:
  """Relative Frobenius error ``||a - b|| / ||b||`` in float32, computed on the device."""
  return float(_rel_err(jnp.asarray(a), jnp.asarray(b)))


class Rows:
  """Collects result rows, prints each as JSON and rewrites ``$OUT/<filename>`` after every row,
  so a run cut short keeps what it measured."""

  def __init__(self, filename: str):
    self.filename = filename
    self.rows: list[dict] = []
    self.failed: list[str] = []  # the checks that failed so far in this run

  def fail(self, name: str, bad: dict) -> None:
    """Records a failed check: prints CHECK FAILED, and every later row carries
    ``check_failed`` (the times of a kernel that computes the wrong thing are not results)."""
    print("CHECK FAILED", name, bad, flush=True)
    self.failed.append(name)

  def emit(self, row: dict) -> None:
    if self.failed and not row["name"].startswith("check"):
      row = {**row, "check_failed": list(self.failed)}
    self.rows.append(row)
    print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
      with open(os.path.join(out, self.filename), "w") as fh:
        json.dump(self.rows, fh, indent=1)

  def check(self, name: str, names, got, want, tol: float) -> dict:
    """Relative errors of the arrays ``got`` against ``want`` (named ``names``) as one row;
    prints CHECK FAILED for any not below ``tol``."""
    errs = {n: round(rel_err(a, b), 8) for n, a, b in zip(names, got, want)}
    self.emit({"name": name, **errs})
    bad = {k: v for k, v in errs.items() if not v < tol}
    if bad:
      self.fail(name, bad)
    return errs

  def times(self, name: str, fns: dict, traffic: dict, reps: dict, **extra) -> dict:
    """:func:`median_ms` of each ``fns[part] = (fn, args)`` and its GB/s for ``traffic[part]``
    bytes, as one row (with ``extra``). Returns ``{part: ms}``."""
    res = {part: median_ms(fn, *args, **reps) for part, (fn, args) in fns.items()}
    row = {"name": name, **extra}
    for part, ms in res.items():
      row[f"{part}_ms"] = round(ms, 4)
      row[f"{part}_GBps"] = round(traffic[part] / ms / 1e6, 1)
    self.emit(row)
    return res


def config_diff(config, default) -> dict:
  """The fields of the dataclass ``config`` that differ from ``default`` (a sweep row's name)."""
  return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
          if getattr(config, f.name) != getattr(default, f.name)}


def print_ratios(lines) -> None:
  """A table of ``(label, XLA ms, kernel ms, minimal bytes)`` lines: times, GB/s, XLA / kernel."""
  print(f"{'':14s}{'xla ms':>10s}{'pallas ms':>11s}{'xla GB/s':>10s}{'pallas GB/s':>12s}"
        f"{'xla/pallas':>11s}", flush=True)
  for label, x_ms, p_ms, nbytes in lines:
    print(f"{label:14s}{x_ms:10.3f}{p_ms:11.3f}{nbytes / x_ms / 1e6:10.0f}"
          f"{nbytes / p_ms / 1e6:12.0f}{x_ms / p_ms:11.2f}", flush=True)


def xla_against_pallas(timed, traffic: dict, parts) -> dict:
  """``timed(impl)`` (a dict of ms by part) for "xla" then "pallas_gpu", a failure printed and
  skipped, and the ratio table of ``parts`` when both ran: {impl: times}."""
  res = {}
  for impl in ("xla", "pallas_gpu"):
    try:
      res[impl] = timed(impl)
    except Exception as e:  # noqa: BLE001 - the other implementation is still worth timing
      print(impl, "FAILED", repr(e)[:1500], flush=True)
  if len(res) == 2:
    print_ratios([(p, res["xla"][p], res["pallas_gpu"][p], traffic[p]) for p in parts])
  return res


COLLECTIVES = "collectives (NCCL)"
KINDS = (  # (kind, substrings of a kernel name), first match wins
    (COLLECTIVES, ("nccl", "all-gather", "all_gather", "all-to-all", "all_to_all",
                            "reduce-scatter", "reduce_scatter", "all-reduce", "all_reduce",
                            "collective-permute", "sendrecv")),
    ("kda", ("kda", "delta", "chunk_")),
    ("attention (MLA)", ("mla", "flash", "attention", "fmha", "cudnn", "sdpa")),
    ("expert grouped matmul", ("gmm", "ragged", "grouped", "moe", "mosaic_gpu")),
    ("dense matmul", ("gemm", "nvjet", "xmma", "cublas", "cutlass", "matmul", "dot")),
    ("sort/gather/scatter", ("sort", "scatter", "gather", "radix", "topk", "top_k")),
)


def kind_of(name: str) -> str:
  low = name.lower()
  for kind, keys in KINDS:
    if any(k in low for k in keys):
      return kind
  return "other fusions (elementwise, norms, optimizer, reductions)"


def _gpu_events(trace_dir: str) -> tuple[list, dict]:
  """The events of the Perfetto trace under ``trace_dir`` and its GPU processes {pid: name}."""
  files = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True) or \
      glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
  if not files:
    return [], {}
  with gzip.open(files[0]) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return events, {pid: n for pid, n in names.items()
                  if "gpu" in n.lower() or "/device:" in n.lower()}


def gpu_span(trace_dir: str) -> tuple[float, float]:
  """(busy, span) in microseconds of the trace's GPU kernels: their summed durations and the time
  from the first one's start to the last one's end. span - busy is the GPU's idle time between
  kernels (launch gaps, host waits)."""
  events, gpu = _gpu_events(trace_dir)
  ks = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
  if not ks:
    return 0.0, 0.0
  return (sum(e["dur"] for e in ks),
          max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks))


def kernel_times(trace_dir: str) -> tuple[dict, dict, dict, dict]:
  """GPU kernel time in microseconds from the Perfetto trace under ``trace_dir``: ({kind: total},
  {kernel name: total}, {device: {kind: total}}, {HLO op name: total}), totals over all devices.
  Kernels inside a CUDA graph (``hlo_op`` a ``command_buffer``) count under their kernel name,
  which for XLA's own fusions is the HLO name with underscores."""
  events, gpu = _gpu_events(trace_dir)
  if not events:
    return {}, {}, {}, {}
  by_kind, by_name, by_op = collections.Counter(), collections.Counter(), collections.Counter()
  by_device: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
      kind = kind_of(e["name"])
      by_name[e["name"]] += e["dur"]
      op = e.get("args", {}).get("hlo_op") or ""
      by_op[e["name"] if not op or op.startswith("command_buffer") else op] += e["dur"]
      by_kind[kind] += e["dur"]
      by_device[gpu[e["pid"]]][kind] += e["dur"]
  return (dict(by_kind), dict(by_name), {d: dict(c) for d, c in sorted(by_device.items())},
          dict(by_op))


def report_kernels(by_kind: dict, by_name: dict, by_device: dict, steps: int) -> None:
  """Prints GPU kernel time per step by kind (all devices, then each device) and the top kernels."""
  total = sum(by_kind.values())
  if not total:
    print("no GPU events found in the trace")
    return
  n_dev = max(len(by_device), 1)
  print(f"GPU kernel time over {steps} steps: {total / steps / 1e3 / n_dev:.1f} ms per step per "
        f"device ({n_dev} devices)")
  for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
    print(f"  {k:58s} {v / steps / 1e3 / n_dev:8.1f} ms  {v / total:6.1%}")
  if n_dev > 1:
    for d, kinds in by_device.items():
      print(f"  {d}: " + ", ".join(f"{k.split(' ')[0]} {v / steps / 1e3:.1f}"
                                   for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])) + " ms")
  print("top kernels:")
  for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]:
    print(f"  {v / steps / 1e3 / n_dev:8.2f} ms  {k[:110]}")
