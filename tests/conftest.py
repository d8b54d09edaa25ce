"""Shared fixtures: configs small enough for CPU tests."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "k3jax-jax"))
# GPU interpret mode runs each warpgroup of a Mosaic GPU kernel as an XLA CPU computation that
# blocks at barriers: XLA's CPU client needs a thread per warpgroup besides the caller's, more than
# the 2 CPUs of CI (pallas_kernels.gpu_interpret says so, instead of the kernel hanging)
os.environ.setdefault("PJRT_NPROC", "8")


@pytest.fixture(scope="session")
def root() -> Path:
  return ROOT


def tiny_config(*overrides: str):
  """The tiny preset, shrunk further where a test does not need its full size."""
  from k3jax import config
  return config.load(ROOT / "configs" / "k3_tiny.yaml", list(overrides))
