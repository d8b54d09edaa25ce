"""Shared by the benchmark scripts: median wall-clock timing and result rows saved as they come."""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp


def median_ms(fn, *args, reps: int = 15, inner: int = 5) -> float:
  """Median milliseconds per call of ``fn(*args)``: ``reps`` samples of ``inner`` back-to-back
  calls (launch overhead hidden), after one warm-up call, each sample synchronised."""
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / inner)
  return statistics.median(ts) * 1e3


@jax.jit
def _rel_err(a, b):
  a, b = a.astype(jnp.float32).reshape(-1), b.astype(jnp.float32).reshape(-1)
  return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def rel_err(a, b) -> float:
  """Relative Frobenius error ``||a - b|| / ||b||`` in float32, computed on the device."""
  return float(_rel_err(jnp.asarray(a), jnp.asarray(b)))


class Rows:
  """Collects result rows, prints each as JSON and rewrites ``$OUT/<filename>`` after every row,
  so a run cut short keeps what it measured."""

  def __init__(self, filename: str):
    self.filename = filename
    self.rows: list[dict] = []

  def emit(self, row: dict) -> None:
    self.rows.append(row)
    print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
      with open(os.path.join(out, self.filename), "w") as fh:
        json.dump(self.rows, fh, indent=1)
