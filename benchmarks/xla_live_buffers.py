"""What a compiled XLA program holds at its memory peak, read from the compile's dump: the
temporaries the buffer assignment reserves, and the values live at the peak of XLA's own live
range analysis (``*-live-range.txt``, "Live ranges at N (peak)") with their shape and layout,
live range and the JAX scope that made them, largest first. Dump a compile with

  python -m k3jax.plan ... --compile TARGET --xla-dump DIR
  python benchmarks/xla_live_buffers.py DIR [--top 40] [--by-shape]

(:func:`k3jax.aot.dump_options`; libtpu writes the files before its backend runs, so a TPU
compile can be stopped once they are there; the whole K3 step's dump is about 6 GB, nearly all
``*-buffer-assignment-values.txt``, which this does not read). XLA's peak sums every live
value, the program's arguments and aliases of one buffer included, so it exceeds the live
temporaries; the temporaries' allocation exceeds them by XLA's fragmentation. Two cuts of a
model set side by side (``--by-shape``) show what grows with the layers.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_VALUE = re.compile(r"\s+value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=\d+,offset=\d+\): (\S+)")
_TEMP = re.compile(r"allocation \d+: size (\d+)(?:, page \d+)?, preallocated-temp:")
_PEAK = re.compile(r"  Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"    (\S+): (\d+) bytes")
_RANGE = re.compile(r"    (\S+):(\d+)-(\d+)$")
_OP = re.compile(r'^\s+(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"')


def module_prefix(path: str) -> Path:
  """The dump prefix (``.../module_N.NAME...after_optimizations``) of ``path``: itself, or in a
  dump directory the module with the largest buffer assignment (the program, not JAX's helpers)."""
  p = Path(path)
  if not p.is_dir():
    return p
  files = sorted(p.glob("*after_optimizations-buffer-assignment.txt"),
                 key=lambda f: f.stat().st_size)
  if not files:
    raise SystemExit(f"{path}: no *after_optimizations-buffer-assignment.txt (compiled with "
                     f"--xla-dump?)")
  return Path(str(files[-1])[:-len("-buffer-assignment.txt")])


def buffer_assignment(lines) -> tuple[int, dict[str, str]]:
  """(bytes of the temporaries' allocation: the largest uncoloured preallocated-temp one,
  {value name: shape}) of a ``*-buffer-assignment.txt``."""
  temp, shapes = 0, {}
  for line in lines:
    m = _TEMP.match(line)
    if m:
      temp = max(temp, int(m.group(1)))
    elif m := _VALUE.match(line):
      shapes[m.group(1) + (m.group(2) or "{}")] = m.group(3)
  return temp, shapes


def peak(lines) -> tuple[int, list[tuple[str, int]], dict[str, tuple[int, int]]]:
  """(position of the peak, [(value, bytes)] live there, {value: (first, last position)}) of a
  ``*-live-range.txt``."""
  at, live, ranges, part = -1, [], {}, None
  for line in lines:
    if line.startswith("  BufferLiveRange"):
      part = "ranges"
    elif m := _PEAK.match(line):
      at, part = int(m.group(1)), "peak"
    elif not line.startswith("    "):
      part = None
    elif part == "ranges" and (m := _RANGE.match(line)):
      ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    elif part == "peak" and (m := _LIVE.match(line)):
      live.append((m.group(1), int(m.group(2))))
  return at, live, ranges


def op_names(hlo_lines) -> dict[str, str]:
  """{instruction: its op_name metadata (the JAX scope that made it)} of an HLO text dump."""
  return {m.group(1): m.group(2) for line in hlo_lines if (m := _OP.match(line))}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("dump", help="an --xla-dump directory or a module's dump prefix")
  ap.add_argument("--top", type=int, default=40, help="values to list (largest first)")
  ap.add_argument("--by-shape", action="store_true", help="also the peak's bytes by shape")
  args = ap.parse_args(argv)
  pre = module_prefix(args.dump)
  with open(f"{pre}-buffer-assignment.txt") as f:
    temp, shapes = buffer_assignment(f)
  with open(f"{pre}-live-range.txt") as f:
    at, live, ranges = peak(f)
  hlo = Path(f"{pre}.txt")
  ops = op_names(hlo.open()) if hlo.exists() else {}
  gib = 2 ** 30
  total = sum(b for _, b in live)
  print(f"{pre.name}\ntemporaries {temp / gib:.2f} GiB; XLA's peak {total / gib:.2f} GiB at "
        f"position {at}")
  live.sort(key=lambda v: -v[1])
  for name, size in live[:args.top]:
    shape = shapes.get(name, "?").split("{")[0]
    first, last = ranges.get(name, (-1, -1))
    print(f"{size / gib:8.3f} GiB  {shape:28s} {first:>7}-{last:<7} {name:34s} "
          f"{ops.get(name.split('{')[0], '')[:100]}")
  if args.by_shape:
    by = collections.Counter()
    for name, size in live:
      by[shapes.get(name, "?").split("{")[0]] += size
    print("\nby shape:")
    for shape, size in by.most_common(args.top):
      print(f"{size / gib:8.3f} GiB  {shape}")


if __name__ == "__main__":
  main()
