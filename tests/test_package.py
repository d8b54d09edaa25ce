"""The package as ``pip install k3jax`` gives it: a wheel built from this tree, installed with
``--no-deps`` into a fresh venv that borrows its dependencies from the project's venv, used from an
empty directory (nothing of the checkout on the path)."""

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from test_train import SMALL

pytestmark = pytest.mark.slow  # builds a wheel, makes a venv, trains in a subprocess

SCRIPTS = ("k3jax-train", "k3jax-convert", "k3jax-generate", "k3jax-serve")


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, root) -> Path:
  """The ``bin`` directory of a venv holding only the built wheel."""
  tmp = tmp_path_factory.mktemp("package")
  src = tmp / "src"  # a copy, so that the build leaves nothing in the checkout
  src.mkdir()
  shutil.copy(root / "pyproject.toml", src)
  for d in ("k3jax", "pallas_kernels", "sharding", "configs"):
    shutil.copytree(root / d, src / d, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", tmp / "dist", src], check=True)
  (wheel,) = (tmp / "dist").glob("k3jax-*.whl")
  env_dir = tmp / "venv"
  venv.create(env_dir, with_pip=False)
  (site,) = env_dir.glob("lib/python3*/site-packages")
  # the project venv's site-packages after the fresh one's: the dependencies, not its k3jax (a
  # directory named in a .pth file is added without running the .pth files inside it)
  (site / "project_deps.pth").write_text(
      "\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
  subprocess.run([sys.executable, "-m", "pip", "--python", env_dir / "bin" / "python", "install",
                  "-q", "--no-deps", wheel], check=True)
  return env_dir / "bin"


def _run(cmd, cwd, **kw):
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                        **kw)


def test_wheel_ships_the_package_configs_and_scripts(fresh_venv, tmp_path):
  r = _run([fresh_venv / "python", "-c",
            "import importlib.resources as r, json, k3jax; print(json.dumps([k3jax.__file__, "
            "sorted(p.name for p in (r.files('k3jax') / 'configs').iterdir())]))"], tmp_path)
  assert r.returncode == 0, r.stderr
  where, configs = json.loads(r.stdout)
  assert Path(where).is_relative_to(fresh_venv.parent)
  # every preset of configs/, no more
  assert configs == sorted(p.name for p in (Path(__file__).parents[1] / "configs").glob("*.yaml"))
  assert "k3_tiny.yaml" in configs
  for script in SCRIPTS[1:]:
    r = _run([fresh_venv / script, "--help"], tmp_path)
    assert r.returncode == 0 and "usage" in r.stdout, (script, r.stdout, r.stderr)


def test_installed_train_runs_from_an_empty_directory(fresh_venv, tmp_path):
  r = _run([fresh_venv / "k3jax-train", "--no-progress", "train.steps=2", *SMALL], tmp_path,
           timeout=600)
  assert r.returncode == 0, r.stdout + r.stderr
  metrics = [json.loads(line) for line in (tmp_path / "runs" / "k3_tiny" / "metrics.jsonl")
             .read_text().splitlines()]
  assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
  assert (tmp_path / "runs" / "k3_tiny" / "checkpoints" / "2").is_dir()


def test_quickstart_notebook_runs_top_to_bottom(fresh_venv, tmp_path, root, monkeypatch):
  """notebooks/quickstart.ipynb in a kernel of the fresh venv, its console scripts on PATH, with
  a few steps of the SMALL model appended to its parameters cell."""
  import nbclient
  import nbformat
  nb = nbformat.read(root / "notebooks" / "quickstart.ipynb", as_version=4)
  (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
  params.source += f"\nCI = True\nSTEPS = 3\nOVERRIDES = {SMALL!r}\nMAX_NEW_TOKENS = 4\n"
  spec = tmp_path / "jupyter" / "kernels" / "k3jax-wheel"
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [str(fresh_venv / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "k3jax wheel", "language": "python"}))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("PATH", f"{fresh_venv}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.delenv("PYTHONPATH", raising=False)
  work = tmp_path / "work"
  work.mkdir()
  nbclient.NotebookClient(nb, kernel_name="k3jax-wheel", timeout=600,
                          resources={"metadata": {"path": str(work)}}).execute()
  outputs = {c.id: c.outputs for c in nb.cells if c.cell_type == "code"}
  assert any(o.get("output_type") in ("display_data", "execute_result")
             and "image/png" in o.get("data", {})
             for o in outputs[nb.cells[-1].id])
  assert (work / "runs" / "quickstart" / "report.png").is_file()
  assert (work / "quickstart_hf" / "config.json").is_file()
