"""Every KDA implementation on one case table (``kda_cases``): values, final state and the
gradients of every input against float64. The Pallas kernels run in interpret mode on CPU; what
only one backend has is tested in its own file."""

import pytest
import jax

from kda_cases import CASES, IMPLEMENTATIONS, check, supports


@pytest.fixture(autouse=True)
def _highest_precision():
  """float32 products in the XLA paths, for this file's tests only (set for the whole process,
  it made the Mosaic TPU kernels of later tests ask for fp32 products of bf16 operands, which
  Mosaic rejects)."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64(case, impl):
  reason = supports(case, impl)
  if reason:
    pytest.skip(reason)
  check(case, impl)
