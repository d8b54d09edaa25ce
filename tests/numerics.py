"""Error measures the tests share, computed in float64 on the host."""

import numpy as np


def rel_err(got, want) -> float:
  """Relative Frobenius error ``||got - want|| / ||want||`` (``want`` the reference)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def max_rel_err(got, want) -> float:
  """Largest absolute error relative to the reference's largest magnitude."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
