"""train.py end to end on CPU with a very small model: exact resume, SIGTERM, corrupt checkpoints,
the non-finite guard, clear errors, and the default (no --config, no --run-dir) path."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from k3jax import train
import sharding
from k3jax import checkpoint, metrics, train_state, train_step

# One shape for every run here, so the persistent compilation cache serves all but the first
# (a constant schedule keeps train.steps out of the compiled step).
SMALL = [
    "train.batch_size=2", "data.seq_len=64", "train.log_every=1", "train.eval_every=0",
    "checkpoint.every=2", "optimizer.schedule=constant",
    "optimizer.warmup_steps=2", "model.num_layers=2", "model.mla_layers=[1]",
    "model.hidden_size=64", "model.dense_intermediate=64", "model.kda.num_heads=1",
    "model.kda.implementation=naive", "model.mla.num_heads=1", "model.mla.q_lora_rank=32",
    "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=16",
    "model.mla.v_head_dim=16", "model.moe.num_experts=4", "model.moe.top_k=2",
    "model.moe.expert_intermediate=32", "model.moe.latent_dim=32",
    "model.moe.num_shared_experts=1",
]
STEPS = 6


def losses_by_step(run_dir):
  """{step: (loss, grad_norm)} from metrics.jsonl, the last line of each step."""
  out = {}
  for r in metrics.read_jsonl(run_dir / "metrics.jsonl"):
    if "loss" in r:
      out[r["step"]] = (r["loss"], r["grad_norm"])
  return out


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, root):
  """An uninterrupted run through the default path: no --config, no --run-dir."""
  cwd = tmp_path_factory.mktemp("default")
  (cwd / "configs").symlink_to(root / "configs")
  with pytest.MonkeyPatch.context() as mp:
    mp.chdir(cwd)
    assert train.main(["--no-progress", f"train.steps={STEPS}", *SMALL, "train.eval_every=3",
                       "train.eval_batches=1"]) == 0
  return cwd / "runs" / "k3_tiny"


@pytest.mark.slow
def test_default_path_trains_and_logs(full_run):
  records = metrics.read_jsonl(full_run / "metrics.jsonl")
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
  for r in steps:
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
      assert key in r
    assert np.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert len(r["moe_load_max_mean"]) == 1 and r["moe_load_max_mean"][0] >= 1.0
  assert steps[-1]["tokens_per_s"] > 0
  assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
  assert sorted(int(p.name) for p in (full_run / "checkpoints").iterdir()) == [2, 4, 6]
  assert (full_run / "config.yaml").exists()


@pytest.mark.slow
def test_resume_after_crash_skips_a_corrupt_checkpoint_and_is_bitwise_exact(
    full_run, tmp_path, monkeypatch, capsys):
  run_dir = tmp_path / "crash"
  real = train_step.compile_train_step

  def crashing(*args, **kw):  # the 6th call dies: step 5 done but not checkpointed
    (compiled, report), calls = real(*args, **kw), [0]

    def step(*args):
      calls[0] += 1
      if calls[0] == 6:
        raise RuntimeError("simulated crash")
      return compiled(*args)
    return step, report

  monkeypatch.setattr(train_step, "compile_train_step", crashing)
  argv = ["--no-progress", "--run-dir", str(run_dir), f"train.steps={STEPS}", *SMALL]
  with pytest.raises(RuntimeError, match="simulated crash"):
    train.main(argv)
  monkeypatch.setattr(train_step, "compile_train_step", real)
  ckpts = run_dir / "checkpoints"
  assert sorted(int(p.name) for p in ckpts.iterdir()) == [2, 4]
  # Break the newest checkpoint and leave the debris of an interrupted save.
  for root, _, files in os.walk(ckpts / "4" / "state"):
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"not a checkpoint")
  (ckpts / "6.orbax-checkpoint-tmp-123").mkdir()
  capsys.readouterr()
  assert train.main(argv) == 0
  out = capsys.readouterr()
  assert f"checkpoint {ckpts / '4'} is corrupt" in out.err
  assert "6.orbax-checkpoint-tmp-123" in out.err and "incomplete" in out.err
  assert "resumed from step 2" in out.out
  assert (ckpts / "4.corrupt").is_dir()  # kept, not overwritten by the new step 4
  assert losses_by_step(run_dir) == losses_by_step(full_run)  # floats compared exactly
  records = metrics.read_jsonl(run_dir / "metrics.jsonl")  # steps 3-5 ran twice, logged once
  assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_scanned_run_resumes_exactly_and_its_checkpoint_resumes_an_unscanned_one(
    tmp_path, capsys):
  """Layers 1-4 scanned as two groups of KDA + MLA (the train state stacked by position): from
  the run's step-2 checkpoint (one entry per layer on disk) the scanned model resumes bitwise
  exactly, and the unscanned one to the same losses within float32 rounding."""
  argv = lambda run_dir, scan: [
      "--no-progress", "--run-dir", str(tmp_path / run_dir), "train.steps=4", *SMALL,
      "model.num_layers=5", "model.mla_layers=[2,4]", f"model.scan_layers={scan}"]
  assert train.main(argv("full", "true")) == 0
  want = losses_by_step(tmp_path / "full")
  for run_dir, scan in (("scanned", "true"), ("plain", "false")):
    shutil.copytree(tmp_path / "full" / "checkpoints" / "2",
                    tmp_path / run_dir / "checkpoints" / "2")
    capsys.readouterr()
    assert train.main(argv(run_dir, scan)) == 0
    assert "resumed from step 2" in capsys.readouterr().out
  got = losses_by_step(tmp_path / "scanned")
  assert got == {k: want[k] for k in (3, 4)}  # floats compared exactly
  got = losses_by_step(tmp_path / "plain")
  assert sorted(got) == [3, 4]
  np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-5)


@pytest.mark.slow
def test_resume_with_another_optimizer_layout_stops_and_moves_nothing(full_run, tmp_path,
                                                                       capsys):
  """Resuming a run whose checkpoints hold AdamW's state with Muon (another optimizer state
  layout) stops with one error naming the checkpoint; the checkpoints are not moved aside as
  corrupt and nothing is trained."""
  run_dir = tmp_path / "layout"
  shutil.copytree(full_run, run_dir)
  saved_config = (run_dir / "config.yaml").read_text()
  capsys.readouterr()
  argv = ["--no-progress", "--run-dir", str(run_dir), f"train.steps={STEPS + 2}", *SMALL,
          "optimizer.name=muon"]
  assert train.main(argv) == 2
  err = capsys.readouterr().err
  assert f"checkpoint {run_dir / 'checkpoints' / '6'} holds a training state laid out" in err
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "4", "6"]
  assert losses_by_step(run_dir) == losses_by_step(full_run)
  assert (run_dir / "config.yaml").read_text() == saved_config  # the refused settings not kept


def xor_middle_of_largest_file(directory):
  """XORs 64 bytes in the middle of the largest file under ``directory`` (random nonzero mask)."""
  path = max((os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs),
             key=os.path.getsize)
  with open(path, "r+b") as f:
    middle = f.seek(0, os.SEEK_END) // 2 - 32
    f.seek(middle)
    chunk = f.read(64)
    mask = np.random.default_rng().integers(1, 256, 64, dtype=np.uint8)
    f.seek(middle)
    f.write(bytes(b ^ int(m) for b, m in zip(chunk, mask)))


@pytest.mark.slow
def test_a_bit_flipped_checkpoint_is_named_and_the_run_resumes_from_the_previous_one(
    full_run, tmp_path, capsys):
  """The issue's experiment: 64 bytes XOR-ed in the middle of the newest checkpoint's largest data
  file. The resume names the checkpoint (and the arrays whose checksums fail, where the bytes
  still decode), and goes on from the previous checkpoint to the same losses as the
  uninterrupted run."""
  run_dir = tmp_path / "flipped"
  shutil.copytree(full_run, run_dir)
  ckpts = run_dir / "checkpoints"
  xor_middle_of_largest_file(ckpts / "6")
  capsys.readouterr()
  assert train.main(["--no-progress", "--run-dir", str(run_dir), f"train.steps={STEPS}", *SMALL,
                     "train.eval_every=3", "train.eval_batches=1"]) == 0
  out = capsys.readouterr()
  # Where the flipped bytes land decides which check catches them: the checksums, or the
  # store's own decoding (a compressed chunk's header); either names the checkpoint.
  assert (f"checkpoint {ckpts / '6'} does not match its checksums in " in out.err
          or f"checkpoint {ckpts / '6'} is corrupt or unreadable (" in out.err), out.err
  assert "resumed from step 4" in out.out
  assert (ckpts / "6.corrupt").is_dir()
  assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4, 6]
  assert losses_by_step(run_dir) == losses_by_step(full_run)


@pytest.mark.slow
def test_a_data_change_on_resume_is_refused_unless_the_iterator_is_reset(full_run, tmp_path,
                                                                          capsys):
  run_dir = tmp_path / "datachange"
  shutil.copytree(full_run, run_dir)
  saved_config = (run_dir / "config.yaml").read_text()
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng()
  for i in range(4):
    (corpus / f"d{i}.txt").write_text(" ".join(rng.choice(["a", "bc", "def"], 200)))
  argv = ["--no-progress", "--run-dir", str(run_dir), f"train.steps={STEPS + 1}", *SMALL,
          f"data.source={corpus}", "train.eval_every=0"]
  capsys.readouterr()
  assert train.main(argv) == 2
  err = capsys.readouterr().err
  assert "data.source: 'stdlib' -> " in err and "data.reset_iterator=true" in err
  assert (run_dir / "config.yaml").read_text() == saved_config
  assert train.main([*argv, "data.reset_iterator=true"]) == 0
  out = capsys.readouterr().out
  assert "resumed from step 6" in out and "the data starts from its beginning" in out
  assert str(corpus) in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_a_run_whose_state_turns_non_finite_stops_without_saving_it(tmp_path, capsys,
                                                                    monkeypatch):
  """Parameters that turn infinite after step 3 (the update of a corrupted optimizer state, say):
  the save of step 3 is refused, the run stops with status 2, and keep-last-2 still holds the
  finite checkpoints of steps 1 and 2."""
  real = train_step.apply_step

  def poisoned(executable, state, step, batch):
    state, out = real(executable, state, step, batch)
    if step == 2:
      leaves, tree = jax.tree.flatten(state.params)
      where = tuple(int(i) for i in np.random.default_rng().integers(0, leaves[0].shape))
      leaves[0] = leaves[0].at[where].set(np.inf)
      state = state.replace(params=jax.tree.unflatten(tree, leaves))
    return state, out

  monkeypatch.setattr(train_step, "apply_step", poisoned)
  run_dir = tmp_path / "inf"
  rc = train.main(["--no-progress", "--run-dir", str(run_dir), "train.steps=5", *SMALL,
                   "checkpoint.every=1", "checkpoint.keep=2", "train.max_nonfinite=10"])
  assert rc == 2
  assert "the training state at step 3 holds non-finite values in params." in \
      capsys.readouterr().err
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]


@pytest.mark.parametrize("where", ["run_dir", "checkpoints"])
def test_an_unwritable_run_dir_is_one_clear_error_before_any_work(tmp_path, capsys, monkeypatch,
                                                                 where):
  """A run directory below a regular file, or a ``checkpoints`` that is a file: refused at once
  whatever the user's rights (root writes through permission bits)."""
  (tmp_path / "file").write_text("not a directory")
  run_dir = tmp_path / "file" / "run" if where == "run_dir" else tmp_path / "run"
  if where == "checkpoints":
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory")
  monkeypatch.setattr(train_step, "compile_train_step", None)  # never reached
  assert train.main(["--no-progress", "--run-dir", str(run_dir), "train.steps=2", *SMALL]) == 2
  bad = run_dir if where == "run_dir" else run_dir / "checkpoints"
  assert f"cannot write to {bad}:" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to a read-only directory")
def test_a_read_only_run_dir_is_one_clear_error(tmp_path, capsys):
  run_dir = tmp_path / "ro"
  run_dir.mkdir()
  run_dir.chmod(0o555)
  try:
    assert train.main(["--no-progress", "--run-dir", str(run_dir), "train.steps=2", *SMALL]) == 2
  finally:
    run_dir.chmod(0o755)
  assert f"cannot write to {run_dir}" in capsys.readouterr().err


def test_out_of_memory_gives_a_clear_error(tmp_path, monkeypatch, capsys):
  def oom(*args, **kw):
    def step(*args):
      raise jax.errors.JaxRuntimeError(
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 110.64GiB.\nmore detail")
    return step, train_step.CompileReport(0.0, 0.0, 0.0)

  monkeypatch.setattr(train_step, "compile_train_step", oom)
  argv = ["--no-progress", "--run-dir", str(tmp_path / "oom"), "train.steps=2", *SMALL]
  assert train.main(argv) == 2
  err = capsys.readouterr().err
  assert "ran out of device memory at step 1 (2 x 64 tokens" in err
  assert "Out of memory while trying to allocate 110.64GiB." in err and "more detail" not in err
  assert "model.remat=full" in err and "model.remat_skip=0," in err
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in err and "python -m k3jax.plan" in err


@pytest.mark.slow
def test_sigterm_saves_a_loadable_checkpoint(tmp_path, root):
  run_dir = tmp_path / "sigterm"
  proc = subprocess.Popen(
      [sys.executable, str(root / "train.py"), "--no-progress", "--run-dir", str(run_dir),
       *SMALL, "train.steps=100000", "checkpoint.every=100000"],
      cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  log = run_dir / "metrics.jsonl"
  try:
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
      if log.exists() and any("loss" in r for r in metrics.read_jsonl(log)):
        break
      time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
  finally:
    proc.kill()  # a run that outlives the test would slow every later one (no-op once it ended)
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert "SIGTERM: saved checkpoint at step" in out
  steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
  assert len(steps) == 1 and steps[0] >= 1
  # Loadable: the same tree restores, and the data iterator comes back.
  from k3jax import config as config_lib, data as data_lib
  cfg = config_lib.load(root / "configs" / "k3_tiny.yaml", [*SMALL])
  abstract = train_state.abstract_train_state(cfg, sharding.make_mesh(cfg.mesh))
  state = {"params": abstract.params, "opt_state": abstract.opt_state, "biases": abstract.biases,
           "rng": abstract.rng}  # the checkpoint's tree, as every earlier run saved it
  d = data_lib.Data(cfg)
  ckpt = checkpoint.Checkpointer(run_dir / "checkpoints")
  step, restored, meta, _ = ckpt.restore_latest(state, lambda s: iter(d.dataset("train", 64)))
  ckpt.close()
  assert step == steps[0] == meta["step"]
  assert jax.tree.structure(restored) == jax.tree.structure(state)


def test_nonfinite_steps_stop_the_run(tmp_path, capsys):
  rc = train.main(["--no-progress", "--run-dir", str(tmp_path / "nan"), "train.steps=6",
                   "train.max_nonfinite=2", "model.init_std=1.0e+30", *SMALL])
  assert rc == 2
  out = capsys.readouterr()
  assert "non-finite loss or gradient, update skipped (1 in a row)" in out.out
  assert "2 non-finite steps in a row (train.max_nonfinite=2)" in out.err


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/nope.yaml"], "config file 'configs/nope.yaml' does not exist"),
    (["train.stepz=3"], "unknown config key 'train.stepz'"),
    (["train.batch_size=0"], "train.batch_size: must be positive"),
    (["data.source=/nonexistent/dir/*.jsonl"], "data.source: no data files found"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer: '/nonexistent/tokenizer.json'"),
])
def test_bad_config_or_data_gives_a_clear_error(argv, message, tmp_path, capsys, root,
                                                monkeypatch):
  monkeypatch.chdir(root)
  assert train.main(["--run-dir", str(tmp_path / "bad"), *argv]) == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("overrides, devices, message", [
    (["mesh.fsdp=8"], 8, "train.batch_size=4: the mesh"),  # k3_tiny's 4 rows on 8 devices
    (["train.batch_size=6", "mesh.expert=4", "mesh.data=2"], 8, "use a multiple of 8"),
    (["mesh.context=2", "mesh.data=1", "data.seq_len=127"], 2, "data.seq_len=127"),
    (["mesh.context=4", "train.stages=[{seq_len: 64, steps: 2}, {seq_len: 66, steps: 2}]"], 4,
     "train.stages[1].seq_len=66"),
])
def test_a_batch_the_mesh_does_not_divide_is_a_config_error(overrides, devices, message):
  from conftest import tiny_config
  from k3jax.config import ConfigError
  cfg = tiny_config(*overrides)
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
    train.check_layout(cfg, devices)
  train.check_layout(tiny_config(*overrides, "train.batch_size=8", "data.seq_len=128",
                                 "train.stages=[]"), devices)  # fits


def test_metrics_jsonl_and_tensorboard(tmp_path, monkeypatch):
  scalars = []

  class Writer:  # stands in for tensorboardX.SummaryWriter
    def __init__(self, log_dir):
      self.log_dir = log_dir

    def add_scalar(self, tag, value, step):
      scalars.append((tag, value, step))

    def flush(self):
      pass

    def close(self):
      pass

  monkeypatch.setitem(sys.modules, "tensorboardX", type(sys)("tensorboardX"))
  sys.modules["tensorboardX"].SummaryWriter = Writer
  m = metrics.Metrics(tmp_path, total_steps=3, start_step=0, progress=False)
  m.write({"step": 1, "loss": np.float32(2.5), "mfu": None, "grad_norm": float("nan"),
           "moe_load_max_mean": np.array([1.5, 2.0])})
  m.close()
  assert metrics.read_jsonl(tmp_path / "metrics.jsonl") == [
      {"step": 1, "loss": 2.5, "mfu": None, "grad_norm": None, "moe_load_max_mean": [1.5, 2.0]}]
  assert scalars == [("loss", 2.5, 1), ("moe_load_max_mean/0", 1.5, 1),
                     ("moe_load_max_mean/1", 2.0, 1)]


def test_stages_switch_packing_length(root):
  from k3jax import config as config_lib, data as data_lib
  cfg = config_lib.load(root / "configs" / "k3_tiny.yaml", [
      "train.steps=10", "train.stages=[{seq_len: 32, steps: 3}, {seq_len: 64, steps: 4}]"])
  got = [(s.start, s.end, s.seq_len) for s in data_lib.stages(cfg)]
  assert got == [(0, 3, 32), (3, 10, 64)]
  assert data_lib.stage_at(data_lib.stages(cfg), 2).seq_len == 32
  assert data_lib.stage_at(data_lib.stages(cfg), 3).seq_len == 64


@pytest.mark.slow
def test_the_step_compiles_once_per_stage(tmp_path, monkeypatch, capsys):
  """Each stage's step is compiled ahead of time once, before its first step; its compile time
  goes to metrics.jsonl with that step, and tokens/s leaves the compile out."""
  real, compiles = train_step.compile_train_step, []

  def counted(*args, **kw):
    compiles.append(args[-1]["input_ids"].shape)
    return real(*args, **kw)

  monkeypatch.setattr(train_step, "compile_train_step", counted)
  run_dir = tmp_path / "stages"
  assert train.main(["--no-progress", "--run-dir", str(run_dir), "train.steps=5", *SMALL,
                     "checkpoint.every=10",
                     "train.stages=[{seq_len: 32, steps: 2}, {seq_len: 64, steps: 3}]"]) == 0
  assert compiles == [(2, 32), (2, 64)]
  steps = [r for r in metrics.read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in steps if "compile_s" in r] == [1, 3]
  assert all(r["compile_s"] > 0 for r in steps if "compile_s" in r)
  assert [r["seq_len"] for r in steps] == [32, 32, 64, 64, 64]
  assert all(r["tokens_per_s"] > 0 for r in steps)
  out = capsys.readouterr().out
  assert "compiled the step for 2 x 32 tokens: trace" in out
  assert "stage 1: seq_len 64 from step 2" in out


@pytest.mark.slow
@pytest.mark.parametrize("env, want", [(None, "0.92"), ("0.5", "0.5")])
def test_train_lets_jax_use_most_of_the_gpu(root, env, want):
  """train.py sets JAX's GPU memory fraction to 0.92 unless the environment sets it."""
  environ = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
  if env is not None:
    environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = env
  out = subprocess.run([sys.executable, "-c", "import os; from k3jax import train; "
                        "train.main(['--config', 'missing.yaml']); "
                        "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"],
                       cwd=root, env=environ, capture_output=True, text=True, check=True).stdout
  assert out.split() == [want]
