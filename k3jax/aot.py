"""Compile-only devices: compile a program for an H200, an H100 or a TPU generation on any host
(a CPU laptop, CI) without the accelerator.

XLA compiles for a device it cannot see when given its description: for NVIDIA GPUs a target
config (compute capability, SM count, shared memory, HBM size and bandwidth: :data:`GPU_SPECS`)
handed to the CUDA PJRT plugin, for TPUs a topology name handed to libtpu (``v5e:2x2``,
``v6e:2x2``, ``v5p:2x2x1``, ``v4:2x2x1``). What comes back is the compiled program itself:

- every kernel is really compiled: Mosaic TPU kernels by libtpu's Mosaic compiler (which rejects
  what lowering accepts: unsupported vector types, VMEM overflows), Triton kernels by XLA's
  Triton pipeline and ptxas for sm_90a, Mosaic GPU kernels for Hopper;
- its memory analysis is what the device would allocate (temporaries, arguments, outputs);
  without the device XLA cannot autotune (GEMM backends, CUB sort scratch), so a GPU figure can
  be a few GiB off (benchmarks/RESULTS.md, Training).

The plugins stay out of the project's venv, where every CPU run would probe for their devices:
``make aot`` installs them under ``.aot/`` (or ``$K3JAX_AOT_DIR``): libtpu for the TPU targets
(about 0.7 GB), the CUDA 13 plugin with its CUDA libraries for the GPU ones (about 4 GB).
:func:`devices` loads one on first use, after JAX has set up its own (CPU) backend.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from pathlib import Path

import jax

# GpuDeviceInfo of the GPU targets (XLA's GpuTargetConfigProto fields). Memory as the driver
# reports it; bandwidth and clock are the datasheet's (they steer XLA's cost model, not limits).
GPU_SPECS: dict[str, dict] = {
    "h200": {"name": "NVIDIA H200", "core_count": 132, "memory": 150_754_820_096,
             "bandwidth": 4_800_000_000_000, "clock_ghz": 1.98, "l2": 52_428_800},
    "h100": {"name": "NVIDIA H100 80GB HBM3", "core_count": 132, "memory": 84_978_434_048,
             "bandwidth": 3_352_320_000_000, "clock_ghz": 1.98, "l2": 52_428_800},
}
# HBM per TPU chip (bytes), for the fit of a compiled program
TPU_HBM: dict[str, int] = {"v4": 32 << 30, "v5e": 16 << 30, "v5p": 95 << 30, "v6e": 32 << 30}
CUDA_PLUGIN = "jax_plugins.xla_cuda13"
_LOADED: set[str] = set()


class AotError(RuntimeError):
  """A compile target that is unknown or whose plugin is not installed."""


def aot_dir() -> Path:
  """Where ``make aot`` installs the plugins: ``$K3JAX_AOT_DIR`` or ``.aot`` at the repo root."""
  return Path(os.environ.get("K3JAX_AOT_DIR") or Path(__file__).resolve().parents[1] / ".aot")


def platform(target: str) -> str:
  """``"cuda"`` for a GPU target (a :data:`GPU_SPECS` name), ``"tpu"`` for a TPU topology."""
  if target.lower() in GPU_SPECS:
    return "cuda"
  if target.split(":")[0].lower() in TPU_HBM and ":" in target:
    return "tpu"
  raise AotError(f"unknown compile target {target!r}: a GPU ({', '.join(GPU_SPECS)}) or a TPU "
                 f"topology GENERATION:SHAPE ({', '.join(TPU_HBM)}; e.g. v5p:2x2x1, v6e:2x2)")


def gpu_target_config(name: str) -> str:
  """The text-format ``GpuTargetConfigProto`` of GPU target ``name``."""
  s = GPU_SPECS[name.lower()]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024  threads_per_warp: 32
  shared_memory_per_block: 49152  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048  core_count: {s["core_count"]}  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: {s["bandwidth"]}  l2_cache_size: {s["l2"]}
  clock_rate_ghz: {s["clock_ghz"]}  device_memory_size: {s["memory"]}
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 12 }}
device_description_str: "{s["name"]}"
"""


def _load_cuda() -> None:
  if "cuda" in _LOADED:
    return
  jax.devices("cpu")  # JAX's backends first: the plugin must not become one of them
  path = aot_dir() / "cuda"
  if str(path) not in sys.path and path.is_dir():
    sys.path.append(str(path))
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no GPU to check versions on
  try:
    plugin = importlib.import_module(CUDA_PLUGIN)
  except ImportError as e:
    raise AotError(f"GPU compile targets need the CUDA plugin, not found in {path}: run "
                   f"`make aot` (or set K3JAX_AOT_DIR)") from e
  plugin.initialize()
  # Mosaic GPU kernels link against the plugin's runtime; JAX finds it only when the plugin is
  # importable at JAX's own import
  runtime = Path(importlib.import_module("jax_cuda13_plugin").__file__).parent
  os.environ.setdefault("MOSAIC_GPU_RUNTIME_LIB_PATH", str(runtime / "libmosaic_gpu_runtime.so"))
  _LOADED.add("cuda")


def _load_tpu() -> None:
  if "tpu" in _LOADED:
    return
  jax.devices("cpu")
  lib = aot_dir() / "tpu" / "libtpu" / "libtpu.so"
  if "TPU_LIBRARY_PATH" not in os.environ:
    if not lib.is_file():
      raise AotError(f"TPU compile targets need libtpu, not found at {lib}: run `make aot` "
                     f"(or set K3JAX_AOT_DIR, or TPU_LIBRARY_PATH to a libtpu.so)")
    os.environ["TPU_LIBRARY_PATH"] = str(lib)
  # no TPU VM to ask: name the host so libtpu does not warn about its worker list
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  _LOADED.add("tpu")


def devices(target: str, count: int = 1) -> list:
  """``count`` compile-only devices of ``target`` (see :func:`platform`): put them in a
  ``jax.sharding.Mesh`` or a ``SingleDeviceSharding`` and ``jit(...).lower(...).compile()``
  programs for them; nothing can run on them. A GPU target holds up to 8 devices per host and
  any number of hosts; a TPU topology holds its chips."""
  from jax.experimental import topologies
  if platform(target) == "cuda":
    _load_cuda()
    per_host = min(count, 8)
    if count % per_host:
      raise AotError(f"{count} GPUs: more than 8 must fill hosts of 8")
    topo = topologies.get_topology_desc(
        "", platform="cuda", target_config=gpu_target_config(target),
        topology=f"1x{count // per_host}x{per_host}")
  else:
    _load_tpu()
    topo = topologies.get_topology_desc(target.lower(), "tpu")
  devs = list(topo.devices)
  if len(devs) < count:
    raise AotError(f"{target} has {len(devs)} devices, {count} asked for: name a larger topology")
  return devs[:count]


def compiler_options(target: str | None) -> dict:
  """XLA options of a compile for compile-only devices of ``target``. Without the card XLA's
  fusion autotuner (on by default in jax 0.11.2) cannot time a candidate, so for every distinct
  fusion it compiles the emitter XLA would pick anyway and keeps it: a GPU target turns it off,
  for the same program and memory analysis at a fraction of the HLO pass time on large steps."""
  if target is not None and platform(target) == "cuda":
    return {"xla_gpu_experimental_enable_fusion_autotuner": False}
  return {}


def dump_options(path: str | None) -> dict:
  """XLA options that write the compiled module to directory ``path`` (None: nothing): its HLO
  before and after optimization as text and, once buffers are assigned, the buffer assignment,
  the live ranges and the memory-usage report (``benchmarks/xla_live_buffers.py`` reads them).
  libtpu writes these before its backend runs: a TPU compile's memory can be read minutes before
  the compile ends."""
  return {} if path is None else {"xla_dump_to": str(path), "xla_dump_hlo_as_text": True}


def compile_lowered(lowered, target: str | None = None, dump_to: str | None = None):
  """``lowered.compile()`` for compile-only devices of ``target`` (a :func:`platform` name;
  None: XLA's defaults) with :func:`compiler_options` (and :func:`dump_options` of ``dump_to``),
  past JAX's persistent compilation cache: an entry for them cannot be loaded without a client
  (reading one only warns) and writing one would fill the cache with programs nothing can run.
  A program with a GEMM fusion that only the fusion autotuner's emitters take (XLA: "No
  supported config found") compiles again with XLA's defaults."""
  from unittest import mock
  from jax._src import compilation_cache  # jax 0.11.2 decides once per process whether the
  # cache is used (the config switch is read only then): the decision itself is overridden here
  options, dump = compiler_options(target), dump_options(dump_to)
  with mock.patch.object(compilation_cache, "is_cache_used", return_value=False):
    if options:
      try:
        return lowered.compile(compiler_options={**options, **dump})
      except jax.errors.JaxRuntimeError as e:
        if "No supported config found" not in str(e):
          raise
    return lowered.compile(compiler_options=dump or None)


def usable_memory_bytes(target: str) -> int:
  """HBM of one device of ``target`` that a program may use: on a GPU the share JAX's allocator
  takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``, train.py's default 0.92), on a TPU all of it."""
  if platform(target) == "cuda":
    frac = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"))
    return int(GPU_SPECS[target.lower()]["memory"] * frac)
  return TPU_HBM[target.split(":")[0].lower()]


def memory_report(compiled, target: str | None = None) -> dict:
  """GiB figures of a compiled program's memory analysis; ``peak`` = arguments + temporaries +
  outputs not aliased to (donated) arguments.

  For a TPU ``target`` the temporaries are the bytes libtpu allocates for them
  (``total_allocation_bytes`` less the arguments' ``indefinite_allocations``) and the peak adds the
  program's code (``generated_code_size_in_bytes``), which is libtpu's own "Total hbm usage" less
  its reserved 0.28 GiB: libtpu 0.0.48's ``temp_size_in_bytes`` adds to the allocation the
  figure its log calls the allocation's fragmentation (K3 at 1M tokens on a v5p: 125.3 GiB for an
  allocation of 85.9 GiB; benchmarks/RESULTS.md)."""
  ma = compiled.memory_analysis()
  gib = lambda b: round(b / 2**30, 2)
  temp, code = ma.temp_size_in_bytes, 0
  if target is not None and platform(target) == "tpu":
    temp = ma.total_allocation_bytes - ma.indefinite_allocations
    code = ma.generated_code_size_in_bytes
  peak = (ma.argument_size_in_bytes + temp + ma.output_size_in_bytes - ma.alias_size_in_bytes
          + code)
  report = {"temporaries_GiB": gib(temp), "arguments_GiB": gib(ma.argument_size_in_bytes),
            "outputs_GiB": gib(ma.output_size_in_bytes), "aliased_GiB": gib(ma.alias_size_in_bytes)}
  if code:
    report["code_GiB"] = gib(code)
  return {**report, "peak_GiB": gib(peak), "peak_bytes": int(peak)}


def kernel_counts(hlo_text: str) -> dict[str, int]:
  """Kernel custom calls in compiled (or lowered) HLO text, by kind."""
  kinds = {"triton": ('"__gpu$xla.gpu.triton"', "@__gpu$xla.gpu.triton"),
           "mosaic_gpu": ('"mosaic_gpu', "@mosaic_gpu"),
           "mosaic_tpu": ('"tpu_custom_call"', "@tpu_custom_call")}
  counts = {k: sum(hlo_text.count(m) for m in marks) for k, marks in kinds.items()}
  return {k: n for k, n in counts.items() if n}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                "ragged-all-to-all")


def _shape_bytes(text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt]
             for dt, dims in _SHAPE.findall(text))


def _trip_count(line: str, comps: dict[str, list[str]]) -> int:
  """The trips of the ``while`` on ``line``: XLA's known trip count (GPU), else its condition's
  ``counter < constant`` (TPU's compiled HLO records no count; JAX's loops count up from 0);
  1 when neither is there."""
  n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
  if n:
    return int(n.group(1))
  cond = re.search(r"condition=%([\w.-]+)", line)
  body = "\n".join(comps.get(cond.group(1), [])) if cond else ""
  bounds = re.findall(r"= s32\[\]\S* constant\((\d+)\)", body)
  if len(bounds) == 1 and re.search(r"ROOT .* compare\(.*direction=LT", body):
    return int(bounds[0])
  return 1


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes each device receives per run of a compiled (SPMD, per-device) HLO module, by
  collective: the result of every all-gather, all-reduce, reduce-scatter, all-to-all and
  collective-permute, counted once per trip of the while loops around it (:func:`_trip_count`).
  A measure of the traffic the partitioner and the ``shard_map``s put in the program, to set
  beside the plan's analytical ``collectives``: a gathered batch or a replicated weight shows as
  an all-gather far larger than the layout needs."""
  comps: dict[str, list[str]] = {}
  entry, cur = None, None
  for line in hlo_text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      cur = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      comps[cur] = []
      entry = cur if line.startswith("ENTRY") else entry
    elif cur is not None and line.startswith("  "):
      comps[cur].append(line)
  out: dict[str, int] = {}

  def walk(name: str, trips: int, depth: int = 0) -> None:
    for line in comps.get(name, ()):
      m = re.match(r"\s+(?:ROOT )?%\S+ = (.+?) ([\w-]+)\(", line)
      if not m:
        continue
      result, op = m.groups()
      if op == "while" and depth < 8:
        body = re.search(r"body=%([\w.-]+)", line)
        if body:
          walk(body.group(1), trips * _trip_count(line, comps), depth + 1)
        continue
      if op in ("call", "conditional") and depth < 8:
        for sub in re.findall(r"(?:to_apply|branch_computations)=\{?%([\w.-]+)", line):
          walk(sub, trips, depth + 1)
        continue
      kind = op[:-len("-done")] if op.endswith("-done") else op  # an async pair: its done's
      if kind in _COLLECTIVES:                                      # result is the collective's
        out[kind] = out.get(kind, 0) + trips * _shape_bytes(result)
  if entry:
    walk(entry, 1)
  return out


__all__ = ["GPU_SPECS", "TPU_HBM", "AotError", "aot_dir", "platform", "gpu_target_config",
           "devices", "compiler_options", "dump_options", "compile_lowered", "usable_memory_bytes",
           "memory_report", "kernel_counts", "collective_bytes"]
