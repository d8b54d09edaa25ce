"""The command lines' shared front: every entry point (``train.py``, ``convert.py``,
``python -m k3jax.generate``, ``k3jax.info``, ``k3jax.plan``) takes its config the same way.

- ``--config NAME_OR_PATH`` (``info`` and ``plan`` also take it as their first positional): a
  path to a YAML file, else the name of a packaged config (``k3_tiny`` or ``k3_tiny.yaml``), found
  in the package's ``configs`` directory from any working directory.
- ``key=value`` overrides anywhere on the line, before or after the options.
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
from pathlib import Path

from k3jax import config as config_lib


def config_dirs() -> list[Path]:
  """Where packaged configs live: ``k3jax/configs`` of the package (in a source checkout a
  symlink to the repo's ``configs/``)."""
  d = Path(str(importlib.resources.files("k3jax") / "configs"))
  return [d] if d.is_dir() else []


def resolve_config(name: str | Path) -> Path:
  """The YAML file for ``--config name``: ``name`` (or ``name.yaml``) as a path if it exists,
  else that file in a packaged configs directory (:func:`config_dirs`)."""
  name = str(name)
  candidates = [name] if name.endswith((".yaml", ".yml")) else [name, name + ".yaml"]
  for c in candidates:
    if Path(c).is_file():
      return Path(c)
  if "/" in name:  # a path, not a name
    raise config_lib.ConfigError(f"config file {name!r} does not exist")
  dirs = config_dirs()
  for d in dirs:
    for c in candidates:
      if (d / c).is_file():
        return d / c
  known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
  raise config_lib.ConfigError(f"config {name!r} is neither a file nor a packaged config "
                               f"(packaged: {', '.join(known) or 'none found'})")


def load(name: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> config_lib.Config:
  """:func:`k3jax.config.load` of the config ``name`` resolves to."""
  return config_lib.load(resolve_config(name), overrides)


def use_compile_cache() -> None:
  """JAX's persistent compilation cache in ``$K3JAX_CACHE/jax`` (default ``~/.cache/k3jax/jax``)
  unless one is set already (``JAX_COMPILATION_CACHE_DIR``): a restarted run or server loads its
  compiled steps from disk instead of compiling them again."""
  import jax
  if not jax.config.jax_compilation_cache_dir:
    cache = Path(os.environ.get("K3JAX_CACHE") or Path.home() / ".cache" / "k3jax") / "jax"
    jax.config.update("jax_compilation_cache_dir", str(cache))


def training_xla_flags(flags: str) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) with the training step's XLA default added: XLA's Triton
  GEMM fusions off, unless ``flags`` sets them. They cost k3_1b's step a quarter of its XLA
  compile for the same step time (benchmarks/RESULTS.md, Training run 5: 111 -> 85 s)."""
  if "xla_gpu_enable_triton_gemm" in flags:
    return flags
  return f"{flags} --xla_gpu_enable_triton_gemm=false".strip()


def parser(prog: str, description: str, *, config_default: str | None = None,
           config_positional: bool = False, config_help: str = "") -> argparse.ArgumentParser:
  """An ``ArgumentParser`` with ``--config`` (and, with ``config_positional``, a positional
  form) and ``key=value`` overrides; parse it with :func:`parse`."""
  p = argparse.ArgumentParser(prog=prog, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  help_ = config_help or ("YAML config: a path, or a packaged config's name (k3_tiny, k3_1b, ...)"
                          + (f"; default {config_default}" if config_default else ""))
  p.add_argument("--config", default=None, help=help_)
  if config_positional:
    p.add_argument("config_arg", nargs="?", default=None, metavar="CONFIG", help="as --config")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, anywhere")
  p.set_defaults(_config_default=config_default, _config_positional=config_positional)
  return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
  """Parses ``argv`` with overrides mixed among the options; ``args.config`` is the config given
  (positionally or by ``--config``, else the default) and ``args.overrides`` the ``key=value``
  items. Anything else left over is an error."""
  args = p.parse_intermixed_args(argv)
  rest = list(args.overrides)
  if args._config_positional:  # the one positional that is not key=value, wherever it stands
    if args.config_arg is not None:
      rest.insert(0, args.config_arg)
    names = [r for r in rest if "=" not in r]
    if len(names) + (args.config is not None) > 1:
      p.error(f"more than one config given: {', '.join(names + [args.config] * (args.config is not None))}")
    if names:
      args.config = names[0]
      rest.remove(names[0])
    del args.config_arg
  bad = [r for r in rest if "=" not in r or r.startswith("=")]
  if bad:
    p.error(f"unrecognized arguments: {' '.join(bad)} (overrides are key=value)")
  args.overrides = rest
  if args.config is None:
    args.config = args._config_default
  if args.config is None:
    p.error("a config is required (CONFIG or --config NAME_OR_PATH)")
  del args._config_default, args._config_positional
  return args
