"""From training to use, end to end on CPU from a clean working directory with relative paths:
a train.py run loaded by from_pretrained, converted to HF and back, decoded by the generate
command line from each form, and used as train.init_from (issue 43 items 1 and 2)."""

import importlib
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax
from k3jax import cli, convert, run_dir, train, train_state
from k3jax.convert import cli as convert_cli
from test_train import SMALL

# the module (k3jax.generate is the function)
generate_cli = importlib.import_module("k3jax.generate")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
  """A clean directory (not the repository) holding ``run`` (a 3-step train.py run with
  checkpoints at steps 2 and 3), its HF conversion ``hf`` and that converted back, ``orb``."""
  cwd = tmp_path_factory.mktemp("use")
  with pytest.MonkeyPatch.context() as mp:
    mp.chdir(cwd)
    assert train.main(["--no-progress", "train.steps=3", "--run-dir", "run", *SMALL]) == 0
    assert convert_cli.main(["orbax-to-hf", "--no-progress", "--src", "run", "--dst", "hf"]) == 0
    assert convert_cli.main(["hf-to-orbax", "--src", "hf", "--dst", "orb", "--no-progress"]) == 0
    yield cwd


def logits(model, tokens):
  return np.asarray(model(jnp.asarray(tokens)))


def test_run_dir_loads_latest_or_named_checkpoint(work, monkeypatch):
  monkeypatch.chdir(work)
  tokens = np.random.default_rng().integers(3, 256, (2, 12))
  latest = logits(k3jax.from_pretrained("run"), tokens)
  np.testing.assert_array_equal(latest, logits(k3jax.from_pretrained("run/checkpoints/3"), tokens))
  assert not np.allclose(latest, logits(k3jax.from_pretrained("run/checkpoints/2"), tokens))
  # the run's HF conversion (routed experts in MXFP4, as K3 is released) and its way back
  hf = logits(k3jax.from_pretrained("hf"), tokens)
  np.testing.assert_allclose(hf, latest, atol=0.05)
  np.testing.assert_allclose(logits(k3jax.from_pretrained("orb"), tokens), hf, rtol=1e-6, atol=1e-6)


def test_run_dir_weights_are_checked_against_their_checksums(work, monkeypatch):
  """Loading a run's weights checks them against the fingerprints saved with the checkpoint: a
  changed array is named, nothing is loaded silently."""
  monkeypatch.chdir(work)
  shutil.copytree("run", "tampered")
  meta = work / "tampered/checkpoints/3/meta/metadata"
  saved = json.loads(meta.read_text())
  name = next(k for k in sorted(saved["checksums"]) if k.startswith("params."))
  saved["checksums"][name][0] ^= 1  # as if one bit of that array had flipped on disk
  meta.write_text(json.dumps(saved))
  with pytest.raises(run_dir.RunDirError, match=rf"{name}: does not match its checksum"):
    k3jax.from_pretrained("tampered")
  k3jax.from_pretrained("tampered/checkpoints/2")  # the older checkpoint is intact


def test_generate_cli_from_each_form(work, monkeypatch, capsys):
  monkeypatch.chdir(work)
  outs = []
  for d in ("run", "hf", "orb"):
    capsys.readouterr()
    assert generate_cli.main(["--checkpoint", d, "--prompt", "def f(", "--max-new-tokens", "4",
                          "model.kda.implementation=naive"]) == 0
    outs.append(capsys.readouterr().out)
  assert all(o.startswith("def f(") and len(o) > len("def f(\n") for o in outs)
  assert outs[1] == outs[2]  # the same weights (the run's in MXFP4 experts) give the same text
  assert generate_cli.main(["--checkpoint", "run", "--top-p", "0"]) == 2
  assert "top_p must lie in (0, 1]" in "".join(capsys.readouterr())


def test_serve_and_generate_load_a_checkpoint_with_the_config_serve_keys(work, monkeypatch):
  """``load_model`` (serve.py, generate): the checkpoint's weights and model config with its
  ``model.*`` overrides, the other overrides on ``--config``, the run's tokenizer."""
  monkeypatch.chdir(work)
  cfg, model, tok = generate_cli.load_model(
      "k3_tiny", ["serve.max_batch=2", "model.kda.implementation=naive"], checkpoint="run")
  assert cfg.serve.max_batch == 2 and cfg.model is model.cfg
  assert model.cfg.kda.implementation == "naive"
  assert model.cfg == k3jax.from_pretrained("run", overrides=["model.kda.implementation=naive"]).cfg
  assert tok.vocab_size == 256  # the run's data.tokenizer: bytes


def test_init_from_loads_weights_into_a_fresh_state(work, monkeypatch):
  monkeypatch.chdir(work)
  for src in ("run", "hf", "orb"):
    model = k3jax.from_pretrained(src)
    cfg = cli.load("k3_tiny", [*SMALL, f"train.init_from={src}"])
    state = train.init_weights(cfg, train_state.init_train_state(cfg))
    got = dict(nnx.to_flat_state(nnx.state(nnx.merge(state.graphdef, state.params, state.biases))))
    for path, var in nnx.to_flat_state(nnx.state(model)):
      np.testing.assert_allclose(np.asarray(got[path].get_value()), np.asarray(var.get_value()),
                                 rtol=1e-6, err_msg=str(path))
  cfg = cli.load("k3_tiny", [*SMALL, "model.hidden_size=32", "train.init_from=run"])
  with pytest.raises(convert.ConversionError, match=r"embed_tokens.embedding: checkpoint shape \[320, 64\], config \[320, 32\]"):
    train.init_weights(cfg, train_state.init_train_state(cfg))


def test_init_from_trains_and_resume_wins(work, monkeypatch, capsys):
  monkeypatch.chdir(work)
  assert train.main(["train.init_from=hf", "--no-progress", "--run-dir", "ft", "train.steps=1",
                     *SMALL]) == 0
  assert "initialised the weights from hf (fresh optimizer, step 0)" in "".join(capsys.readouterr())
  assert train.main(["--run-dir", "run", "train.steps=3", "train.init_from=hf", *SMALL,
                     "--no-progress"]) == 0
  assert "train.init_from=hf is not used: the run's own checkpoint wins" in "".join(capsys.readouterr())
  assert train.main(["--run-dir", "x", "train.init_from=missing", *SMALL]) == 2
  assert "train.init_from: missing is not a directory" in "".join(capsys.readouterr())
