"""Sharded execution on 8 simulated CPU devices vs one device.

Each test asserts on the errors that one body of ``tests/test_sharding_workers.py`` reports. The
bodies run in two subprocesses (``XLA_FLAGS`` with 8 host devices must be set before jax is
imported; the main suite keeps its single device), each started once for the module: one start
of jax and one import of the model per group rather than per test. Everything runs in float64:
losses, every op and the gradients of every layout agree to ~1e-14.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test is a subprocess with 8 simulated devices

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-9


def _run(*names: str) -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/k3jax-jax"))
  env["JAX_PLATFORMS"] = "cpu"
  # killed before pytest-timeout's 900 s ends the worker, which would leave the child running
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "test_sharding_workers.py"), *names],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


GRAD_TOL = 1e-12
# The subprocesses' bodies: the whole model's, and the ops' and serving's.
GROUPS = (("model_layouts", "scanned_model", "moe_local_sort", "muon_sharded", "vision_sharded"),
          ("kda_context", "mla_context", "expert_dispatch", "qb_histogram", "conv_sharded",
           "serve_mesh", "serve_layout"))


@pytest.fixture(scope="module")
def body():
  """``body(name)``: what the worker body ``name`` returned; the first request of a group runs
  the group's subprocess."""
  results = {}

  def get(name):
    if name not in results:
      results.update(_run(*next(g for g in GROUPS if name in g)))
    assert "traceback" not in results[name], results[name]["traceback"][-4000:]
    return results[name]
  return get


@pytest.mark.parametrize("layouts", ["data,fsdp,expert", "context,mix,mix_plain,context_experts"])
def test_model_layouts_match_one_device(body, layouts):
  """Loss, every gradient and the router statistics of the tiny preset (KDA, MLA, dense and
  LatentMoE layers, Block AttnRes, packed documents) under data=8, fsdp=8, data=2,expert=4
  (MoonEP), data=2,context=4, data=2,expert=2,context=2 (MoonEP on and off) and data=2,context=4
  with the experts split over the context axis. The KDA gate's float32 parameters (A_log,
  dt_bias) agree to float32 rounding."""
  out = body("model_layouts")
  for layout in layouts.split(","):
    err = out[layout]
    assert err["loss"] < TOL, (layout, err)
    assert err["grad"] < GRAD_TOL and err["grad_f32"] < 1e-6, (layout, err)
    assert err["stats"] < 1e-8, (layout, err)


def test_kda_context_parallel(body):
  """Outputs, final state and gradients (all inputs, A_log and dt_bias included) for segment
  splits inside pieces, across piece boundaries and exactly at them, on context=8 and
  data=2,context=4."""
  out = body("kda_context")
  assert len(out) == 8
  for case, err in out.items():
    assert max(err.values()) < TOL, (case, err)


def test_mla_context_parallel(body):
  """Values and gradients vs dense causal attention: balanced (zigzag: each half at its offset
  into the gathered keys) and plain splits, the keys up-projected whole or in blocks merged by
  their log-sum-exps, through the XLA reference (float64) and the Pallas GPU and TPU kernels
  (interpret mode, float32 accumulation)."""
  out = body("mla_context")
  assert len(out) == 12
  for case, err in out.items():
    assert max(err.values()) < (TOL if case.endswith("/xla") else 1e-5), (case, err)


def test_moe_sorts_only_local_tokens(body):
  """With the tokens split and the experts whole (data or context parallel), each device routes
  its own tokens: the token-expert sort has the local size, not the global one (the SPMD
  partitioner would otherwise gather all pairs and run every token's experts everywhere)."""
  out = body("moe_local_sort")
  assert out["data8"] == [out["pairs"] // 8] and out["context8"] == [out["pairs"] // 8], out


def test_expert_parallel_dispatch(body):
  """Skewed routing (three hot experts) so MoonEP must place redundant copies; the gradients of
  the expert weights include the copies' gradients reduced back to their home rank. With a
  capacity, the dropped (token, expert) pairs add nothing and get no gradient."""
  out = body("expert_dispatch")
  assert len(out) == 5
  assert out["expert8/capacity0.5"].pop("dropped") > 0
  for case, err in out.items():
    assert err["y"] < TOL and err["grad"] < GRAD_TOL, (case, err)


def test_muon_update_on_meshes_matches_one_device(body):
  out = body("muon_sharded")
  assert out["expert"] < 1e-4 and out["fsdp"] < 1e-4, out
  assert out["expert_stacked"] < 1e-4 and out["fsdp_stacked"] < 1e-4, out
  # On fsdp=8 every matrix's rows or columns are split: all-to-alls hand each device whole
  # matrices, its eighth of them (and zero matrices padding each stack to a multiple of 8), for
  # Newton-Schulz; on data=2,expert=4 the experts' matrices are whole where they lie and every
  # device iterates those of its own experts, the rest as on fsdp.
  assert out["matrices"] // 8 < out["fsdp_iterated"] < out["matrices"] // 6, out
  assert out["expert_iterated"] < out["matrices"], out


def test_quantile_balancing_histogram_across_ranks(body):
  out = body("qb_histogram")
  assert out["hist_equal"], out  # the all-reduced histogram is the global one
  assert out["count"] == out["valid"]
  assert out["max_err_in_bins"] <= 1.0, out


def test_fused_short_conv_on_meshes(body):
  """The fused short-conv kernel per device (batch and channel splits) and its XLA form under a
  sequence split match one device, values and gradients."""
  out = body("conv_sharded")
  assert len(out) == 4
  for layout, err in out.items():
    assert max(err.values()) < 1e-5, (layout, err)


def test_serving_engine_on_a_mesh(body):
  """The serving engine on 8 devices (training's rules less the ZeRO-3 split) gives one device's
  tokens; the routed experts are split over expert, every other weight at most over tensor."""
  out = body("serve_mesh")
  assert out["equal"] and out["hits"] == 16 and out["devices"] == 8
  assert out["state_spec"] == "P(None, 'tensor')"
  assert "expert" in out["experts"] and out["others"] == ["tensor"], out


def test_serving_layout_on_a_mesh(body):
  """The serving layout of the KDA and MLA layers (one input matmul, one conv tail, head-major
  over the shards) on tensor=2 and tensor=4 gives the separate layout's outputs and cache writes
  (float32)."""
  out = body("serve_layout")
  assert len(out) == 16
  for case, err in out.items():
    assert max(err.values()) < 2e-5, (case, err)


def test_scanned_model_on_a_mesh(body):
  """A scanned decoder's loss, gradients and router statistics on data=2,expert=2,context=2 match
  the unrolled one's on that mesh (float32), its parameters one entry per layer or stacked and
  laid out as a scanned run's train state holds them."""
  out = body("scanned_model")
  for name in ("", "stacked_"):
    assert (out[name + "loss"] < 1e-6 and out[name + "grad"] < 1e-4
            and out[name + "stats"] < 1e-6), out


def test_vision_tower_on_meshes_matches_one_device(body):
  """MoonViT-V2 and its projector data-parallel (data=8), FSDP (fsdp=8: the parameters split)
  and mixed with tensor parallelism: the loss and every gradient as on one device."""
  out = body("vision_sharded")
  for layout, err in out.items():
    assert err["loss"] < TOL and err["grad"] < GRAD_TOL * 10, (layout, err)
  assert out["data"]["split"] == 0 and out["fsdp"]["split"] > out["fsdp"]["params"] // 2, out
