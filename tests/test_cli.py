"""The shared command-line front (issue 43 item 4): configs by name from any directory, the
positional form where it exists, key=value overrides before or after the options."""

import importlib

import pytest

from k3jax import cli, info, plan, train
from k3jax.config import ConfigError


def test_packaged_config_by_name_from_any_directory(tmp_path, monkeypatch, root):
  monkeypatch.chdir(tmp_path)
  for name in ("k3_tiny", "k3_tiny.yaml"):
    assert cli.resolve_config(name).samefile(root / "configs" / "k3_tiny.yaml")
  (tmp_path / "k3_tiny.yaml").write_text("model: {name: mine}\n")  # a path comes first
  assert cli.resolve_config("k3_tiny").samefile(tmp_path / "k3_tiny.yaml")
  with pytest.raises(ConfigError, match=r"'nope' is neither a file nor a packaged config \(packaged: .*k3_tiny"):
    cli.resolve_config("nope")


@pytest.mark.parametrize("argv", [
    ["train.steps=3", "--run-dir", "D", "mesh.data=1"],
    ["--run-dir", "D", "train.steps=3", "mesh.data=1", "--config", "k3_tiny"],
    ["train.steps=3", "mesh.data=1", "--no-progress", "--run-dir=D"],
])
def test_train_overrides_before_or_after_options(argv, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  args = train.parse_args(argv)
  assert (args.config, args.run_dir, args.overrides) == ("k3_tiny", "D", ["train.steps=3", "mesh.data=1"])
  assert cli.load(args.config, args.overrides).train.steps == 3


def test_positional_or_flag_config_and_clear_errors(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  for argv in (["model.num_layers=5", "k3_tiny"], ["--config", "k3_tiny", "model.num_layers=5"],
               ["k3_tiny", "model.num_layers=5"]):
    assert info.main(argv) == 0
    assert '"config": "k3_tiny"' in capsys.readouterr().out
  assert plan.main(["model.num_layers=5", "--mesh", "data=1", "k3_tiny", "--seq-len", "64"]) == 0
  for argv, message in ((["k3", "--config", "k3_tiny"], "more than one config given"),
                        ([], "a config is required"),
                        (["k3_tiny", "oops"], "more than one config given")):
    with pytest.raises(SystemExit):
      info.main(argv)
    assert message in capsys.readouterr().err
  with pytest.raises(SystemExit):
    train.parse_args(["--run-dir", "D", "stray"])
  assert "unrecognized arguments: stray (overrides are key=value)" in capsys.readouterr().err
  assert info.main(["nope"]) == 2


@pytest.mark.slow
def test_generate_and_convert_take_config_by_name(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  gen = importlib.import_module("k3jax.generate")
  assert gen.main(["model.num_layers=2", "model.mla_layers=[1]", "--max-new-tokens", "2",
                   "--config", "k3_tiny", "--prompt", "ab", "model.kda.implementation=naive"]) == 0
  assert capsys.readouterr().out.startswith("ab")
  from k3jax.convert import cli as convert_cli
  assert convert_cli.main(["orbax-to-hf", "--src", "x", "--dst", "y", "--config", "nope"]) == 2
  assert "'nope' is neither a file nor a packaged config" in capsys.readouterr().err


def test_compile_cache_default_and_respected(tmp_path, monkeypatch):
  """train.py and serve.py keep compiled steps in ``$K3JAX_CACHE/jax`` unless JAX's cache
  directory is set already, which they leave alone."""
  import jax
  before = jax.config.jax_compilation_cache_dir
  monkeypatch.setenv("K3JAX_CACHE", str(tmp_path / "k3"))
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    cli.use_compile_cache()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "k3" / "jax")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    cli.use_compile_cache()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
  finally:
    jax.config.update("jax_compilation_cache_dir", before)


def test_training_xla_flags_add_the_default_and_keep_the_users():
  """train.py turns XLA's Triton GEMM fusions off unless XLA_FLAGS already says either way; the
  user's other flags stay."""
  assert cli.training_xla_flags("") == "--xla_gpu_enable_triton_gemm=false"
  assert (cli.training_xla_flags("--xla_dump_to=/tmp/d")
          == "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=false")
  mine = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d"
  assert cli.training_xla_flags(mine) == mine
