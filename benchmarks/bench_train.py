"""Times the training step of a config: compile time, tokens/s, MFU and where the time goes.

  python benchmarks/bench_train.py --config configs/k3_1b.yaml --steps 10 [--profile DIR] [key=value ...]
  python benchmarks/bench_train.py --config configs/k3_1b.yaml --lower cuda   # on CPU: trace + lower only

The step is the one ``train.py`` runs (same init, optimizer, data and jitted function). Compile time
is ``jit(...).lower(...).compile()`` of the first shape. Throughput is the median step time over
``--steps`` steps after two warm-up steps, every step synchronised. With ``--profile`` two more
steps run under ``jax.profiler`` and the GPU kernel time is summed by kind (KDA, attention,
grouped expert matmul, dense matmul, other fusions), read from the Perfetto trace.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import train  # noqa: E402
from k3jax import config as config_lib, data as data_lib, flops, optim  # noqa: E402
from k3jax import train_step as step_lib  # noqa: E402

KINDS = (  # (kind, substrings of a kernel name), first match wins
    ("kda", ("kda", "delta", "chunk_")),
    ("attention (MLA)", ("mla", "flash", "attention", "fmha", "cudnn", "sdpa")),
    ("expert grouped matmul", ("gmm", "ragged", "grouped", "moe")),
    ("dense matmul", ("gemm", "nvjet", "xmma", "cublas", "cutlass", "matmul", "dot")),
    ("sort/gather/scatter", ("sort", "scatter", "gather", "radix", "topk", "top_k")),
)


def kind_of(name: str) -> str:
  low = name.lower()
  for kind, keys in KINDS:
    if any(k in low for k in keys):
      return kind
  return "other fusions (elementwise, norms, optimizer, reductions)"


def kernel_times(trace_dir: str) -> tuple[dict, dict]:
  """({kind: microseconds}, {kernel name: microseconds}) of GPU events in the Perfetto trace."""
  files = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True) or \
      glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
  if not files:
    return {}, {}
  with gzip.open(files[0]) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in names.items() if "gpu" in n.lower() or "/device:" in n.lower()}
  by_kind, by_name = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
      by_name[e["name"]] += e["dur"]
      by_kind[kind_of(e["name"])] += e["dur"]
  return dict(by_kind), dict(by_name)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/k3_1b.yaml")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--lower", default=None, help="only trace and lower for this platform")
  p.add_argument("--profile", default=None, help="trace two steps into this directory")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args(argv)
  cfg = config_lib.load(args.config, ["checkpoint.enabled=false", *args.overrides])
  b, t = cfg.train.batch_size, cfg.data.seq_len
  print(f"{cfg.model.name}: batch {b} x {t}, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}", flush=True)

  mesh = train.sharding.make_mesh(cfg.mesh)
  t0 = time.perf_counter()
  if args.lower:
    from flax import nnx
    from k3jax.latent_moe import RouterBias
    from k3jax.model import K3Model
    abstract = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0)))
    graphdef, params, biases = nnx.split(abstract, nnx.Param, RouterBias)
    params, biases = nnx.to_pure_dict(params), nnx.to_pure_dict(biases)
  else:
    graphdef, params, biases = train.init_model(cfg, mesh)
  tx, schedule = optim.make_optimizer(cfg, params)
  opt_state = jax.eval_shape(tx.init, params) if args.lower else jax.jit(tx.init)(params)
  fn = jax.jit(step_lib.make_train_step(cfg, graphdef, tx, schedule),
               donate_argnums=() if args.lower else (0, 1, 2))
  spec = jax.ShapeDtypeStruct
  batch_spec = {"input_ids": spec((b, t), jnp.int32), "targets": spec((b, t), jnp.int32),
                "segment_ids": spec((b, t), jnp.int32), "positions": spec((b, t), jnp.int32),
                "weights": spec((b, t), jnp.float32)}
  rng = jax.random.key_data(jax.random.key(0))
  print(f"init {time.perf_counter() - t0:.1f} s", flush=True)
  with jax.set_mesh(mesh):
    t0 = time.perf_counter()
    traced = fn.trace(params, opt_state, biases, jnp.int32(0), rng, batch_spec)
    t_trace = time.perf_counter() - t0
    if args.lower:
      traced.lower(lowering_platforms=(args.lower,))
      print(f"trace {t_trace:.1f} s, lower for {args.lower} {time.perf_counter() - t0 - t_trace:.1f} s")
      return
    lowered = traced.lower()
    t_lower = time.perf_counter() - t0 - t_trace
    compiled = lowered.compile()
    t_compile = time.perf_counter() - t0
    print(f"compile: trace {t_trace:.1f} s + lower {t_lower:.1f} s + compile "
          f"{t_compile - t_trace - t_lower:.1f} s = {t_compile:.1f} s", flush=True)

    data = data_lib.Data(cfg)
    it = iter(data.dataset("train", t))
    sh = train.sharding.batch_sharding(mesh)
    times, losses = [], []
    for i in range(args.steps + 2):
      batch = train.place(next(it), sh)
      s0 = time.perf_counter()
      params, opt_state, biases, m = compiled(params, opt_state, biases, jnp.int32(i), rng, batch)
      jax.block_until_ready(m)
      if i >= 2:
        times.append(time.perf_counter() - s0)
      losses.append(float(m["loss"]))
    step_s = statistics.median(times)
    tps = b * t / step_s
    fpt = flops.train_flops_per_token(cfg.model, t)
    peak, note = flops.device_peak_flops(cfg.train.peak_tflops)
    mfu = fpt * tps / peak if peak else None
    print(f"losses {' '.join(f'{x:.3f}' for x in losses)}")
    print(f"step {step_s * 1e3:.1f} ms (median of {len(times)}; min {min(times) * 1e3:.1f}), "
          f"{tps:,.0f} tokens/s, {fpt / 1e9:.2f} GFLOP/token -> {fpt * tps / 1e12:.1f} TFLOP/s, "
          f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'} ({note})", flush=True)
    breakdown = flops.forward_flops_per_token(cfg.model, t)
    print("model FLOPs per token (forward): " + ", ".join(
        f"{k} {v / breakdown['total']:.0%}" for k, v in breakdown.items() if k != "total"))
    mem = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in mem:
      print(f"peak device memory {mem['peak_bytes_in_use'] / 2**30:.1f} GiB")

    if args.profile:
      with jax.profiler.trace(args.profile, create_perfetto_trace=True):
        for i in range(2):
          params, opt_state, biases, m = compiled(params, opt_state, biases, jnp.int32(i), rng,
                                                  train.place(next(it), sh))
        jax.block_until_ready(m)
      by_kind, by_name = kernel_times(args.profile)
      total = sum(by_kind.values())
      if total:
        print(f"GPU kernel time over 2 steps: {total / 2e3:.1f} ms per step")
        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
          print(f"  {k:58s} {v / 2e3:8.1f} ms  {v / total:6.1%}")
        print("top kernels:")
        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]:
          print(f"  {v / 2e3:8.2f} ms  {k[:110]}")
      else:
        print("no GPU events found in the trace")


if __name__ == "__main__":
  main()
