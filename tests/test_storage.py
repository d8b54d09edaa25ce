"""Remote storage and relative paths (issue 41 item 4): a train.py run whose run directory is a
``gs://`` URL (a local fake, tests/fake_gcs.py), resumed from there, loaded by from_pretrained,
converted to HF and back on the bucket; data globs on the bucket; atomic conversions to the
bucket; relative local paths through the Python API."""

import contextlib
import importlib.util
import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fake_gcs import fake_gcs
from k3jax import checkpoint, config, data, from_pretrained, metrics, report, storage, train
from k3jax.convert import ConversionError, hf_to_orbax, orbax_to_hf
from k3jax.convert import cli as convert_cli
from k3jax.convert import output
from test_convert import GOLDEN
from test_train import SMALL


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
  """``gs://`` on a local directory for the whole module."""
  with pytest.MonkeyPatch.context() as mp, fake_gcs(tmp_path_factory.mktemp("gcs"), mp) as root:
    yield root


def logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens)))


@pytest.fixture(scope="module")
def remote_run(bucket, tmp_path_factory):
  """A 2-step run into gs://bkt/run, resumed to step 3 (a checkpoint at steps 2 and 3)."""
  run, out = "gs://bkt/run", io.StringIO()
  assert train.main(["--no-progress", "train.steps=2", "--run-dir", run, *SMALL]) == 0
  with contextlib.redirect_stdout(out):
    assert train.main(["--no-progress", "train.steps=3", "--run-dir", run, *SMALL]) == 0
  assert "resumed from step 2 (gs://bkt/run/checkpoints/2)" in out.getvalue()
  return run


@pytest.mark.slow
def test_a_run_on_the_bucket_saves_resumes_and_loads(remote_run, bucket):
  ckpts = bucket / "bkt" / "run" / "checkpoints"
  assert sorted(p.name for p in ckpts.iterdir()) == ["2", "3"]
  # committed as on GCS: a marker, no temporary names
  assert all((ckpts / s / "commit_success.txt").is_file() for s in ("2", "3"))
  steps = [r["step"] for r in metrics.read_jsonl(f"{remote_run}/metrics.jsonl") if "loss" in r]
  assert steps == [1, 2, 3]
  assert config.load(f"{remote_run}/config.yaml").train.steps == 3
  assert str(report.plot(remote_run)) == f"{remote_run}/report.png"
  assert (bucket / "bkt" / "run" / "report.png").read_bytes().startswith(b"\x89PNG")
  tokens = np.random.default_rng().integers(3, 256, (2, 9))
  latest, step2 = from_pretrained(remote_run), from_pretrained(f"{remote_run}/checkpoints/2")
  assert not np.allclose(logits(latest, tokens), logits(step2, tokens))


@pytest.mark.slow
def test_conversion_to_and_from_the_bucket_round_trips(remote_run, bucket):
  tokens = np.random.default_rng().integers(3, 256, (2, 9))
  want = logits(from_pretrained(remote_run), tokens)
  assert convert_cli.main(["orbax-to-hf", "--no-progress", "--src", remote_run,
                           "--dst", "gs://bkt/hf"]) == 0
  assert convert_cli.main(["hf-to-orbax", "--no-progress", "--src", "gs://bkt/hf",
                           "--dst", "gs://bkt/orb"]) == 0
  hf = logits(from_pretrained("gs://bkt/hf"), tokens)  # routed experts in MXFP4, as K3 ships
  np.testing.assert_allclose(hf, want, atol=0.05)
  np.testing.assert_allclose(logits(from_pretrained("gs://bkt/orb"), tokens), hf, rtol=1e-6,
                             atol=1e-6)
  assert not [p.name for p in (bucket / "bkt").iterdir() if ".tmp-" in p.name]


def test_a_failed_conversion_to_the_bucket_leaves_nothing(bucket, monkeypatch):
  def fail(self, *a, **kw):
    raise OSError("disk full")
  monkeypatch.setattr("k3jax.convert.safetensors_io.SafetensorsWriter.close", fail)
  with pytest.raises(OSError, match="disk full"):
    orbax_to_hf(_golden_orbax(bucket), "gs://bkt/failed", progress=False)
  assert not (bucket / "bkt" / "failed").exists()
  assert not [p for p in (bucket / "bkt").iterdir() if p.name.startswith(".failed.tmp-")]


def test_a_copy_cut_short_on_the_bucket_leaves_no_valid_directory(bucket, monkeypatch):
  """Publishing copies the staged objects; the one that makes a directory valid goes last, and a
  copy that fails removes the part already copied."""
  copied = []
  real = storage._fs

  class Failing:
    def __init__(self, fs):
      self.fs = fs

    def __getattr__(self, name):
      return getattr(self.fs, name)

    def copy(self, a, b):
      copied.append(b.rsplit("/", 1)[-1])
      if copied[-1] == "config.json":  # the last one: the others are in place, it is not
        assert (bucket / "bkt" / "cut" / "model.safetensors").is_file()
        raise OSError("connection reset")
      self.fs.copy(a, b)

  monkeypatch.setattr(storage, "_fs", lambda p: Failing(real(p)))
  with pytest.raises(OSError, match="connection reset"):
    orbax_to_hf(_golden_orbax(bucket), "gs://bkt/cut", progress=False)
  assert not (bucket / "bkt" / "cut").exists() and copied[-1] == "config.json" and len(copied) > 1
  monkeypatch.setattr(storage, "_fs", real)
  copied.clear()
  orbax_to_hf(_golden_orbax(bucket), "gs://bkt/whole", progress=False)
  assert from_pretrained("gs://bkt/whole").cfg.arch == "kimi_linear"


def _golden_orbax(bucket) -> str:
  """The golden Kimi Linear checkpoint converted onto the bucket (once)."""
  dst = "gs://bkt/golden_orbax"
  if not (bucket / "bkt" / "golden_orbax").exists():
    hf_to_orbax(GOLDEN, dst, progress=False)
  return dst


def test_data_on_the_bucket_reads_what_the_local_files_hold(bucket, tmp_path):
  """JSONL (a recursive glob), Parquet and text directories read the same documents under the
  same keys from the bucket as from local files."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rng = np.random.default_rng()
  texts = ["".join(map(chr, rng.integers(97, 123, rng.integers(1, 40)))) for _ in range(10)]
  local = tmp_path / "corpus"
  for d in ("j/sub", "p", "t"):
    (local / d).mkdir(parents=True)
  (local / "j" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:4]))
  (local / "j" / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                       for t in texts[4:]))
  pq.write_table(pa.table({"text": texts}), local / "p" / "a.parquet", row_group_size=3)
  for i, t in enumerate(texts):
    (local / "t" / f"{i}.txt").write_text(t)
  shutil.copytree(local, bucket / "bkt" / "corpus")
  for pattern in ("{}/j/**/*.jsonl", "{}/p", "{}/t", "{}/t/*.txt"):
    here = data.open_source(pattern.format(local))
    there = data.open_source(pattern.format("gs://bkt/corpus"))
    assert there.keys == here.keys and len(here) == len(texts)
    assert [there[i] for i in range(len(there))] == [here[i] for i in range(len(here))]


def test_unknown_schemes_and_non_gcs_checkpoints_are_one_clear_error(capsys):
  with pytest.raises(storage.StorageError, match="unknown scheme ftp://"):
    storage.path("ftp://host/x")
  with pytest.raises(storage.StorageError, match="through tensorstore"):
    storage.checkpoint_path("hf://org/model")
  if importlib.util.find_spec("s3fs") is None:
    with pytest.raises(storage.StorageError, match=r"s3:// needs the package s3fs"):
      storage.path("s3://bucket/corpus")
  assert train.main(["--no-progress", "--run-dir", "ftp://host/run", *SMALL]) == 2
  assert "unknown scheme ftp://" in capsys.readouterr().err


@pytest.mark.slow
def test_relative_paths_resolve_from_the_working_directory(tmp_path, monkeypatch):
  """hf_to_orbax, orbax_to_hf and from_pretrained with paths relative to the working directory."""
  monkeypatch.chdir(tmp_path)
  shutil.copytree(GOLDEN, "hf")
  hf_to_orbax("hf", "kl_orbax", progress=False)
  orbax_to_hf("kl_orbax", "back", progress=False)
  weights = [jax.tree.leaves(nnx.state(from_pretrained(d))) for d in ("kl_orbax", "./back")]
  for a, b in zip(*weights):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert storage.path("x/../y") == tmp_path / "y"


def test_checkpoints_on_the_bucket_skip_a_cut_off_save_and_set_aside_a_corrupt_one(
    bucket, capsys):
  """A preempted save leaves a step without its commit marker (reported, skipped, and saved over
  later); a bit-flipped one is renamed to ``<step>.corrupt`` in the bucket."""
  from test_integrity import abstract, data_iter, random_state, xor_middle
  ckpt = checkpoint.Checkpointer("gs://bkt/ck", async_save=False)
  states = {1: random_state(1), 2: random_state(2)}
  for step, state in states.items():
    ckpt.save(step, state, data_iter(), {"step": step})
  ckpt.close()
  local = bucket / "bkt" / "ck"
  shutil.copytree(local / "2", local / "3")
  (local / "3" / "commit_success.txt").unlink()  # as if cut off before its marker
  state_files = [p for p in (local / "2" / "state").rglob("*") if p.is_file()]
  xor_middle(max(state_files, key=lambda p: p.stat().st_size))
  ckpt = checkpoint.Checkpointer("gs://bkt/ck", async_save=False)
  step, state, _, _ = ckpt.restore_latest(abstract(states[1]), lambda s: data_iter())
  err = capsys.readouterr().err
  assert step == 1 and "skipping incomplete checkpoint gs://bkt/ck/3" in err
  assert "checkpoint gs://bkt/ck/2 does not match its checksums" in err
  assert sorted(p.name for p in local.iterdir()) == ["1", "2.corrupt", "3"]
  assert ckpt.save(3, states[2], data_iter(), {"step": 3}, wait=True)
  ckpt.close()
  assert (local / "3" / "commit_success.txt").is_file() and ckpt.steps() == [1, 3]
