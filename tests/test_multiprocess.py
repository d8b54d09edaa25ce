"""The multi-process path of train.py (issue 41 item 5): two local CPU processes joined by
``jax.distributed.initialize`` (driven by ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID``, as on a pod's hosts) train on pre-tokenised shards, each reading its own,
checkpoint together and resume together."""

import json
import os
import shlex
import socket
import subprocess
import sys

import jax
import pytest

import sharding
from k3jax import metrics, pretokenize
from test_data import random_texts
from test_train import SMALL

PROCESSES = 2


@pytest.mark.parametrize("env, calls", [
    ({}, []),
    ({"K3JAX_DISTRIBUTED": "1"}, [{}]),  # JAX detects the cluster (a Cloud TPU slice)
    ({"K3JAX_DISTRIBUTED": "0", "SLURM_NTASKS": "4"}, []),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
     [{"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}]),
])
def test_the_environment_decides_whether_and_how_jax_distributed_starts(monkeypatch, env, calls):
  for k in ("K3JAX_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS",
            "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
    monkeypatch.delenv(k, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  seen = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw))
  assert sharding.mesh.initialize_distributed() == bool(calls)
  assert seen == calls


def launch(root, run_dir, steps: int, data_dir) -> list[str]:
  """Runs train.py as PROCESSES processes of one job; returns each one's output."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(PROCESSES):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": str(PROCESSES), "JAX_PROCESS_ID": str(i)}
    procs.append(subprocess.Popen(
        [sys.executable, str(root / "train.py"), "--no-progress", "--run-dir", str(run_dir),
         f"train.steps={steps}", f"data.source={data_dir}", "data.eval_fraction=0", *SMALL],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root))
  try:
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()  # no-op once it ended
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  return outs


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  d = tmp_path_factory.mktemp("corpus")
  (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in random_texts(40)))
  pretokenize.pretokenize(str(d / "c.jsonl"), d / "tok", shards=PROCESSES)
  return d / "tok"


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(root, tmp_path, shards):
  run = tmp_path / "run"
  first = launch(root, run, 2, shards)
  assert "step      2" in first[0] and "step      2" not in first[1]  # process 0 reports
  data_states = sorted(p.name for p in (run / "checkpoints" / "2" / "data").iterdir()
                       if p.suffix == ".json")
  assert data_states == [f"process_{i}-of-{PROCESSES}.json" for i in range(PROCESSES)]
  second = launch(root, run, 3, shards)
  assert "resumed from step 2" in second[0]
  records = [r for r in metrics.read_jsonl(run / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in records] == [1, 2, 3]
  assert all(r["nonfinite"] == 0 for r in records)
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "3"]


def test_the_pod_launcher_runs_one_command_on_every_host(root):
  """scripts/launch_tpu_pod.sh --print: the gcloud command it would run, the remote line quoted."""
  script = str(root / "scripts" / "launch_tpu_pod.sh")
  out = subprocess.run(
      [script, "--tpu", "k3-v5p", "--zone", "us-east5-a", "--project", "p", "--env", "A=x y",
       "--print", "--", "python", "train.py", "--run-dir", "gs://b/run", "data.source=gs://b/tok"],
      capture_output=True, text=True, check=True).stdout
  argv = shlex.split(out)
  assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "k3-v5p"]
  assert "--worker=all" in argv and argv[argv.index("--project") + 1] == "p"
  remote = shlex.split(argv[argv.index("--command") + 1])
  assert remote == ["cd", "$HOME/k3jax", "&&", "env", "K3JAX_DISTRIBUTED=1", "A=x y", "python",
                    "train.py", "--run-dir", "gs://b/run", "data.source=gs://b/tok"]
  bad = subprocess.run([script, "--zone", "z", "--", "true"], capture_output=True, text=True)
  assert bad.returncode == 2 and "--tpu is required" in bad.stderr


def test_a_resume_on_another_number_of_processes_keeps_no_data_position():
  """Each process saves its own iterator position: on another number of processes they mean
  nothing, so the resume is refused, or starts the data afresh with data.reset_iterator."""
  from conftest import tiny_config
  from k3jax import train
  cfg = tiny_config()
  meta = {"data": {**train.data_settings(cfg), "processes": 2}}
  with pytest.raises(train.TrainError, match="processes: 2 -> 1"):
    train.keep_data_position(cfg)(meta)
  assert train.keep_data_position(tiny_config("data.reset_iterator=true"))(meta) is False
  assert train.keep_data_position(cfg)({"data": train.data_settings(cfg)}) is True
