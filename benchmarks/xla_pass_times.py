"""Where an XLA GPU compile spends its time, read from the compile's own log: the HLO passes (by
pass and by pipeline), the backend (LLVM to PTX and ptxas, per kernel) and the slow-operation
alarms. Any program that compiles for a GPU (the card or compile-only devices) logs them when
run with

  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1,gpu_compiler=1,nvptx_compiler=1 \\
    python -m k3jax.plan configs/k3_1b.yaml --mesh data=1 --compile h200 2> compile.log
  python benchmarks/xla_pass_times.py compile.log

Times are XLA's wall-clock timers. A pass that compiles other modules (``config-assigner``, the
autotuner: every distinct fusion and GEMM compiled on its own) includes their passes, which are
counted under their own names too, so the per-pass figures overlap; the per-module totals
(``GpuCompiler::RunHloPasses``, ``RunBackend``) do not. The backend's per-kernel timers are summed
over its compile threads.
"""

from __future__ import annotations

import argparse
import collections
import re

_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_TIME = r"time: ([\d.]+) (ns|us|ms|s|min|h) "
_PASS = re.compile(r"HLO pass: (\S+) " + _TIME)
_START = re.compile(r"\]   HLO pass (\S+)$")
_PIPELINE = re.compile(r"Running HLO pass pipeline on module (\S+): (.*)$")
_TIMER = re.compile(r"\] (\S+(?: - \w+)?) for (\S+) " + _TIME)
_ALARM = re.compile(r"The operation took (\S+)")


def summarize(lines) -> dict:
  """{"passes": {name: (seconds, calls)}, "pipelines": {name: seconds}, "timers": {name:
  (seconds, calls)}, "alarms": [durations as XLA printed them]} of a compile log's lines.
  Pipelines are the first module's (the program's): a pass that compiles other modules counts
  in its own pipeline, the passes of those modules in none."""
  passes: dict = collections.defaultdict(lambda: [0.0, 0])
  pipelines: dict = collections.defaultdict(float)
  timers: dict = collections.defaultdict(lambda: [0.0, 0])
  alarms, main, pipeline, outer, nested = [], None, None, None, False
  for line in lines:
    if m := _PIPELINE.search(line):
      main = main or m.group(1)
      nested = m.group(1) != main
      if not nested:
        pipeline = m.group(2).strip()
    elif m := _START.search(line):
      if not nested:
        outer = m.group(1)
    elif m := _PASS.search(line):
      t = float(m.group(2)) * _UNIT[m.group(3)]
      passes[m.group(1)][0] += t
      passes[m.group(1)][1] += 1
      if not nested or m.group(1) == outer:
        pipelines[pipeline] += t
        nested = False
    elif m := _TIMER.search(line):
      timers[m.group(1)][0] += float(m.group(3)) * _UNIT[m.group(4)]
      timers[m.group(1)][1] += 1
    elif m := _ALARM.search(line):
      alarms.append(m.group(1))
  return {"passes": {k: tuple(v) for k, v in passes.items()}, "pipelines": dict(pipelines),
          "timers": {k: tuple(v) for k, v in timers.items()}, "alarms": alarms}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("log", help="stderr of the compile, logged as the module docstring says")
  p.add_argument("--top", type=int, default=15, help="passes and pipelines to list")
  args = p.parse_args(argv)
  with open(args.log, errors="replace") as f:
    s = summarize(f)
  print("module timers (s, calls):")
  for name, (t, n) in sorted(s["timers"].items(), key=lambda kv: -kv[1][0]):
    print(f"  {t:8.1f}  x{n:<6} {name}")
  print("slowest HLO passes (s, calls; nested ones overlap their parent):")
  for name, (t, n) in sorted(s["passes"].items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"  {t:8.1f}  x{n:<6} {name}")
  print("slowest pipelines (s):")
  for name, t in sorted(s["pipelines"].items(), key=lambda kv: -kv[1])[:args.top]:
    print(f"  {t:8.1f}  {name}")
  if s["alarms"]:
    print("slow-operation alarms:", ", ".join(s["alarms"]))


if __name__ == "__main__":
  main()
