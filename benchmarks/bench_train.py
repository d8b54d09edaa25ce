"""Times the training step of a config: compile time, tokens/s, MFU and where the time goes.

  python benchmarks/bench_train.py --config configs/k3_1b.yaml --steps 10 [--profile DIR] [key=value ...]
  python benchmarks/bench_train.py --config configs/k3_1b.yaml --lower cuda   # on CPU: trace + lower only

The step is the one ``train.py`` runs (same init, optimizer, data, mesh and jitted function;
``mesh.*`` overrides pick the layout). Compile time is ``jit(...).lower(...).compile()`` of the
first shape. ``--steps`` steps run from step 0 (the loss of each is printed); throughput is the
median time of all but the first two, every step synchronised. With ``--profile`` two more steps
run under ``jax.profiler`` and the GPU kernel time is summed per device by kind (KDA, attention,
grouped expert matmul, dense matmul, collectives, other fusions), read from the Perfetto trace,
and by model scope (the ``jax.named_scope`` of each kernel's HLO instruction: ``kda``, ``mla``,
``moe/permute``, ``attn_res``, ``lm_head_loss``, ``optimizer``..., ``(bwd)`` for the backward).

Kernel variants are timed by the kernel benchmarks; config overrides (``model.*``, ``mesh.*``...)
pick what this one times. ``--json PATH`` writes every figure to PATH. ``--lock PATH`` holds an exclusive ``flock`` on PATH
from the first step to the end, so several layouts can compile side by side (CPU work) while
their timed steps run one at a time; it is taken once the card has the step's memory free
(processes that cannot start let the others go first).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sharding  # noqa: E402
from k3jax import config as config_lib, data as data_lib, flops  # noqa: E402
from k3jax import train_step as step_lib  # noqa: E402
from k3jax.train_state import abstract_train_state, init_train_state  # noqa: E402
from timing import COLLECTIVES, kernel_times, report_kernels  # noqa: E402

SCOPES = ("embed", "kda", "mla", "attn_res", "moe", "mlp", "router", "balance", "permute",
          "experts", "unpermute", "shared_experts", "lm_head_loss", "optimizer")


def hlo_scopes(hlo_text: str) -> dict[str, str]:
  """{HLO instruction name (dots and underscores both): scope label} from a compiled module's
  text. The label joins the known ``SCOPES`` in the instruction's ``op_name`` (outermost first),
  with `` (bwd)`` when the op is in a transposed (backward) computation."""
  out = {}
  for m in re.finditer(r'%([\w.-]+) = .*?metadata=\{op_name="([^"]*)"', hlo_text):
    name, op = m.groups()
    parts = []
    for tok in re.split(r"[/()]", op):
      if tok in SCOPES and tok not in parts:
        parts.append(tok)
    label = "/".join(parts) or "(unscoped)"
    if "transpose(" in op:
      label += " (bwd)"
    out[name] = out[name.replace(".", "_")] = label
  return out


@contextlib.contextmanager
def exclusive(path: str | None, need: int = 0, timeout_s: float = 420.0, pause_s: float = 15.0):
  """Holds an exclusive ``flock`` on ``path`` (nothing when None) once the card has ``need`` bytes
  free (nvidia-smi). What this process's own allocator pool holds unused does not count: the
  step's temporaries are one allocation, which the pool's scattered free chunks cannot serve, so
  it takes a new region of the card (Training run 45: counted in, 130.6 GiB looked free and the
  113.5 GiB allocation failed). Other processes of a one-GPU run keep their pools (their
  compiles' autotuning grows them) until they exit, so while the memory is not there the lock is
  let go for ``pause_s`` (another process runs its steps and exits), at most ``timeout_s`` in
  all; then the steps run anyway."""
  if path is None:
    yield
    return
  t0 = time.perf_counter()
  with open(path, "a") as fh:
    while True:
      fcntl.flock(fh, fcntl.LOCK_EX)
      free = device_memory_free()
      waited = time.perf_counter() - t0
      if free is None or free >= need or waited > timeout_s:
        break
      fcntl.flock(fh, fcntl.LOCK_UN)
      time.sleep(pause_s)
    if waited > 1 and free is not None:
      print(f"waited {waited:.0f} s for {need / 2**30:.1f} GiB of GPU memory "
            f"({free / 2**30:.1f} GiB free)", flush=True)
    try:
      yield
    finally:
      fcntl.flock(fh, fcntl.LOCK_UN)


def peak_memory() -> list[float]:
  """Peak bytes in use per local device, GiB (empty where the backend does not say)."""
  out = []
  for d in jax.local_devices():
    stats = d.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      out.append(stats["peak_bytes_in_use"] / 2**30)
  return out


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/k3_1b.yaml")
  p.add_argument("--steps", type=int, default=12, help="steps to run (the first two untimed)")
  p.add_argument("--lower", default=None, help="only trace and lower for this platform")
  p.add_argument("--profile", default=None, help="trace two steps into this directory")
  p.add_argument("--json", default=None, help="write the results to this file")
  p.add_argument("--hlo", default=None, help="write the compiled step's HLO text (gzip) here")
  p.add_argument("--lock", default=None, help="run the steps holding an exclusive flock on this file")
  p.add_argument("overrides", nargs="*")
  args = p.parse_intermixed_args(argv)  # overrides may follow options
  if args.steps < 3:
    p.error("--steps must be at least 3 (two untimed warm-up steps)")
  cfg = config_lib.load(args.config, ["checkpoint.enabled=false", *args.overrides])
  with sharding.layout(cfg.mesh):
    run(args, cfg)


def run(args, cfg: config_lib.Config) -> None:
  """The benchmark of ``cfg`` under its layout."""
  b, t = cfg.train.batch_size, cfg.data.seq_len
  mesh = sharding.make_mesh(cfg.mesh)
  layout = {a: s for a, s in zip(mesh.axis_names, mesh.axis_sizes) if s > 1}
  print(f"{cfg.model.name}: batch {b} x {t}, {len(mesh.devices.flat)} x "
        f"{jax.devices()[0].device_kind}, mesh {layout or 'one device'}, experts over "
        f"{list(cfg.mesh.expert_axes)}, moonep {cfg.mesh.moonep}, jax {jax.__version__}", flush=True)
  result = {"config": cfg.model.name, "overrides": args.overrides, "batch": b, "seq_len": t,
            "devices": len(mesh.devices.flat), "mesh": layout}

  t0 = time.perf_counter()
  state = abstract_train_state(cfg) if args.lower else init_train_state(cfg, mesh)
  fn = step_lib.jit_train_step(
      step_lib.make_train_step(cfg, state.graphdef, state.tx, state.schedule),
      donate=not args.lower, state=None if args.lower else state)
  sh = None if args.lower else sharding.batch_sharding(mesh)
  batch_spec = step_lib.batch_spec(b, t, sh)
  print(f"init {time.perf_counter() - t0:.1f} s", flush=True)
  with jax.set_mesh(mesh):
    if args.lower:
      t0 = time.perf_counter()
      traced = step_lib.trace_train_step(fn, state, batch_spec)
      t_trace = time.perf_counter() - t0
      traced.lower(lowering_platforms=(args.lower,))
      print(f"trace {t_trace:.1f} s, lower for {args.lower} {time.perf_counter() - t0 - t_trace:.1f} s")
      return
    compiled, report = step_lib.compile_train_step(fn, state, batch_spec)
    print(f"compile: {report}", flush=True)
    result["compile_s"] = report.total_s
    if args.hlo:
      with gzip.open(args.hlo, "wt") as f:
        f.write(compiled.as_text())
    mem = report.memory
    if mem is not None:
      result["compiled_temp_gib"] = mem.temp_size_in_bytes / 2**30
      result["compiled_argument_gib"] = mem.argument_size_in_bytes / 2**30
      print(f"compiled memory per device: arguments {result['compiled_argument_gib']:.1f} GiB, "
            f"temporaries {result['compiled_temp_gib']:.1f} GiB", flush=True)

    data = data_lib.Data(cfg)
    it = iter(data.dataset("train", t))
    times, losses, loads, contexts = [], [], [], []
    with exclusive(args.lock, 0 if mem is None else mem.temp_size_in_bytes + 2**30):
      for i in range(args.steps):
        host_batch = next(it)
        contexts.append(flops.mean_causal_context(host_batch["segment_ids"]))
        batch = step_lib.place_batch(host_batch, sh)
        s0 = time.perf_counter()
        state, m = step_lib.apply_step(compiled, state, i, batch)
        jax.block_until_ready(m)
        if i >= 2:
          times.append(time.perf_counter() - s0)
        losses.append(float(m["loss"]))
        if "moe_load_max_mean" in m:
          loads.append(float(np.max(m["moe_load_max_mean"])))  # on the host: no device op
      step_s = statistics.median(times)
      tps = b * t / step_s
      context = sum(contexts) / len(contexts)  # keys per query: documents are packed
      fpt = flops.train_flops_per_token(cfg.model, t, context)
      peak, note = flops.device_peak_flops(cfg.train.peak_tflops)
      mfu = fpt * tps / peak if peak else None
      print(f"losses {' '.join(f'{x:.4f}' for x in losses)}")
      if loads:
        print(f"max/mean expert load, worst MoE layer {' '.join(f'{x:.3f}' for x in loads)}")
      print(f"step {step_s * 1e3:.1f} ms (median of {len(times)}; min {min(times) * 1e3:.1f}), "
            f"{tps:,.0f} tokens/s, {fpt / 1e9:.2f} GFLOP/token -> {fpt * tps / 1e12:.1f} TFLOP/s, "
            f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'} ({note})", flush=True)
      breakdown = flops.forward_flops_per_token(cfg.model, t, context)
      print(f"mean attention context {context:,.0f} keys per query (packed documents); "
            "model FLOPs per token (forward): " + ", ".join(
          f"{k} {v / breakdown['total']:.0%}" for k, v in breakdown.items() if k != "total"))
      result.update(losses=losses, worst_expert_load=loads, step_ms=step_s * 1e3,
                    step_ms_min=min(times) * 1e3, tokens_per_s=tps, gflop_per_token=fpt / 1e9,
                    mfu=mfu, peak_note=note, mean_attention_context=context)
      mem = peak_memory()
      if mem:
        result["peak_gib_per_device"] = mem
        print(f"peak device memory: {', '.join(f'{x:.1f}' for x in mem)} GiB", flush=True)

      if args.profile:
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
          for i in range(2):
            state, m = step_lib.apply_step(compiled, state, i, step_lib.place_batch(next(it), sh))
          jax.block_until_ready(m)
        by_kind, by_name, by_device, by_op = kernel_times(args.profile)
        report_kernels(by_kind, by_name, by_device, steps=2)
        scopes = hlo_scopes(compiled.as_text())
        by_scope = collections.Counter()
        for op, us in by_op.items():
          by_scope[scopes.get(op, scopes.get(op.replace(".", "_"), "(unmatched)"))] += us
        n_dev = max(len(by_device), 1)
        result["profile_ms_per_step_by_scope"] = {
            k: v / 2e3 / n_dev for k, v in sorted(by_scope.items(), key=lambda kv: -kv[1])}
        result["top_ops_ms_per_step"] = [
            [op, scopes.get(op, ""), v / 2e3 / n_dev]
            for op, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:150]]
        print("GPU kernel time per step per device by model scope:")
        for k, v in result["profile_ms_per_step_by_scope"].items():
          print(f"  {k:40s} {v:8.1f} ms")
        result["profile_ms_per_step"] = {k: v / 2e3 for k, v in by_kind.items()}
        result["profile_ms_per_step_by_device"] = {
            d: {k: v / 2e3 for k, v in kinds.items()} for d, kinds in by_device.items()}
        result["collectives_ms_per_step_by_device"] = [
            kinds.get(COLLECTIVES, 0.0) / 2e3 for kinds in by_device.values()]
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=1))


def device_memory_free() -> int | None:
  """Bytes free on the (first visible) GPU (nvidia-smi); None without nvidia-smi."""
  dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
  try:
    out = subprocess.run(["nvidia-smi", "-i", dev, "--query-gpu=memory.used,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    used, total = (int(float(x)) * 2**20 for x in out.strip().split(","))
  except (OSError, ValueError, subprocess.SubprocessError):
    return None
  return total - used


if __name__ == "__main__":
  main()
