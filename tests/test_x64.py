"""The Pallas kernels with ``jax_enable_x64`` on: Python ints in index maps and page arithmetic
become int64 there, and ``lax.div`` / ``lax.rem`` refuse to mix them with the int32 grid
indices. Each case is a kernel test of its own module, run again inside ``jax.enable_x64``."""

import functools

import jax
import pytest

import test_kda_tpu
import test_mla_kernels

CASES = {
    "kda_pallas_tpu": test_kda_tpu.test_short_sequence_unfused_inputs,
    "kda_pallas_tpu_segments": test_kda_tpu.test_bounded_fast_path_segments_in_and_at_chunk_edges,
    "mla_decode_tpu": test_mla_kernels.test_decode_tpu_ragged_paged,
    "mla_decode_gpu": functools.partial(test_mla_kernels.test_decode_gpu_ragged_paged, 1, 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_under_x64(case):
  with jax.enable_x64(True):
    CASES[case]()
