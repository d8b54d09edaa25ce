"""How long the parameter initialisation of a config takes to compile and run, with XLA's
threefry expansion and with the CUDA threefry kernel (``jax_threefry_gpu_kernel_lowering``), and
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
from flax import nnx  # noqa: E402

from k3jax import config as config_lib  # noqa: E402
from k3jax.latent_moe import RouterBias  # noqa: E402
from k3jax.model import K3Model  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/k3_1b.yaml")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args(argv)
  cfg = config_lib.load(args.config, args.overrides)

  def create():
    _, params, _ = nnx.split(K3Model(cfg.model, rngs=nnx.Rngs(cfg.train.seed)), nnx.Param, RouterBias)
    return nnx.to_pure_dict(params)

  sums = {}
  for kernel in (True, False):
    jax.config.update("jax_threefry_gpu_kernel_lowering", kernel)
    t0 = time.perf_counter()
    compiled = jax.jit(create).lower().compile()
    t1 = time.perf_counter()
    params = jax.block_until_ready(compiled())
    t2 = time.perf_counter()
    leaves = jax.tree.leaves(params)
    sums[kernel] = [float(np.asarray(x, np.float64).sum()) for x in leaves]
    print(f"threefry {'CUDA kernel' if kernel else 'XLA expansion'}: {len(leaves)} parameters, "
          f"compile {t1 - t0:.1f} s, run {t2 - t1:.2f} s", flush=True)
    del params
  same = sums[True] == sums[False]
  print(f"same parameters both ways: {same}")


if __name__ == "__main__":
  main()
