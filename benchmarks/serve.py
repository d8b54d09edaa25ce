"""Serving engine on one GPU: decode tokens/s against the HBM floor, TTFT, prefix hits, a stream.

``python benchmarks/serve.py --config configs/k3_1b.yaml [--json OUT] [key=value ...]`` builds the
config's model with random bf16 weights and :class:`k3jax.serve.engine.Engine`, then measures

- decode: steady decode steps at batch 1, 16, 64 and 256 (contexts of ``--context`` tokens),
  against the floor: the bytes a step must read (every dense weight, the experts the batch routes
  to in expectation, the MLA pages and KDA states of the batch, the states written back) over the
  card's measured copy bandwidth (first: what a run cut short by its time limit must keep);
- TTFT of a 1K, 8K and 32K prompt (one request, nothing cached), and of an 8K prompt whose first
  7.5K tokens another request left in the prefix cache;
- a stream: Poisson arrivals of mixed prompt and output lengths, generated tokens/s and mean TTFT.

The engine is driven synchronously (``Engine.step``); step shapes compile on first use, outside
the timed windows. Figures: benchmarks/RESULTS.md ("Serving").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import config as config_lib
from k3jax.model import K3Model
from k3jax.serve.engine import Engine
from k3jax.serve.types import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402


def copy_bandwidth(gib: float = 4.0) -> float:
  """Bytes per second of a device-to-device copy (read plus write) of a ``gib`` GiB array."""
  x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
  f = jax.jit(lambda a: a + 1.0)
  f(x).block_until_ready()
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * x.nbytes / min(times)


def weight_bytes(params) -> tuple[int, int, int]:
  """(bytes of the weights every step reads, bytes of one routed expert of one layer, number of
  MoE layers)."""
  dense, experts, layers = 0, 0, set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if "experts" in names:
      experts += leaf.nbytes
      layers.add(names[names.index("layers") + 1])
    else:
      dense += leaf.nbytes
  return dense, experts, len(layers)


def decode_floor(cfg, params, batch: int, context: int, bandwidth: float) -> float:
  """Seconds a decode step of ``batch`` requests at ``context`` tokens must take to read what it
  touches (see the module docstring)."""
  m = cfg.model
  dense, experts, moe_layers = weight_bytes(params)
  e, k = m.moe.num_experts, m.moe.top_k
  touched = e * (1 - (1 - k / e) ** batch)  # distinct experts of a uniform router
  per_expert = experts / max(moe_layers, 1) / e
  n_mla = len(m.mla_layers)
  n_kda = m.num_layers - n_mla
  item = jnp.dtype(m.cdtype).itemsize
  mla = batch * context * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * item * n_mla
  kv = m.kda
  state = kv.value_heads * kv.v_head_dim * kv.head_dim * 4
  conv = (kv.conv_size - 1) * (2 * kv.num_heads * kv.head_dim + kv.value_heads * kv.v_head_dim) * item
  kda = batch * 2 * (state + conv) * n_kda
  return (dense + moe_layers * touched * per_expert + mla + kda) / bandwidth


def ttft(engine: Engine, prompt: list[int]) -> float:
  t0 = time.perf_counter()
  engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
  return time.perf_counter() - t0


def decode_rate(engine: Engine, batch: int, context: int, steps: int, rng,
                profile: str | None = None) -> float:
  """Seconds per decode step of ``batch`` requests once they all decode (``profile``: a directory
  for a trace of as many steps more, after the timed ones, whose GPU time per step is printed)."""
  vocab = engine.cfg.vocab_size
  sp = SamplingParams(max_tokens=2 * steps + 8, temperature=0.0, ignore_eos=True)
  # One prompt at a time, each paused once prefilled, then all resumed: the run meets one prefill
  # row count and one decode shape (``batch`` rows), not every bucket on the way up, each of which
  # would compile at first use.
  ids = []
  for _ in range(batch):
    ids.append(engine.submit(rng.integers(3, vocab, context).tolist(), sp, lambda o: None))
    while not any(r.id == ids[-1] and r.computed >= len(r.prompt) for r in engine.running):
      engine.step()
    engine.pause(ids[-1])
  for rid in ids:
    engine.resume(rid)
  for _ in range(3):  # compile and warm the decode shape
    engine.step()
  t0 = time.perf_counter()
  for _ in range(steps):
    engine.step()
  secs = (time.perf_counter() - t0) / steps
  if profile:
    with jax.profiler.trace(profile):
      for _ in range(steps):
        engine.step()
    busy, span = timing.gpu_span(profile)
    events, gpu = timing._gpu_events(profile)
    kernels = sum(1 for e in events if e.get("ph") == "X" and e.get("pid") in gpu)
    print(f"  profile B{batch}: GPU busy {busy / steps / 1e3:.2f} ms of {span / steps / 1e3:.2f} ms "
          f"per step, {kernels / steps:.0f} kernels per step", flush=True)
    by_kind, by_name, by_device, _ = timing.kernel_times(profile)
    timing.report_kernels(by_kind, by_name, by_device, steps)
  while engine.has_work():
    engine.step()
  return secs


def stream(engine: Engine, n: int, rate: float, rng, prompts=(128, 2048), outputs=(32, 256)) -> dict:
  """``n`` requests arriving at ``rate`` per second (Poisson), prompt and output lengths uniform
  in the ``prompts`` and ``outputs`` ranges: generated tokens per second and the mean TTFT."""
  vocab = engine.cfg.vocab_size
  arrivals = np.cumsum(rng.exponential(1 / rate, n))
  first, done, submitted = {}, [0], {}
  t0 = time.perf_counter()

  def on(o):
    if o.token is not None:
      done[0] += 1
      first.setdefault(o.request_id, time.perf_counter())

  i = 0
  while i < n or engine.has_work():
    now = time.perf_counter() - t0
    while i < n and arrivals[i] <= now:
      sp = SamplingParams(max_tokens=int(rng.integers(outputs[0], outputs[1] + 1)),
                          temperature=0.0, ignore_eos=True)
      prompt = rng.integers(3, vocab, int(rng.integers(prompts[0], prompts[1] + 1))).tolist()
      rid = engine.submit(prompt, sp, on)
      submitted[rid] = t0 + arrivals[i]
      i += 1
    if engine.has_work():
      engine.step()
    else:
      time.sleep(max(0.0, arrivals[i] - now))
  wall = time.perf_counter() - t0
  return {"requests": n, "rate_per_s": rate, "prompts": prompts, "outputs": outputs, "tokens_per_s": done[0] / wall,
          "mean_ttft_s": float(np.mean([first[r] - submitted[r] for r in submitted]))}


def prefix_hit(engine: Engine, spec: str, rng, out: dict) -> None:
  """TTFT of a prompt whose first ``cached`` tokens (``spec``: ``"cached,new"``) another request
  left in the prefix cache, against the same length cold."""
  vocab = engine.cfg.vocab_size
  cached, new = (int(x) for x in spec.split(","))
  shared = rng.integers(3, vocab, cached).tolist()
  ttft(engine, shared + rng.integers(3, vocab, new).tolist())
  hits = engine.stats.prefix_hit_tokens
  warm = ttft(engine, shared + rng.integers(3, vocab, new).tolist())
  cold = ttft(engine, rng.integers(3, vocab, cached + new).tolist())
  out["prefix"] = {"cold_s": cold, "hit_s": warm, "speedup": cold / warm,
                   "hit_tokens": engine.stats.prefix_hit_tokens - hits}
  print(f"{cached + new}-token prompt, {cached} cached: {warm * 1e3:.1f} ms against {cold * 1e3:.1f} ms cold "
        f"({cold / warm:.1f}x; {out['prefix']['hit_tokens']} tokens hit)", flush=True)



def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/k3_1b.yaml")
  p.add_argument("--context", type=int, default=1024, help="tokens per request in the decode runs")
  p.add_argument("--batches", default="1,16,64,256")
  p.add_argument("--ttft", default="1024,8192,32768")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--stream", type=int, default=64, help="requests in the stream (0: skip)")
  p.add_argument("--rate", type=float, default=8.0)
  p.add_argument("--stream-lengths", default="128,2048,32,256",
                 help="prompt and output length ranges of the stream")
  p.add_argument("--prefix", default="7680,512", help="cached and new tokens of the prefix-hit run")
  p.add_argument("--json", default=None)
  p.add_argument("--profile", default=None, help="trace the decode steps of each batch size here")
  p.add_argument("--only-decode", action="store_true", help="stop after the decode runs")
  p.add_argument("--precompile", action="store_true",
                 help="compile every step shape side by side before the runs (Engine.compile)")
  p.add_argument("overrides", nargs="*")
  a = p.parse_args(argv)
  batches = [int(b) for b in a.batches.split(",") if b]
  lengths = [int(t) for t in a.ttft.split(",") if t]
  # the longest request of any phase (prompt and output), and a margin
  longest = lengths + [a.context + a.steps + 64]
  if a.prefix:
    longest.append(sum(int(x) for x in a.prefix.split(",")))
  if a.stream:
    lo, hi, olo, ohi = (int(x) for x in a.stream_lengths.split(","))
    longest.append(hi + ohi)
  base = ["model.param_dtype=bfloat16", "model.compute_dtype=bfloat16",
          f"serve.max_batch={max(batches)}", "serve.block_size=512", "serve.token_budget=4096",
          f"serve.max_model_len={max(longest) + 64}"]
  pages = max(max(batches) * (a.context + a.steps + 80), 2 * max(lengths + [8192])) // 64 + 256
  base += [f"serve.num_pages={pages}", f"serve.num_slots={max(batches) + 33}"]
  cfg = config_lib.load(a.config, base + a.overrides)
  out = {"config": cfg.model.name, "device": jax.devices()[0].device_kind,
         "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "serve": config_lib.to_dict(cfg.serve), "context": a.context}
  bw = copy_bandwidth()
  out["copy_bandwidth_tb_s"] = bw / 1e12
  print(f"{cfg.model.name} on {out['device']}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
  t0 = time.perf_counter()
  model = K3Model(cfg.model, rngs=nnx.Rngs(0))
  engine = Engine(model, cfg.serve)
  del model
  print(f"model and cache built in {time.perf_counter() - t0:.0f} s; "
        f"{engine.pages.total} pages, {engine.slots.total} slots", flush=True)
  if a.precompile:
    out["compile_s"] = engine.compile()
    print(f"compiled {len(engine._steps)} step shapes in {out['compile_s']:.0f} s", flush=True)
  rng = np.random.default_rng(0)
  vocab = cfg.model.vocab_size

  out["decode"] = []
  for b in batches:
    secs = decode_rate(engine, b, a.context, a.steps, rng,
                       f"{a.profile}/b{b}" if a.profile else None)
    floor = decode_floor(cfg, engine._params, b, a.context, bw)
    row = {"batch": b, "step_ms": secs * 1e3, "tokens_per_s": b / secs,
           "floor_ms": floor * 1e3, "over_floor": secs / floor}
    out["decode"].append(row)
    print(f"decode B{b:<4} ctx {a.context}: {secs * 1e3:7.2f} ms/step, {b / secs:9.0f} tok/s, "
          f"floor {floor * 1e3:6.2f} ms ({secs / floor:.2f}x)", flush=True)

  if a.only_decode:
    lengths, a.stream, a.prefix = [], 0, None
  out["ttft"] = []
  for n in lengths:
    ttft(engine, rng.integers(3, vocab, n).tolist())  # compiles the chunk shapes
    s = ttft(engine, rng.integers(3, vocab, n).tolist())
    out["ttft"].append({"prompt": n, "ttft_s": s})
    print(f"TTFT {n:>6} tokens: {s * 1e3:8.1f} ms", flush=True)

  if a.prefix:
    prefix_hit(engine, a.prefix, rng, out)
  if a.stream:
    out["stream"] = stream(engine, a.stream, a.rate, rng, (lo, hi), (olo, ohi))
    print(f"stream: {json.dumps(out['stream'])}", flush=True)
  out["compiled_shapes"] = len(engine._steps)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
