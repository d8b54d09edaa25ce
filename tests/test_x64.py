"""The Pallas kernels with ``jax_enable_x64`` on: Python ints in index maps and page arithmetic
become int64 there, and ``lax.div`` / ``lax.rem`` refuse to mix them with the int32 grid
indices. Each case is a kernel test of the suite, run again inside ``jax.enable_x64``."""

import functools

import jax
import pytest

import kda_cases
import test_mla_kernels

_KDA = {c.name: c for c in kda_cases.CASES}
CASES = {
    "kda_pallas_tpu": functools.partial(kda_cases.check, _KDA["unfused_short_T5_no_state"], "pallas_tpu"),
    "kda_pallas_tpu_segments": functools.partial(
        kda_cases.check, _KDA["bounded_saturated_segments_chunk16"], "pallas_tpu"),
    "mla_decode_tpu": test_mla_kernels.test_decode_tpu_ragged_paged,
    "mla_decode_gpu": functools.partial(test_mla_kernels.test_decode_gpu_ragged_paged, 1, 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_under_x64(case):
  with jax.enable_x64(True):
    CASES[case]()
