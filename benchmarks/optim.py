"""The optimizer update of a config's parameter tree on one device: ``tx.update`` and
``optax.apply_updates`` (what the train step runs after the gradient) on random float32 parameters
and gradients, jitted with the parameters and optimizer state donated as in the train step.
Prints ms per update, the bytes XLA's cost model says the compiled update accesses, and the
floor: one read of parameters, gradients and optimizer state and one write of parameters and
state.

  python3 benchmarks/optim.py configs/k3_1b.yaml                  # the config's optimizer
  python3 benchmarks/optim.py configs/k3_tiny.yaml optimizer.name=adamw --hlo /tmp/opt.hlo
  python3 benchmarks/optim.py configs/k3_1b.yaml optimizer.ns_form=sums --tag sums

Rows go to ``$OUT/optim_bench.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import config as config_lib, optim  # noqa: E402
from k3jax.train_state import abstract_model  # noqa: E402
from timing import Rows, median_ms  # noqa: E402

ROWS = Rows("optim_bench.json")


def param_shapes(cfg):
  """The model's trainable parameters as a pure dict of ShapeDtypeStructs (nothing allocated)."""
  return nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))


def random_tree(shapes, seed, scale):
  """Normal random arrays shaped like ``shapes`` (one jitted call for the whole tree)."""
  leaves, treedef = jax.tree.flatten(shapes)

  @jax.jit
  def make(key):
    keys = jax.random.split(key, len(leaves))
    return [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]

  return jax.tree.unflatten(treedef, make(jax.random.key(seed)))


def tree_bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("config")
  p.add_argument("overrides", nargs="*")
  p.add_argument("--hlo", help="write the compiled update's HLO text here")
  p.add_argument("--tag", default="", help="a name for this code in the row")
  a = p.parse_args()
  cfg = config_lib.load(a.config, a.overrides)
  # The random tree's draws through the CUDA threefry kernel: XLA's expansion of every draw into
  # a fusion of its own compiles for minutes.
  jax.config.update("jax_threefry_gpu_kernel_lowering", True)
  shapes = param_shapes(cfg)
  tx, _ = optim.make_optimizer(cfg, shapes)
  params, grads = random_tree(shapes, 0, 0.02), random_tree(shapes, 1, 1e-3)
  state = jax.jit(tx.init)(params)

  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(update, donate_argnums=(0, 1))
  t0 = time.perf_counter()
  compiled = step.lower(params, state, grads).compile()
  print(f"update compiled in {time.perf_counter() - t0:.1f} s", flush=True)
  if a.hlo:
    with open(a.hlo, "w") as fh:
      fh.write(compiled.as_text())
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  floor = 2 * (tree_bytes(params) + tree_bytes(state)) + tree_bytes(grads)
  carry = {"params": params, "state": state}

  def run():
    carry["params"], carry["state"] = step(carry["params"], carry["state"], grads)
    return carry["state"]

  ms = median_ms(run, reps=9, inner=5)
  ROWS.emit({"name": f"optimizer update {cfg.model.name} {cfg.optimizer.name} {a.tag}".strip(),
             "ns_form": cfg.optimizer.ns_form, "ms": round(ms, 3), "params": sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)),
             "bytes_accessed_GB": round(cost.get("bytes accessed", float("nan")) / 1e9, 2),
             "floor_GB": round(floor / 1e9, 2), "floor_GBps": round(floor / ms / 1e6, 1),
             "device": jax.devices()[0].device_kind})


if __name__ == "__main__":
  main()
