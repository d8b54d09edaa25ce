"""``python -m k3jax.report RUN_DIR [--out PNG]``: one PNG of a training run's curves.

Four panels over steps, from ``RUN_DIR/metrics.jsonl``: training and eval loss, the learning
rate, tokens/s, and each MoE layer's expert-load imbalance (max over mean load; 1 is perfectly
balanced). Post-training runs (``train.mode`` rl / opd, :mod:`k3jax.posttrain.loop`) add a row:
reward and completion length; KL to the behaviour policy, stale-token fraction, OPD's KL to the
teachers and the trainer's step time; their rollout tokens/s join the tokens/s panel. The
default output is ``RUN_DIR/report.png``. Drawn with matplotlib's Agg canvas
without pyplot, so it neither needs a display nor changes a notebook's backend.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import yaml
from matplotlib.figure import Figure

from k3jax import config as config_lib
from k3jax import metrics as metrics_lib
from k3jax import storage
from k3jax.train_step import moe_layers


class ReportError(RuntimeError):
  """The run directory has nothing to plot."""


def series(records: list[dict]) -> dict[str, dict[int, object]]:
  """``{key: {step: value}}`` of every non-null value; a resumed run's later line for a step
  replaces the earlier one."""
  out: dict[str, dict[int, object]] = {}
  for r in records:
    for k, v in r.items():
      if k != "step" and v is not None:
        out.setdefault(k, {})[r["step"]] = v
  return out


def _layer_names(run_dir: storage.AnyPath, n: int) -> list[str]:
  """Labels of the ``n`` per-MoE-layer columns: their layer indices from the run's config."""
  path = run_dir / "config.yaml"
  if path.is_file():
    cfg = config_lib.from_dict(yaml.safe_load(path.read_text()) or {})
    layers = moe_layers(cfg)
    if len(layers) == n:
      return [f"layer {i}" for i in layers]
  return [f"MoE layer {j}" for j in range(n)]


def _line(ax, s: dict[int, object], label: str, **kw) -> None:
  steps = sorted(s)
  ax.plot(steps, [s[t] for t in steps], label=label, **kw)


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
  """Writes the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.png``); returns it."""
  run_dir = storage.path(run_dir)
  path = run_dir / "metrics.jsonl"
  if not path.is_file():
    raise ReportError(f"{path} does not exist: RUN_DIR must be a training run directory "
                      "(the --run-dir of k3jax-train)")
  s = series(metrics_lib.read_jsonl(path))
  if "loss" not in s:
    raise ReportError(f"{path} holds no training step yet")
  out = storage.path(out) if out is not None else run_dir / "report.png"

  post = "reward" in s
  fig = Figure(figsize=(11, 11 if post else 7.5), layout="constrained")
  axes = fig.subplots(3 if post else 2, 2, sharex=True)
  (loss, lr), (tps, moe) = axes[:2]
  fig.suptitle(f"{run_dir.name}: {max(s['loss'])} steps")
  _line(loss, s["loss"], "train")
  if "eval_loss" in s:
    _line(loss, s["eval_loss"], "eval", marker="o")
  loss.set(title="loss (nats / token)")
  loss.legend()
  _line(lr, s.get("lr", {}), "lr")
  lr.set(title="learning rate")
  _line(tps, s.get("tokens_per_s", {}), "tokens/s")
  if post:
    _line(tps, s.get("rollout_tokens_per_s", {}), "rollout tokens/s")
    tps.legend()
  tps.set(title="tokens / s", ylim=(0, None))
  imbalance = s.get("moe_load_max_mean", {})
  width = max((len(v) for v in imbalance.values()), default=0)
  for j, name in enumerate(_layer_names(run_dir, width)):
    _line(moe, {t: v[j] for t, v in imbalance.items() if len(v) == width}, name)
  moe.axhline(1.0, color="grey", lw=0.8, ls="--")
  moe.set(title="expert load imbalance (max / mean)")
  if width:
    moe.legend(fontsize="small", ncols=1 + width // 8)
  if post:
    reward, policy = axes[2]
    _line(reward, s["reward"], "reward")
    _line(reward, s.get("length", {}), "completion tokens")
    reward.set(title="reward and length")
    for key in ("kl", "stale_fraction", "teacher_kl", "eval_kl", "train_step_s"):
      if key in s:
        _line(policy, s[key], key, marker="o" if key == "eval_kl" else None)
    policy.set(title="KL, stale tokens, step time (s)")
    for ax in (reward, policy):
      ax.legend(fontsize="small")
  for ax in axes[-1]:
    ax.set_xlabel("step")
  for ax in axes.flat:
    ax.grid(alpha=0.3)
  storage.makedirs(out.parent)
  png = io.BytesIO()
  fig.savefig(png, dpi=100, format="png")
  storage.write(out, png.getvalue())
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m k3jax.report", description=__doc__.split("\n")[0])
  p.add_argument("run_dir", help="a training run directory (holds metrics.jsonl)")
  p.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/report.png)")
  args = p.parse_args(argv)
  try:
    print(plot(args.run_dir, args.out))
  except ReportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
