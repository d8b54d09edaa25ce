"""Compile-only devices (:mod:`k3jax.aot`): the Pallas kernels and the training step compiled
for TPU generations and the H200 on this CPU host.

Compiling is stronger than lowering: libtpu's Mosaic compiler rejects kernels that lower (vector
types a generation lacks, VMEM overflow), and a custom call the SPMD partitioner would have to
split fails on TPU (it runs replicated on GPU: every device computing the whole batch). The TPU
tests need libtpu under ``.aot/`` (``make test`` installs it); the H200 tests need the CUDA
plugin (``make aot``) and are skipped without it.
"""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from k3jax import aot, config as config_lib, plan

TPUS = ["v5e:2x2", "v6e:2x2", "v5p:2x2x1"]


def _devices(target, count=1):
  try:
    return aot.devices(target, count)
  except aot.AotError as e:
    pytest.skip(str(e))


def test_targets_are_named_and_unknown_ones_rejected():
  assert aot.platform("h200") == "cuda" and aot.platform("H100") == "cuda"
  assert aot.platform("v5p:2x2x1") == "tpu" and aot.platform("v6e:4x4") == "tpu"
  for bad in ("a100", "v5p", "v9:2x2", ""):
    with pytest.raises(aot.AotError, match="unknown compile target"):
      aot.platform(bad)
  text = aot.gpu_target_config("h200")
  assert "core_count: 132" in text and "major: 9" in text and '"NVIDIA H200"' in text
  assert aot.usable_memory_bytes("v5e:2x2") == 16 << 30


def test_gpu_compiles_without_the_fusion_autotuner():
  """Compile-only GPUs turn XLA's fusion autotuner off (without the card it compiled every
  distinct fusion once more to keep the emitter XLA picks anyway) and compile again with XLA's
  defaults when a GEMM fusion then finds no config; TPU targets keep XLA's defaults; XLA knows
  the option's name."""
  class Lowered:
    def __init__(self, fails=None):
      self.fails, self.calls = fails, []

    def compile(self, compiler_options=None):
      self.calls.append(compiler_options)
      if compiler_options and self.fails:
        raise jax.errors.JaxRuntimeError(self.fails)
      return compiler_options
  off = {"xla_gpu_experimental_enable_fusion_autotuner": False}
  assert aot.compile_lowered(Lowered(), "h200") == off
  assert aot.compile_lowered(Lowered(), "v5p:2x2x1") is None
  assert aot.compile_lowered(Lowered()) is None
  lowered = Lowered("INTERNAL: No supported config found for HLO: %gemm_fusion_dot.478")
  assert aot.compile_lowered(lowered, "h200") is None and lowered.calls == [off, None]
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
    aot.compile_lowered(Lowered("RESOURCE_EXHAUSTED: out of memory"), "h200")
  dev = _devices("h200")[0]
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32,
                           sharding=jax.sharding.SingleDeviceSharding(dev))
  compiled = aot.compile_lowered(jax.jit(lambda x: jnp.exp(x) * 2).trace(x).lower(), "h200")
  assert "fusion" in compiled.as_text()


@pytest.mark.parametrize("target", ["h200", "v5p:2x2x1"])
def test_few_routed_experts_read_the_weights_in_place(target):
  """Decoding a few tokens through many experts (``moe.expert_mlp``'s few pairs, Kimi Linear
  48B's shapes) compiles with each pair's expert weights read where they lie, no copy of them:
  on GPU through the grouped matmul kernels (an einsum over the gathered weights had XLA copy
  them out, transposed: 151 MB per MoE layer and step at two rows); on TPU any gather of them
  did (2.7 GB of temporaries), hence its pair-by-pair loop."""
  from pallas_kernels import moe
  n, k, e, d, f = 2, 8, 256, 2304, 1024
  dev = _devices(target)[0]
  sh = jax.sharding.SingleDeviceSharding(dev)
  args = [jax.ShapeDtypeStruct(s, t, sharding=sh) for s, t in (
      ((n, d), jnp.bfloat16), ((n, k), jnp.int32), ((n, k), jnp.float32),
      ((e, d, 2 * f), jnp.bfloat16), ((e, f, d), jnp.bfloat16))]
  act = lambda gu: jax.nn.silu(gu[..., :f]) * gu[..., f:]
  with pallas_kernels.target_platform("tpu" if target.startswith("v") else "gpu"), \
      jax.set_mesh(jax.sharding.Mesh(np.array([dev]), ("x",))):
    lowered = jax.jit(lambda *a: moe.expert_mlp(*a, act)).trace(*args).lower()
  compiled = aot.compile_lowered(lowered, target)
  gathered = n * k * d * 2 * f * 2
  assert compiled.memory_analysis().temp_size_in_bytes < gathered // 100
  if target == "h200":
    assert aot.kernel_counts(compiled.as_text()).get("mosaic_gpu", 0) >= 2  # the two products


def test_missing_plugin_names_the_fix(monkeypatch, tmp_path):
  monkeypatch.setenv("K3JAX_AOT_DIR", str(tmp_path))
  monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
  monkeypatch.setattr(aot, "_LOADED", set())
  with pytest.raises(aot.AotError, match="make aot"):
    aot.devices("v5p:2x2x1")


def _kernel_programs(backend):
  """(name, function, abstract args) of every Pallas kernel family at the model's head dims:
  KDA forward and backward (fused gate, grouped values, packed segments, initial state), MLA
  prefill forward and backward (query/key dim 192, value dim 128, segments; a context-parallel
  half at a traced offset) and paged latent decode, the MoE grouped matmuls forward and
  backward."""
  from pallas_kernels.kda import tpu as kda_tpu
  from pallas_kernels.kda import kda
  from pallas_kernels.mla import decode, prefill
  from pallas_kernels.moe import pallas as moe_pallas
  sd, bf, i32, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32, jnp.float32
  b, t, h, hv, d = 1, 200, 2, 4, 128
  kda_args = (sd((b, t, h, d), bf), sd((b, t, h, d), bf), sd((b, t, hv, d), bf),
              sd((b, t, hv, d), bf), sd((b, t, hv), bf), sd((hv,), f32), sd((hv * d,), f32),
              sd((b, hv, d, d), f32), sd((b, t), i32))

  def kda_loss(q, k, v, g, beta, a_log, dt_bias, s0, seg):
    kw = dict(scale=d ** -0.5, initial_state=s0, segment_ids=seg, use_qk_l2norm=True,
              A_log=a_log, dt_bias=dt_bias, gate="bounded", lower_bound=-5.0, beta_is_logit=True,
              chunk_size=64)
    if backend == "tpu":
      o, s = kda_tpu.kda(q, k, v, g, beta, interpret=False, **kw)
    else:
      o, s = kda(q, k, v, g, beta, output_final_state=True, implementation="pallas_gpu", **kw)
    return jnp.sum(o.astype(f32)) + jnp.sum(s)

  def mla_loss(q, k, v, seg):
    o = prefill.mla_attention(q, k, v, segment_ids=seg, causal=True, scale=192 ** -0.5,
                              backend=backend, interpret=False)
    return o.astype(f32).sum()

  def window_loss(q, k, v, q_seg, kv_seg, off):
    o = prefill.mla_attention(q, k, v, segment_ids=q_seg, kv_segment_ids=kv_seg, q_offset=off,
                              causal=True, scale=192 ** -0.5, backend=backend, interpret=False)
    return o.astype(f32).sum()

  dec = lambda q, c, tab, n: decode.mla_decode(q, c, tab, n, kv_lora_rank=512,
                                               scale=192 ** -0.5, backend=backend,
                                               interpret=False)
  gmm = lambda x, w, gs: jax.grad(lambda x, w: jnp.sum(
      moe_pallas.gmm(x, w, gs, backend=backend).astype(f32)), argnums=(0, 1))(x, w)
  return [
      ("kda fwd", kda_loss, kda_args),
      ("kda bwd", jax.grad(kda_loss, argnums=tuple(range(8))), kda_args),
      ("mla prefill fwd+bwd", jax.value_and_grad(mla_loss, argnums=(0, 1, 2)),
       (sd((1, 1000, 2, 192), bf), sd((1, 1000, 2, 192), bf), sd((1, 1000, 2, 128), bf),
        sd((1, 1000), i32))),
      ("mla window fwd+bwd", jax.value_and_grad(window_loss, argnums=(0, 1, 2)),
       (sd((1, 1024, 2, 192), bf), sd((1, 4096, 2, 192), bf), sd((1, 4096, 2, 128), bf),
        sd((1, 1024), i32), sd((1, 4096), i32), sd((), i32))),
      ("mla decode", dec, (sd((4, 2, 96, 576), bf), sd((64, 64, 576), bf), sd((4, 16), i32),
                           sd((4,), i32))),
      ("moe gmm fwd+bwd", gmm, (sd((512, 256), bf), sd((4, 256, 384), bf), sd((4,), i32))),
  ]


def _compile_all(target, backend):
  dev = _devices(target)[0]
  put = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       sharding=jax.sharding.SingleDeviceSharding(dev))
  failed, kinds = [], set()
  mesh = jax.sharding.Mesh(np.array([dev]), ("x",))  # the GPU kernels ask it for the device
  with jax.set_mesh(mesh), pallas_kernels.target_platform(backend):
    for name, fn, args in _kernel_programs(backend):
      try:
        compiled = aot.compile_lowered(jax.jit(fn).trace(*map(put, args)).lower(), target)
        kinds |= set(aot.kernel_counts(compiled.as_text()))
      except Exception as e:  # collect every kernel's failure, not only the first
        failed.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
  assert not failed, "\n".join(failed)
  return kinds


@pytest.mark.slow
@pytest.mark.parametrize("target", TPUS)
def test_tpu_kernels_compile(target):
  """Every Mosaic TPU kernel compiles for v5e, v6e and v5p (libtpu's Mosaic compiler)."""
  _compile_all(target, "tpu")


@pytest.mark.slow
def test_h200_kernels_compile():
  """Every GPU kernel (Triton, and Mosaic GPU for the KDA recurrences, WY factors, grouped
  matmuls and MLA decode) compiles for an H200: XLA's Triton pipeline and ptxas for sm_90a."""
  kinds = _compile_all("h200", "gpu")
  assert kinds == {"triton", "mosaic_gpu"}, kinds


@pytest.mark.slow
@pytest.mark.parametrize("target,mesh", [("v5p:2x2x1", "data=2,fsdp=2"), ("h200", "data=2")])
def test_step_compiles_on_a_mesh(target, mesh):
  """The whole training step (k3_1b cut to one KDA and one MLA layer, MoE, Muon) compiles for a
  mesh of compile-only devices, every kernel on its device's share of the tokens: on TPU a
  kernel left to the SPMD partitioner fails to compile; on GPU it compiles replicated, which
  the per-device batch in the kernels' shapes rules out."""
  sizes = plan.parse_mesh(mesh)
  cfg = config_lib.load("configs/k3_1b.yaml", [f"mesh.{a}={s}" for a, s in sizes.items()]
                        + ["train.grad_accum=1"])  # the batch of 4 below in one micro-batch
  _devices(target, 1)
  batch, seq = 4, 256
  rep = plan.compile_step(cfg, sizes, seq, batch, 2, target)
  mem = rep["memory_per_device"]
  assert rep["layers"] == 2 and rep["devices"] == math.prod(sizes.values()) and rep["fits"], rep
  assert mem["peak_GiB"] >= mem["arguments_GiB"] > 0, rep
  assert rep["kernel_calls"].get("mosaic_tpu" if target.startswith("v") else "triton", 0) > 0, rep
  assert rep["collectives_GB_received"].get("all-reduce", 0) > 0, rep  # the gradients' over data


def test_tpu_memory_is_what_libtpu_allocates():
  """A TPU program's temporaries are libtpu's allocation for them, not ``temp_size_in_bytes``
  (libtpu 0.0.48 adds a fragmentation figure to it), and its peak counts the program's code, as
  libtpu's "Total hbm usage" does; a GPU's keep XLA's temporaries. The figures are libtpu's for
  K3 at 1M tokens cut to 9 layers on a v5p 8x16x16 (its log: HLO temp 53.53G, 13.28G
  fragmentation, program 54.44G, arguments 460.04M, in all 55.16G with 0.28G reserved)."""
  import types
  stats = types.SimpleNamespace(
      temp_size_in_bytes=71738880096, total_allocation_bytes=57964019232,
      indefinite_allocations=486964736, generated_code_size_in_bytes=961658368,
      argument_size_in_bytes=482383872, output_size_in_bytes=482126816,
      alias_size_in_bytes=482121216)
  compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
  tpu = aot.memory_report(compiled, "v5p:8x16x16")
  assert tpu["temporaries_GiB"] == 53.53 and tpu["code_GiB"] == 0.9
  assert abs(tpu["peak_bytes"] + (280 << 20) - 55.16 * 2**30) < 0.02 * 2**30, tpu  # its rounding
  gpu = aot.memory_report(compiled, "h200")
  assert gpu["temporaries_GiB"] == 66.81 and "code_GiB" not in gpu
  assert aot.memory_report(compiled) == gpu


def test_collective_bytes_counts_results_and_loop_trips():
  """Sync collectives and async pairs (their done's result) count once per trip of the loops
  around them (a known trip count, or the condition's bound); starts, other ops and uncalled
  computations do not count."""
  hlo = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag-start = (f32[8]{0}, f32[32]{0}) all-gather-start(%x), dimensions={0}
  %ag-done = f32[32]{0} all-gather-done(%ag-start)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %bound = s32[]{:T(128)} constant(7)
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %bound), direction=LT
}

%unused (a: bf16[1000]) -> bf16[1000] {
  ROOT %ar = bf16[1000]{0} all-reduce(%a), to_apply=%add
}

ENTRY %main (a: f32[8], b: bf16[4,16]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = bf16[4,16]{1,0} parameter(1)
  %ar = bf16[4,16]{1,0} all-reduce(%b), replica_groups={{0,1}}, to_apply=%add
  %a2a = bf16[4,16]{1,0} all-to-all(%b), dimensions={0}
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %w2 = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
  ROOT %o = f32[8]{0} add(%a, %a)
}
"""
  # %w: XLA's known trip count (GPU); %w2: none, as in TPU programs: its condition's bound
  assert aot.collective_bytes(hlo) == {"all-reduce": 128, "all-to-all": 128,
                                       "all-gather": (5 + 7) * 128}


@pytest.mark.slow
def test_serving_steps_compile_for_tpu():
  """The serving engine's decode and prefill steps (paged MLA decode, the KDA pool recurrence and
  chunked prefill from slot states, sampling) compile for a TPU v5p with the TPU kernels."""
  from flax import nnx
  from k3jax.model import K3Model
  from k3jax.serve import step as step_lib
  from tests.conftest import tiny_config
  dev = _devices("v5p:2x2x1")[0]
  cfg = tiny_config("model.param_dtype=bfloat16", "model.compute_dtype=bfloat16")
  model = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  pools = jax.eval_shape(lambda: step_lib.init_pools(model, num_pages=33, page_size=64,
                                                     num_slots=9))
  # the KDA states stay float32 in a bf16 model's cache, the MLA latents are bf16
  assert {p["state"].dtype for p in pools if "state" in p} == {jnp.dtype(jnp.float32)}
  assert {p["pages"].dtype for p in pools if "pages" in p} == {jnp.dtype(jnp.bfloat16)}
  one = jax.sharding.SingleDeviceSharding(dev)
  place = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), tree)
  mesh = jax.sharding.Mesh(np.array([dev]), ("x",))
  kinds = {}
  with jax.set_mesh(mesh), pallas_kernels.target_platform("tpu"):
    for decode, n, t in [(True, 8, 1), (False, 2, 128)]:
      lowered = step_lib.lower(graphdef, place(params), place(pools), decode=decode, rows=n,
                               tokens=t, table_width=20, feed=(8, 2), row_sharding=one)
      kinds[decode] = aot.kernel_counts(aot.compile_lowered(lowered).as_text())
      for draw in (False, True):  # the sampling program after it
        aot.compile_lowered(step_lib.lower_sample(n, cfg.model.vocab_size, 8 if decode else 2,
                                                  draw, row_sharding=one))
  assert kinds[True] and kinds[False], kinds


def _benchmark_tool(name: str):
  """The module ``benchmarks/NAME.py`` (a script, not a package)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      name, Path(__file__).parents[1] / "benchmarks" / f"{name}.py")
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  return tool


def test_dump_names_the_buffers_live_at_the_peak(tmp_path, capsys):
  """``dump_to`` (``plan --xla-dump``) writes XLA's dump of the compile, and
  benchmarks/xla_live_buffers.py reads what is live at its memory peak (on the CPU, where the
  whole function is one fusion, its argument) with shapes and the JAX scopes."""
  tool = _benchmark_tool("xla_live_buffers")
  x = jnp.asarray(np.random.default_rng(0).normal(size=(512, 384)), jnp.float32)
  aot.compile_lowered(jax.jit(lambda x: jnp.sum(jnp.sin(x) @ x.T)).trace(x).lower(),
                      dump_to=str(tmp_path))
  pre = tool.module_prefix(str(tmp_path))
  with open(f"{pre}-live-range.txt") as f:
    at, live, ranges = tool.peak(f)
  with open(f"{pre}-buffer-assignment.txt") as f:
    _, shapes = tool.buffer_assignment(f)
  assert at >= 0 and dict(live)["x.1{}"] == x.nbytes and ranges["x.1{}"][0] == 0
  assert shapes["x.1{}"].startswith("f32[512,384]")
  tool.main([str(tmp_path), "--by-shape"])
  out = capsys.readouterr().out
  assert "XLA's peak" in out and "f32[512,384]" in out.split("by shape:")[1]


def test_tpu_lowering_times_reads_libtpu_log():
  """benchmarks/tpu_lowering_times.py sums each instruction's lowering on its own compile thread
  (threads interleave in libtpu's log), counts a retried instruction's tries, reads the stage
  durations, and names a fusion's ops and a custom call's target from the compiled HLO."""
  tool = _benchmark_tool("tpu_lowering_times")
  log = """\
I1206 22:49:06.000000   20262 lowering_emitter.cc:6973] Started lowering fusion.12
I1206 22:49:06.500000   20258 lowering_emitter.cc:6973] Started lowering all-reduce.3
I1206 22:49:07.250000   20262 lowering_emitter.cc:7080] Finished lowering fusion.12
I1206 22:49:07.300000   20262 lowering_emitter.cc:6973] Started lowering fusion.12
I1206 22:49:07.800000   20262 lowering_emitter.cc:7080] Finished lowering fusion.12
I1206 22:49:09.500000   20258 lowering_emitter.cc:7080] Finished lowering all-reduce.3
I1206 22:49:59.000000   20232 deepsea_compiler_hlo_passes.cc:6722] HLO_PASSES stage duration: 1m19.5s
I1206 22:55:31.000000   20266 deepsea_compiler_base.cc:4274] BACKEND_PASSES stage duration: 5m31.946s
""".splitlines()
  s = tool.summarize(log)
  assert s["units"]["fusion.12"] == pytest.approx([1.75, 2])
  assert s["units"]["all-reduce.3"] == pytest.approx([3.0, 1])
  assert s["threads"] == 2
  assert s["stages"] == pytest.approx({"HLO_PASSES": 79.5, "BACKEND_PASSES": 331.946})
  assert tool.kind("all-reduce.3") == "all-reduce" and tool.kind("fusion.12") == "fusion"
  hlo = """\
%fused_computation.7 (param_0: f32[8], param_1: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  %param_1 = f32[8]{0} parameter(1)
  %multiply.1 = f32[8]{0} multiply(f32[8]{0} %param_0, f32[8]{0} %param_1)
  ROOT %add.2 = f32[8]{0} add(f32[8]{0} %multiply.1, f32[8]{0} %param_0)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %fusion.12 = f32[8]{0} fusion(f32[8]{0} %a, f32[8]{0} %a), kind=kLoop, calls=%fused_computation.7
  ROOT %mla_fwd.4 = f32[8]{0} custom-call(f32[8]{0} %fusion.12), custom_call_target="tpu_custom_call"
}
"""
  desc = tool.fusion_ops(hlo)
  assert desc["fusion.12"] == "main: kLoop multiply,add" and desc["mla_fwd.4"] == "main: tpu_custom_call"
