"""Expert parallelism under a skewed router load: MoonEP on versus plain dispatch.

  python benchmarks/moe_ep.py [--tokens 8192] [--experts 32] [--top-k 8] [--skew 0.75] [--profile DIR]

Runs :func:`sharding.expert_parallel.moe_dispatch` (forward and backward: gradients of the tokens
and both expert weights) over every local device as the ``expert`` axis. Each rank routes
``--tokens`` tokens to ``--top-k`` distinct experts drawn so that the experts of rank 0 get a
share ``--skew`` of all token-expert slots (uniform is ``1 / R``). For each of MoonEP on and off
it checks the result against the single-device :func:`pallas_kernels.moe.expert_mlp`, times the
step, and reads a profile: per device, the GPU time of compute kernels and of collectives. The
imbalance is the slowest rank's compute time over the mean.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.moe as moe_ops  # noqa: E402
import sharding  # noqa: E402
from benchmarks.timing import COLLECTIVES, kernel_times, median_ms, rel_err  # noqa: E402
from k3jax.config import MeshConfig  # noqa: E402
from sharding import expert_parallel  # noqa: E402


def skewed_routing(key, n, e, k, r, skew):
  """expert ids ``[n, k]`` (distinct per token) with a share ``skew`` of slots on rank 0's
  experts (the first ``e / r``), weights ``[n, k]`` summing to 1 per token."""
  er = e // r
  share = np.full((e,), (1 - skew) / (e - er))
  share[:er] = skew / er
  kg, kw = jax.random.split(key)
  gumbel = jax.random.gumbel(kg, (n, e))
  # Top-k of log-share + Gumbel noise samples k experts without replacement in proportion to
  # share; the k-slot share of a heavily favoured group is capped by distinctness (k <= er).
  ids = jax.lax.top_k(jnp.log(jnp.asarray(share, jnp.float32)) + gumbel, k)[1]
  w = jax.nn.softmax(jax.random.normal(kw, (n, k)), axis=-1)
  return ids.astype(jnp.int32), w


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
  p.add_argument("--latent", type=int, default=3584)
  p.add_argument("--width", type=int, default=3072, help="expert intermediate width")
  p.add_argument("--experts", type=int, default=32)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--skew", type=float, default=0.75)
  p.add_argument("--profile", default=None, help="trace directory (default: a temporary one)")
  p.add_argument("--json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"],
                                                                          "moe_ep.json"))
  args = p.parse_args(argv)
  r = jax.device_count()
  n, d, f, e, k = args.tokens * r, args.latent, args.width, args.experts, args.top_k
  print(f"{r} x {jax.devices()[0].device_kind}: {n} tokens ({args.tokens} per rank), latent {d}, "
        f"width {f}, top-{k} of {e} experts ({e // r} per rank), rank 0's experts get "
        f"{args.skew:.0%} of slots (uniform {1 / r:.0%})", flush=True)
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (n, d), jnp.bfloat16)
  ids, wts = skewed_routing(keys[1], n, e, k, r, args.skew)
  w1 = (jax.random.normal(keys[2], (e, d, 2 * f), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
  w2 = (jax.random.normal(keys[3], (e, f, d), jnp.float32) * f ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[4], (n, d), jnp.bfloat16)
  counts = np.bincount(np.asarray(ids).reshape(-1) // (e // r), minlength=r)
  print(f"slots per home rank: {counts.tolist()} (max / mean {counts.max() / counts.mean():.2f})")
  act = lambda gu: jax.nn.silu(gu[:, :f]) * gu[:, f:]  # noqa: E731

  def loss(fn, x, w1, w2):
    return jnp.sum(fn(x, ids, wts, w1, w2, act).astype(jnp.float32) * dy)

  ref_fn = jax.jit(jax.value_and_grad(lambda *a: loss(moe_ops.expert_mlp, *a), argnums=(0, 1, 2)))
  ref = ref_fn(x, w1, w2)
  results = {}
  for moonep in (False, True):
    name = "moonep" if moonep else "plain"
    mesh_cfg = MeshConfig(data=1, expert=r, moonep=moonep)
    mesh = sharding.make_mesh(mesh_cfg)
    with sharding.layout(mesh_cfg), jax.set_mesh(mesh):
      tok = jax.sharding.NamedSharding(mesh, sharding.rules.token_spec())
      wsh = jax.sharding.NamedSharding(mesh, sharding.logical_spec(("expert", None, None)))
      xs, w1s, w2s = jax.device_put(x, tok), jax.device_put(w1, wsh), jax.device_put(w2, wsh)
      fn = jax.jit(jax.value_and_grad(lambda *a: loss(expert_parallel.moe_dispatch, *a),
                                      argnums=(0, 1, 2)))
      out = fn(xs, w1s, w2s)
      errs = [rel_err(a, b) for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(ref[1]))]
      ms = median_ms(fn, xs, w1s, w2s, reps=5, inner=3)
      trace = args.profile and f"{args.profile}/{name}" or f"/tmp/moe_ep_trace_{name}_{time.time():.0f}"
      with jax.profiler.trace(trace, create_perfetto_trace=True):
        for _ in range(3):
          out = fn(xs, w1s, w2s)
        jax.block_until_ready(out)
    by_device = kernel_times(trace)[2]
    comp = {dev: sum(v for kind, v in kinds.items() if kind != COLLECTIVES) / 3e3
            for dev, kinds in by_device.items()}
    coll = {dev: kinds.get(COLLECTIVES, 0.0) / 3e3 for dev, kinds in by_device.items()}
    imbalance = max(comp.values()) / (sum(comp.values()) / len(comp)) if comp else None
    for dev, kinds in by_device.items():
      print(f"  {name} {dev}: " + ", ".join(f"{kind} {v / 3e3:.2f} ms" for kind, v in
                                          sorted(kinds.items(), key=lambda kv: -kv[1])), flush=True)
    results[name] = {"step_ms": ms, "compute_ms_by_device": comp, "collective_ms_by_device": coll,
                     "imbalance": imbalance, "rel_err_dx_dw1_dw2": errs}
    print(f"{name:7s} fwd+bwd {ms:8.2f} ms; compute per device "
          f"{', '.join(f'{v:.2f}' for v in comp.values())} ms (slowest / mean "
          f"{imbalance and f'{imbalance:.2f}'}); collectives "
          f"{', '.join(f'{v:.2f}' for v in coll.values())} ms; rel err vs one device "
          f"{', '.join(f'{v:.1e}' for v in errs)}", flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"args": vars(args), **results}, indent=1))


if __name__ == "__main__":
  main()
