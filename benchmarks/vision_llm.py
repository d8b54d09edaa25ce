"""The LLM's training step beside the vision tower: times ``train.py``'s step of a config (k3_1b
by default) on random token rows, then prints it in one table with the tower rows that
``benchmarks/vision.py`` wrote to ``$OUT/vision_bench.json`` earlier in the same run (issue 44
item 6). Rows go to ``$OUT/vision_llm.json``.

  python3 benchmarks/vision.py && python3 benchmarks/vision_llm.py --config k3_1b   # one run
  python3 benchmarks/vision_llm.py --config k3_tiny --steps 3 --interpret           # CPU smoke

Random rows, not ``k3jax.data`` (grain is not installed on the GPU machine): every row is one
document of ``data.seq_len`` tokens, so the MFU's attention context is that of unpacked rows.
The step is ``train.py``'s (same init, optimizer, jitted function, ahead-of-time compile);
``key=value`` overrides pick the batch, remat and mesh as for ``train.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

# as train.py: the step may use 92% of the card (k3_1b's needs 106 GiB of temporaries)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import sharding  # noqa: E402
from k3jax import cli, flops  # noqa: E402
from k3jax import train_step as step_lib  # noqa: E402
from k3jax.train_state import init_train_state  # noqa: E402
from timing import Rows  # noqa: E402

ROWS = Rows("vision_llm.json")


def random_batch(cfg, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """``[B, T]`` rows of random token ids, one document each."""
  b, t = cfg.train.batch_size, cfg.data.seq_len
  ids = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
  return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.ones((b, t), np.int32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
          "weights": np.ones((b, t), np.float32)}


def llm_step(cfg, steps: int) -> dict:
  """Median seconds of ``steps`` training steps (after two untimed ones) and the model FLOP/s."""
  mesh = sharding.make_mesh(cfg.mesh)
  b, t = cfg.train.batch_size, cfg.data.seq_len
  with sharding.layout(cfg.mesh):
    state = init_train_state(cfg, mesh)
    fn = step_lib.jit_train_step(step_lib.make_train_step(cfg, state.graphdef, state.tx,
                                                          state.schedule),
                                 donate=jax.default_backend() != "cpu", state=state)
    sh = sharding.batch_sharding(mesh)
    with jax.set_mesh(mesh):
      compiled, report = step_lib.compile_train_step(fn, state, step_lib.batch_spec(b, t, sh))
      rng = np.random.default_rng(0)
      times = []
      for i in range(steps + 2):
        batch = step_lib.place_batch(random_batch(cfg, rng), sh)
        t0 = time.perf_counter()
        state, m = step_lib.apply_step(compiled, state, i, batch)
        jax.block_until_ready(m)
        if i >= 2:
          times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  fpt = flops.train_flops_per_token(cfg.model, t, (t + 1) / 2)
  return {"name": f"llm_step_{cfg.model.name}", "batch": b, "seq_len": t,
          "step_ms": round(step_s * 1e3, 3), "tokens_per_s": round(b * t / step_s),
          "TFLOPs": round(fpt * b * t / step_s / 1e12, 1), "compile_s": round(report.total_s, 1),
          "loss": float(m["loss"]), "device": jax.devices()[0].device_kind}


def table(tower: list[dict], llm: dict) -> str:
  """The tower rows and the LLM step as one text table; each tower row's forward+backward also
  as a fraction of the LLM step."""
  lines = [f"{'what':<28}{'fwd ms':>10}{'fwd+bwd ms':>12}{'TFLOP/s':>10}{'of LLM step':>13}"]
  for r in tower:
    ratio = r["fwdbwd_ms"] / llm["step_ms"]
    lines.append(f"{r['name']:<28}{r['fwd_ms']:>10.2f}{r['fwdbwd_ms']:>12.2f}"
                 f"{r['fwdbwd_TFLOPs']:>10.1f}{ratio:>12.1%}")
  lines.append(f"{llm['name'] + ' (' + str(llm['batch']) + 'x' + str(llm['seq_len']) + ')':<28}"
               f"{'':>10}{llm['step_ms']:>12.2f}{llm['TFLOPs']:>10.1f}{1:>12.0%}")
  return "\n".join(lines)


def main(argv=None):
  p = cli.parser("vision_llm.py", __doc__.split("\n")[0], config_default="k3_1b")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--tower-json", default=None,
                 help="benchmarks/vision.py's rows (default $OUT/vision_bench.json)")
  p.add_argument("--interpret", action="store_true", help="allow a CPU run")
  args = cli.parse(p, sys.argv[1:] if argv is None else argv)
  if jax.default_backend() != "gpu" and not args.interpret:
    sys.exit("vision_llm.py: no GPU (pass --interpret to run on CPU)")
  cfg = cli.load(args.config, args.overrides)
  llm = llm_step(cfg, args.steps)
  ROWS.emit(llm)
  path = args.tower_json or os.path.join(os.environ.get("OUT", "."), "vision_bench.json")
  tower = json.load(open(path)) if os.path.exists(path) else []
  if not tower:
    print(f"no tower rows at {path}: run benchmarks/vision.py first in the same run")
  print(table([r for r in tower if "fwdbwd_ms" in r], llm))


if __name__ == "__main__":
  main()
