"""``python -m k3jax.report RUN_DIR``: the PNG of a run's curves; TensorBoard only through the
``[tensorboard]`` extra (tensorboardX)."""

import json
import shutil
import sys

import numpy as np
import pytest

from k3jax import metrics, report


def _fake_run(run_dir, root, rng, steps=20):
  """A run directory as k3jax.train leaves it (config.yaml, metrics.jsonl), resumed once: steps
  9-10 are logged twice and the later lines must win."""
  run_dir.mkdir()
  shutil.copy(root / "configs" / "k3_tiny.yaml", run_dir / "config.yaml")  # MoE layers 1-4
  lines = []
  for step in [*range(1, 11), 9, 10, *range(11, steps + 1)]:
    lines.append({"step": step, "loss": float(5 - step / 10 + rng.normal(0, 0.1)),
                  "lr": float(rng.uniform(1e-4, 3e-3)), "grad_norm": float(rng.uniform(0.5, 2)),
                  "tokens_per_s": None if step == 1 else float(rng.uniform(100, 200)),
                  "mfu": None, "moe_load_max_mean": rng.uniform(1, 4, 4).tolist()})
    if step % 5 == 0:
      lines.append({"step": step, "eval_loss": float(rng.uniform(3, 5))})
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  return lines


def test_report_writes_a_png_of_the_run(tmp_path, root, monkeypatch, capsys):
  import matplotlib.image
  rng = np.random.default_rng()
  lines = _fake_run(tmp_path / "run", root, rng)
  monkeypatch.chdir(tmp_path)
  assert report.main(["run"]) == 0
  out = tmp_path / "run" / "report.png"
  assert capsys.readouterr().out.strip() == str(out)  # made absolute, as every path
  img = matplotlib.image.imread(out)
  assert img.shape[:2] == (750, 1100) and img.std() > 0.05  # drawn, not blank
  assert report.main(["run", "--out", "plots/r.png"]) == 0
  assert (tmp_path / "plots" / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert not list(tmp_path.glob("**/*.tmp"))

  s = report.series(lines)
  resumed = [r for r in lines if r["step"] == 10 and "loss" in r][-1]
  assert s["loss"][10] == resumed["loss"] and s["moe_load_max_mean"][10] == resumed["moe_load_max_mean"]
  assert sorted(s["loss"]) == list(range(1, 21)) and 1 not in s["tokens_per_s"]
  assert sorted(s["eval_loss"]) == [5, 10, 15, 20]
  assert report._layer_names(tmp_path / "run", 4) == ["layer 1", "layer 2", "layer 3", "layer 4"]


@pytest.mark.parametrize("content, message", [
    (None, "must be a training run directory"), ("", "holds no training step yet")])
def test_report_of_a_directory_without_metrics_is_a_clear_error(tmp_path, capsys, content,
                                                                 message):
  if content is not None:
    (tmp_path / "metrics.jsonl").write_text(content)
  assert report.main([str(tmp_path)]) == 2
  assert message in capsys.readouterr().err
  assert not (tmp_path / "report.png").exists()


def test_tensorboard_comes_only_from_tensorboardx(tmp_path, monkeypatch):
  """Without the extra no event files are written, whatever else (torch) is importable."""
  torch_tb = type(sys)("torch.utils.tensorboard")
  torch_tb.SummaryWriter = lambda log_dir: pytest.fail("torch's SummaryWriter was used")
  monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", torch_tb)
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # not installed
  m = metrics.Metrics(tmp_path, total_steps=2, start_step=0, progress=False)
  m.write({"step": 1, "loss": float(np.random.default_rng().uniform(1, 5))})
  m.close()
  assert m._tb is None and not (tmp_path / "tensorboard").exists()


def test_report_of_a_posttraining_run_adds_its_row(tmp_path, root):
  import matplotlib.image
  run = tmp_path / "rl"
  run.mkdir()
  shutil.copy(root / "configs" / "k3_tiny.yaml", run / "config.yaml")
  lines = [{"step": s, "loss": 0.1, "lr": 1e-3, "reward": s / 10, "length": 2.0, "kl": 0.01,
            "stale_fraction": 0.2, "rollout_tokens_per_s": 50.0, "train_step_s": 0.5,
            "moe_load_max_mean": [1.0] * 4} for s in range(1, 11)]
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  img = matplotlib.image.imread(report.plot(run))
  assert img.shape[:2] == (1100, 1100) and img.std() > 0.05
