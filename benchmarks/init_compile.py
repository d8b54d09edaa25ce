"""How long the parameter initialisation of a config takes (compile and run), with XLA's threefry
expansion and with the CUDA threefry kernel (``k3jax.train_state.init_train_state(threefry_kernel=...)``), and
whether both give the same parameters.

  python benchmarks/init_compile.py --config configs/k3_1b.yaml
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from k3jax import config as config_lib  # noqa: E402
from k3jax.train_state import init_train_state  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/k3_1b.yaml")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args(argv)
  cfg = config_lib.load(args.config, args.overrides)
  sums = {}
  for kernel in (True, False):
    t0 = time.perf_counter()
    params = init_train_state(cfg, threefry_kernel=kernel).params
    leaves = jax.block_until_ready(jax.tree.leaves(params))
    sums[kernel] = [float(np.asarray(x, np.float64).sum()) for x in leaves]
    print(f"threefry {'CUDA kernel' if kernel else 'XLA expansion'}: {len(leaves)} parameters, "
          f"init (compile + run) {time.perf_counter() - t0:.1f} s", flush=True)
    del params, leaves
  print(f"same parameters both ways: {sums[True] == sums[False]}")


if __name__ == "__main__":
  main()
