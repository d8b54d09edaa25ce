"""Where a TPU compile's backend spends its time, read from libtpu's own log: each HLO
instruction the backend lowers to LLO (a fusion, a collective, a Mosaic kernel's custom call)
is one work unit, started and finished on one of libtpu's compile threads; this sums their wall
times by instruction and by kind, beside libtpu's stage durations (HLO passes, backend, code
generation). Any TPU compile logs them when run with

  LIBTPU_INIT_ARGS=--vmodule=lowering_emitter=1 python -m k3jax.plan configs/k3.yaml ... \\
    --compile v5p:8x16x16 --compile-layers 5
  python benchmarks/tpu_lowering_times.py /tmp/tpu_logs/tpu_driver.*.INFO.<time>.<pid>

(libtpu writes its log under /tmp/tpu_logs, one file per process.) Times are wall clock on the
thread that lowered the instruction: with N compile threads the backend's stage is about their
sum over N. An instruction lowered again after a failed first try ("retry compilation") counts
both tries. ``--hlo`` (the compiled HLO text, ``plan --hlo``) names each instruction's
computation and, for fusions, the ops inside.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import re

_LINE = re.compile(r"^[IWEF](\d{4} \d\d:\d\d:\d\d\.\d+)\s+(\d+) \S+\] (.*)$")
_STAGE = re.compile(r"^(\w+) stage duration: (.+)$")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


def _stamp(text: str) -> float:
  t = datetime.datetime.strptime(text, "%m%d %H:%M:%S.%f")
  return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond * 1e-6 + t.day * 86400


def _duration(text: str) -> float:
  """Seconds of a libtpu duration such as ``5m20.808s`` or ``16.4s`` or ``436.3ms``."""
  return sum(float(v) * _UNIT[u] for v, u in re.findall(r"([\d.]+)(h|ms|us|m|s)", text))


def kind(name: str) -> str:
  """An instruction's kind from its name: ``fusion.4354`` -> ``fusion``, ``all-gather.386`` ->
  ``all-gather``."""
  return re.sub(r"\.\d+$", "", name)


def summarize(lines) -> dict:
  """{"units": {instruction: [seconds, tries]}, "stages": {stage: seconds}, "threads": n} of a
  libtpu log's lines."""
  started: dict = {}
  units: dict = collections.defaultdict(lambda: [0.0, 0])
  stages: dict = {}
  threads = set()
  for line in lines:
    m = _LINE.match(line)
    if not m:
      continue
    stamp, tid, msg = m.groups()
    if msg.startswith("Started lowering "):
      started[tid] = (msg.split()[2], _stamp(stamp))
      threads.add(tid)
    elif msg.startswith("Finished lowering ") and tid in started:
      name, t0 = started.pop(tid)
      units[name][0] += _stamp(stamp) - t0
      units[name][1] += 1
    elif s := _STAGE.match(msg):
      stages[s.group(1)] = stages.get(s.group(1), 0.0) + _duration(s.group(2))
  return {"units": dict(units), "stages": stages, "threads": len(threads)}


def fusion_ops(hlo_text: str) -> dict[str, str]:
  """{instruction: a short description} from compiled HLO text: the computation that holds it
  (``ENTRY``, a while body, a conditional branch), then a fusion's kind and the ops of its fused
  computation, a custom call's target, any other op's name and result shapes."""
  comps: dict[str, list[str]] = {}
  cur = None
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      comps[cur] = []
    elif cur is not None and line.startswith("  "):
      comps[cur].append(line)
  out = {}
  for comp, body in comps.items():
    for line in body:
      m = re.match(r"\s+(?:ROOT )?%?([\w.-]+) = (.+?) ([\w-]+)\(", line)
      if not m:
        continue
      name, result, op = m.groups()
      if op == "fusion":
        called = re.search(r"calls=%?([\w.-]+)", line)
        k = re.search(r"kind=(\w+)", line)
        ops = collections.Counter(
          o for l in comps.get(called.group(1) if called else "", ())
          for o in re.findall(r"= \S+ ([\w-]+)\(", l) if o not in ("parameter", "constant"))
        out[name] = f"{comp}: " + (k.group(1) if k else "") + " " + ",".join(
          f"{o}x{n}" if n > 1 else o for o, n in ops.most_common(6))
      elif op == "custom-call":
        t = re.search(r'custom_call_target="([^"]+)"', line)
        out[name] = f"{comp}: " + (t.group(1) if t else "custom-call")
      else:
        out[name] = f"{comp}: {op} " + re.sub(r"\{[^}]*\}", "", result)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("log", help="libtpu's INFO log of one compile")
  ap.add_argument("--hlo", default=None, help="the compiled HLO text (plan --hlo)")
  ap.add_argument("--top", type=int, default=25)
  args = ap.parse_args()
  with open(args.log, errors="replace") as f:
    s = summarize(f)
  units = s["units"]
  total = sum(t for t, _ in units.values())
  print(f"stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in s["stages"].items()))
  print(f"{len(units)} instructions lowered on {s['threads']} threads: {total:.1f} thread-s, "
        f"{sum(n for _, n in units.values()) - len(units)} retries")
  by_kind: dict = collections.defaultdict(lambda: [0.0, 0])
  for name, (t, _) in units.items():
    by_kind[kind(name)][0] += t
    by_kind[kind(name)][1] += 1
  print("\nby kind: thread-s, count, share")
  for k, (t, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"  {k:40s} {t:8.1f} {n:6d} {t / max(total, 1e-9):6.1%}")
  desc = {}
  if args.hlo:
    with open(args.hlo) as f:
      desc = fusion_ops(f.read())
  if desc:
    by_comp: dict = collections.defaultdict(lambda: [0.0, 0])
    for name, (t, _) in units.items():
      c = desc.get(name, "?:").split(":")[0]
      by_comp[c][0] += t
      by_comp[c][1] += 1
    print("\nby computation: thread-s, instructions")
    for c, (t, n) in sorted(by_comp.items(), key=lambda kv: -kv[1][0])[:args.top]:
      print(f"  {c:48s} {t:8.1f} {n:6d}")
  print(f"\nlargest {args.top} instructions: thread-s, tries")
  for name, (t, n) in sorted(units.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"  {name:32s} {t:7.1f} {n:2d}  {desc.get(name, '')[:110]}")


if __name__ == "__main__":
  main()
