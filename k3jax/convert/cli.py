"""Checkpoint conversion between released HF safetensors (Kimi Linear, Kimi K3) and Orbax.

    python convert.py hf-to-orbax --src HF_DIR --dst OUT_DIR [--dtype bf16|fp32] [--mesh fsdp=8,expert=4] [model.KEY=VALUE ...]
    python convert.py orbax-to-hf --src OUT_DIR|RUN_DIR --dst HF_DIR [--config CONFIG] [--experts auto|mxfp4|bf16] [model.KEY=VALUE ...]

The architecture comes from config.json (model_type kimi_linear or kimi_k3). ``orbax-to-hf``
takes a converted directory, a ``train.py`` run directory (its newest complete checkpoint) or one
of its ``checkpoints/<step>``; ``--config`` is a path or a packaged config's name. Tensors stream
one at a time (one expert at a time for the routed experts), the output is written to a temporary
directory next to the destination and renamed only when complete. See k3jax/convert/.
"""

from __future__ import annotations

import argparse
import json
import sys

from k3jax import cli, storage
from k3jax.config import ConfigError
from k3jax.convert import ConversionError, hf_to_orbax, orbax_to_hf
from k3jax.run_dir import RunDirError


def _mesh(text: str | None) -> dict[str, int] | None:
  if not text:
    return None
  out = {}
  for item in text.split(","):
    axis, _, size = item.partition("=")
    if axis not in ("data", "fsdp", "expert", "context", "tensor") or not size.isdigit():
      raise ConversionError(
          f"--mesh: expected axis=size pairs over data/fsdp/expert/context/tensor, got {item!r}")
    out[axis] = int(size)
  return out


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
  ap = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  a = sub.add_parser("hf-to-orbax", help="HF safetensors directory -> Orbax directory")
  a.add_argument("--src", required=True)
  a.add_argument("--dst", required=True)
  a.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                 help="storage dtype of every floating tensor (default: keep the source's; "
                      "MXFP4 experts become bf16 exactly)")
  a.add_argument("--mesh", default=None, help="lay arrays out for this mesh, e.g. fsdp=8,expert=4")
  b = sub.add_parser("orbax-to-hf", help="Orbax directory or training run -> HF safetensors directory")
  b.add_argument("--src", required=True, help="a converted Orbax directory, a train.py run "
                 "directory or one of its checkpoints/<step>")
  b.add_argument("--dst", required=True)
  b.add_argument("--config", default=None, help="k3jax config (path or packaged name) when SRC "
                 "has none of its own")
  b.add_argument("--experts", choices=("auto", "mxfp4", "bf16"), default="auto",
                 help="routed expert storage (auto: as in the source checkpoint)")
  for p in (a, b):
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="model.KEY=VALUE",
                   help="config overrides (model.* only), before or after the options")
  return ap, {"hf-to-orbax": a, "orbax-to-hf": b}


def main(argv: list[str] | None = None) -> int:
  """The ``convert.py`` / ``k3jax-convert`` command line; returns the exit status (2: an error)."""
  argv = sys.argv[1:] if argv is None else list(argv)
  ap, subs = _parser()
  if argv and argv[0] in subs:  # options in any order within the subcommand
    args = subs[argv[0]].parse_intermixed_args(argv[1:])
    args.cmd = argv[0]
  else:
    args = ap.parse_args(argv)
  try:
    src, dst = storage.path(args.src), storage.path(args.dst)  # absolute: as Orbax needs
    if args.cmd == "hf-to-orbax":
      stats = hf_to_orbax(src, dst, dtype=args.dtype, mesh=_mesh(args.mesh),
                          progress=not args.no_progress, overrides=tuple(args.overrides))
    else:
      config = cli.resolve_config(args.config) if args.config else None
      stats = orbax_to_hf(src, dst, config=config, experts=args.experts,
                          progress=not args.no_progress, overrides=tuple(args.overrides))
  except (ConversionError, ConfigError, RunDirError, storage.StorageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps({"command": args.cmd, "src": args.src, "dst": args.dst, **stats}))
  return 0
