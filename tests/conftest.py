"""Shared fixtures: configs small enough for CPU tests."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "k3jax-jax"))


@pytest.fixture(scope="session")
def root() -> Path:
  return ROOT


def tiny_config(*overrides: str):
  """The tiny preset, shrunk further where a test does not need its full size."""
  from k3jax import config
  return config.load(ROOT / "configs" / "k3_tiny.yaml", list(overrides))
