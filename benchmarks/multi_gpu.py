"""Training-step layouts on several GPUs against one GPU: losses, step time, MFU, collectives.

  python benchmarks/multi_gpu.py --config configs/k3_tiny.yaml --steps 50 --out DIR [key=value ...]
  python benchmarks/multi_gpu.py --config configs/k3_1b.yaml --layouts one,context,context_experts \\
      --steps 4 train.batch_size=1 train.grad_accum=1 data.seq_len=131072

Each layout is one ``benchmarks/bench_train.py`` process (the step ``train.py`` runs, same init
and data), all started at once so that their compiles overlap; their steps run one layout at a
time (an exclusive lock). ``one`` sees only the first GPU; the others see all of them:

  data             mesh.data=N                     pure data parallelism
  expert           mesh.expert=N                   expert parallelism, MoonEP on
  expert_plain     mesh.expert=N, moonep off       expert parallelism, capacity dispatch
  context          mesh.context=N                  sequence split: KDA state scan, MLA all-gather
  context_experts  mesh.context=N, experts over    the mixed layout: sequence split for attention,
                   the context axis                the same ranks hold the experts (all-to-all)

Every layout is profiled for two more steps (collective time per step and kernel time by model
scope, from the trace).
The table compares each layout's per-step losses with ``one``'s (max absolute difference) and
gives step time, tokens/s, MFU, collective time and peak memory per GPU. A layout that fails (out
of memory, say) is reported with the last lines of its error and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "one": [],
    "data": ["mesh.data=-1"],
    "expert": ["mesh.data=1", "mesh.expert=-1"],
    "expert_plain": ["mesh.data=1", "mesh.expert=-1", "mesh.moonep=false"],
    "context": ["mesh.data=1", "mesh.context=-1"],
    "context_experts": ["mesh.data=1", "mesh.context=-1", "mesh.expert_axes=[expert,context]"],
}


def gpu_count() -> int:
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
  except FileNotFoundError:  # no NVIDIA driver: simulated CPU devices
    return 1
  return len([line for line in out.splitlines() if line.startswith("GPU")]) or 1


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/k3_tiny.yaml")
  p.add_argument("--layouts", default="one,expert,context,context_experts")
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--out", default=os.environ.get("OUT", "runs/multi_gpu"))
  p.add_argument("--tag", default=None, help="file name prefix (default: the config's stem)")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  tag = args.tag or Path(args.config).stem
  n = gpu_count()
  lock = out / ".gpu.lock"  # shared by every run writing to this folder
  procs = {}
  for name in args.layouts.split(","):
    if name not in LAYOUTS:
      p.error(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    if name == "one":  # the first GPU only (or one CPU device where several are simulated)
      env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
      env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                  if "force_host_platform_device_count" not in f)
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_train.py"), "--config", args.config,
           "--steps", str(args.steps), "--json", str(out / f"{tag}_{name}.json"), "--lock", str(lock),
           "--profile", f"/tmp/trace_{tag}_{name}",
           *LAYOUTS[name], *args.overrides]
    log = open(out / f"{tag}_{name}.log", "w")
    procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log)
  results = {}
  for name, (proc, log) in procs.items():
    rc = proc.wait()
    log.close()
    path = out / f"{tag}_{name}.json"
    if rc == 0 and path.exists():
      results[name] = json.loads(path.read_text())
    else:
      tail = (out / f"{tag}_{name}.log").read_text().strip().splitlines()[-6:]
      results[name] = {"error": f"exit {rc}: " + " | ".join(tail)}
  report(results, n, args)
  (out / f"{tag}_summary.json").write_text(json.dumps(results, indent=1))


def report(results: dict, n: int, args) -> None:
  base = results.get("one", {}).get("losses")
  print(f"\n{args.config} {' '.join(args.overrides)}: {args.steps} steps, {n} GPUs")
  print("| layout | GPUs | step ms | tokens/s | MFU | compile s | collectives ms/step/GPU | "
        "peak GiB per GPU | max abs loss diff vs one GPU (at step) | last loss |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, r in results.items():
    if "error" in r:
      print(f"| {name} | | failed: {r['error'][-300:]} | | | | | | | |")
      continue
    diff = "-"
    if base and name != "one":
      d = [abs(a - b) for a, b in zip(r["losses"], base)]
      i = max(range(len(d)), key=d.__getitem__)
      diff = f"{d[i]:.4f} ({i})"
    coll = r.get("collectives_ms_per_step_by_device", [])
    mfu = r.get("mfu")
    print(f"| {name} | {r['devices']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
          f"{'-' if mfu is None else f'{mfu:.1%}'} | {r['compile_s']:.0f} | "
          f"{', '.join(f'{c:.1f}' for c in coll) or '-'} | "
          f"{', '.join(f'{m:.1f}' for m in r.get('peak_gib_per_device', [])) or '-'} | {diff} | "
          f"{r['losses'][-1]:.4f} |")
  for name, r in results.items():
    kinds = r.get("profile_ms_per_step", {})
    if kinds:
      total = sum(kinds.values())
      print(f"{name}: GPU kernel time per step, all GPUs: " + ", ".join(
          f"{k} {v:.1f} ms ({v / total:.0%})" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
  main()
