"""Shared fixtures: configs small enough for CPU tests, jit / no-jit variants, H200 lowering.

Tests marked ``slow`` (a subprocess, a simulated multi-device mesh, an ahead-of-time compile, a
long interpret-mode kernel) are left out by ``pytest -m "not slow"`` (``make test-fast``)."""

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


@pytest.fixture(params=["with_jit", "without_jit"])
def variant(request):
  """``chex.variants(with_jit=True, without_jit=True)`` for pytest functions: ``variant(fn,
  **jit_kwargs)`` is ``jax.jit(fn, **jit_kwargs)`` in one run of the test and ``fn`` in the other,
  where ``chex.fake_jit`` also runs every ``jax.jit`` inside it op by op."""
  import chex
  import jax
  if request.param == "with_jit":
    yield lambda fn, **jit_kwargs: jax.jit(fn, **jit_kwargs)
  else:
    with chex.fake_jit():
      yield lambda fn, **jit_kwargs: fn


@pytest.fixture
def h200_lowering(monkeypatch):
  """Builds Pallas kernels for an H200 on this CPU host: Triton sees the H200's description and
  kernels are selected and lowered for 'gpu' (no interpret mode). Lower with
  ``lowering_platforms=("cuda",)``; nothing built inside can run here."""
  import pallas_kernels
  gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
  monkeypatch.setattr(gpu_info, "get_gpu_info",
                      lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  with pallas_kernels.target_platform("gpu"):
    yield
