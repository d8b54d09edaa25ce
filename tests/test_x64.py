"""Every Pallas backend of every op with ``jax_enable_x64`` on: Python ints in index maps, loop
bounds and page arithmetic become int64 there, integer sums widen to int64, and ``lax.div`` /
``lax.rem`` / ``dynamic_slice`` refuse to mix them with the int32 grid and program indices. Each
case is a kernel test of the suite (values against its float64 or NumPy reference, inputs of
explicit 32- or 16-bit dtypes), run again with 64-bit types on."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

import kda_cases
import test_attn_res_kernels
import test_conv_kernels
import test_glu_kernels
import test_kda_a_mgpu
import test_kda_decode
import test_kda_dqkg_mgpu
import test_kda_dwy_mgpu
import test_kda_recurrence_mgpu
import test_kda_wu_mgpu
import test_logsumexp_kernels
import test_mla_kernels
import test_moe_kernels
import test_moe_permute
import test_select_kernels


def _float32_mla(test):
  """``test`` of test_mla_kernels with its random inputs float32 (``jax.random.normal`` gives
  float64 under x64)."""
  inputs = test_mla_kernels._inputs

  def run():
    with mock.patch.object(test_mla_kernels, "_inputs",
                           lambda *a: tuple(x.astype(jnp.float32) for x in inputs(*a))):
      test()
  return run


_p = functools.partial
_KDA = {c.name: c for c in kda_cases.CASES}
_SEL, _RES, _PERM = test_select_kernels.CASES, test_attn_res_kernels.CASES, test_moe_permute.CASES
CASES = {
    "kda_pallas_gpu": _p(kda_cases.check, _KDA["unfused_short_T5_no_state"], "pallas_gpu"),
    "kda_pallas_gpu_dense": _p(kda_cases.check, _KDA["bounded_chunk16_T9_segments"], "pallas_gpu"),
    "kda_pallas_tpu": _p(kda_cases.check, _KDA["unfused_short_T5_no_state"], "pallas_tpu"),
    "kda_pallas_tpu_segments": _p(
        kda_cases.check, _KDA["bounded_saturated_segments_chunk16"], "pallas_tpu"),
    "kda_recurrence_mgpu": _p(
        test_kda_recurrence_mgpu.test_forward_and_backward_match_float64_loops,
        1, 2, 1, 64, 16, 16, 2),
    "kda_wu_mgpu": _p(test_kda_wu_mgpu.test_matches_float64, 1, 1, 1, 64, 128, (), 0.0),
    "kda_chunk_a_mgpu": _p(test_kda_a_mgpu.test_matches_float64, jnp.bfloat16, "softplus", -5.0,
                           True, 77, 1, 2, 128, (30,), True, 1),
    "kda_chunk_dqkg_mgpu": lambda: kda_cases.check(
        test_kda_dqkg_mgpu.CASES[0], "pallas_gpu",
        config=test_kda_dqkg_mgpu._tuning(test_kda_dqkg_mgpu.CASES[0])),
    "kda_chunk_dwy_mgpu": _p(test_kda_dwy_mgpu.test_matches_float64, 64, 64, 128, 70),
    "kda_decode_gpu": _p(test_kda_decode.test_kda_decode, "gpu", 3, "softplus", True),
    "kda_decode_tpu": _p(test_kda_decode.test_kda_decode, "tpu", 3, "softplus", True),
    "conv_pallas_gpu": _p(test_conv_kernels.test_values_and_grads_match_numpy,
                          test_conv_kernels.CASES[1], "pallas_gpu"),
    "glu_pallas_gpu": _p(test_glu_kernels.test_glu_values_and_grad_match_float64,
                         "pallas_gpu", "situ", (37, 80), "packed"),
    "logsumexp_pallas_gpu": _p(test_logsumexp_kernels.test_matches_float64,
                               "pallas_gpu", (11, 3001), jnp.float32),
    "select_pallas_gpu": _p(test_select_kernels.test_pallas_kernel_is_the_sorted_column_exactly,
                            *_SEL[2]),
    "attn_res_pallas_gpu": _p(test_attn_res_kernels.test_matches_numpy, *_RES[3]),
    "attn_res_pallas_gpu_one_chunk": _p(test_attn_res_kernels.test_matches_numpy, *_RES[2]),
    "moe_gmm_pallas_gpu": _p(test_moe_kernels.test_gmm_values_and_grads_vs_numpy,
                             "pallas_gpu", test_moe_kernels.SKEWED),
    "moe_gmm_pallas_tpu": _p(test_moe_kernels.test_gmm_values_and_grads_vs_numpy,
                             "pallas_tpu", test_moe_kernels.SKEWED),
    "moe_unpermute_pallas_gpu": _p(
        test_moe_permute.test_kernel_and_reference_match_float64_loop, *_PERM[0]),
    "moe_expand_pallas_gpu": _p(test_moe_permute.test_expansion_matches_float64_loop,
                                *_PERM[2][:3], _PERM[2][3], _PERM[2][5]),
    "mla_prefill_gpu": _float32_mla(test_mla_kernels.test_prefill_gpu_packed_documents_ragged_t),
    "mla_prefill_tpu": _float32_mla(test_mla_kernels.test_prefill_tpu_packed_documents_ragged_t),
    "mla_decode_gpu": _p(test_mla_kernels.test_decode_gpu_ragged_paged, 1, 3),
    "mla_decode_gpu_mosaic": _p(test_mla_kernels.test_decode_gpu_mosaic_ragged_paged, 1, 16, 2),
    "mla_decode_tpu": test_mla_kernels.test_decode_tpu_ragged_paged,
}
SLOW = {"mla_prefill_gpu", "mla_prefill_tpu"}  # over 5 s each in interpret mode


@pytest.fixture
def x64():
  """``jax_enable_x64`` on for the process, as a user's configuration sets it, and back after.
  Not the ``jax.enable_x64`` context: it is thread-local, and the interpret modes of Mosaic GPU
  and TPU kernels run kernel bodies on XLA's callback threads, which would see 64-bit types off
  while the kernel was traced with them on."""
  before = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", before)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
                                  for c in sorted(CASES)])
def test_kernel_under_x64(case, x64):
  CASES[case]()
