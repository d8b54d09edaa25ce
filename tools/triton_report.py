"""Registers, spills and instruction mix of our Pallas Triton kernels, without a GPU.

The numbers a kernel change moves before it is timed on a card: ptxas's registers and spill
bytes per thread, the shared memory Triton allocates, how many programs those let share an SM,
and the SASS instruction classes (matrix-unit, MUFU, float, integer, shared and
local memory) of each ``pallas_call``, compiled for the H200 (sm_90a) on the CPU. Two steps, in
two environments:

  # 1. the project's venv: lower the op for CUDA and write each kernel's Triton IR
  python tools/triton_report.py dump OUT [--op kda|glu|logsumexp|conv] [--set NAME=VALUE]
      [--gate bounded|softplus|none]  # KDA's gate kind (none: a precomputed log decay)
  # 2. a venv with Triton's wheel (it brings ptxas and cuobjdump): compile and report
  python -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.6.0
  /tmp/tvenv/bin/python tools/triton_report.py report OUT [OTHER_OUT ...]

``report`` with several folders prints them side by side (a change against its base: dump the
base from a ``git archive`` of it). Instruction counts are static (a loop body counts once). The
Triton wheel stands in for jaxlib's own Triton (XLA's fork): registers and spills come out near
Nsight Compute's on the H200 (2026-12-03, the KDA kernels at B1 T16384 H32: 255 / 255 for chunk_a,
222 / 244 chunk_wu, 128 / 128 the forward recurrence, 96 / 128 the pre-processing VJP, spills in
chunk_dwy and chunk_dqkg alone in both), but they can disagree: ``exp2`` for ``exp`` cut
chunk_a's instructions here by a quarter (6000 -> 4512) while on the card it made chunk_a 15%
slower. A guide for what to time, not a timing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The benchmark shapes of each op: [B, T, H, K] for KDA (bf16, the K3 gate), [rows, 2F] for the
# GLU, [tokens, vocab] for the log-sum-exp, [B, T, C] for the short convolution.
SHAPES = {"kda": (1, 16384, 32, 128), "glu": (524288, 1024), "logsumexp": (4096, 163840),
          "conv": (16, 4096, 1024)}


def _configs(name):
  """The default kernel config of op ``name`` whose fields ``--set`` replaces (None: the op has
  none here)."""
  if name == "kda":  # the tuning for the GPU's kernels (under target_platform), K3's options
    from pallas_kernels.kda.config import default_config
    return default_config(SHAPES["kda"], use_qk_l2norm=True, beta_is_logit=True)
  if name == "glu":
    from pallas_kernels.glu import gpu
    return gpu.Config()
  if name == "logsumexp":
    from pallas_kernels.logsumexp import gpu
    return gpu.default_config("float32")
  if name == "conv":
    from pallas_kernels.conv import gpu
    return gpu.Config()
  return None


def _ops(name, config, gate="bounded"):
  """(function, abstract arguments) whose lowering holds the op's kernels, forward and
  backward, built with the kernel ``config`` (KDA: with the gate kind ``gate``, "none" for a
  precomputed log decay)."""
  import jax
  import jax.numpy as jnp
  sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  shape = SHAPES[name]
  if name == "kda":
    from pallas_kernels.kda import kda
    b, t, h, kd = shape

    fused = gate != "none"

    def loss(q, k, v, g, beta, a_log, dt_bias):
      o, _ = kda(q, k, v, g, beta, use_qk_l2norm=True, A_log=a_log if fused else None,
                 dt_bias=dt_bias if fused else None, gate=gate if fused else None,
                 beta_is_logit=True, implementation="pallas_gpu", config=config)
      return jnp.sum(o.astype(f32))

    args = [sds((b, t, h, kd), bf16)] * 4 + [sds((b, t, h), bf16), sds((h,), f32),
                                              sds((h * kd,), f32)]
    return jax.grad(loss, argnums=tuple(range(7))), args
  if name == "glu":
    from pallas_kernels.glu import glu_packed
    fn = lambda gu: jnp.sum(glu_packed(gu, "situ", implementation="pallas_gpu",
                                       config=config).astype(f32))
    return jax.grad(fn), [sds(shape, bf16)]
  if name == "logsumexp":
    from pallas_kernels.logsumexp import logsumexp
    return (lambda x: logsumexp(x, implementation="pallas_gpu", config=config)), [sds(shape, f32)]
  if name == "conv":
    from pallas_kernels.conv import gpu
    b, t, c = shape
    fn = lambda x, w: jnp.sum(gpu.causal_conv_silu(x, w, config=config).astype(f32))
    return jax.grad(fn, argnums=(0, 1)), [sds((b, t, c), bf16), sds((4, c), bf16)]
  raise SystemExit(f"triton_report: unknown op {name!r}; one of {sorted(SHAPES)}")


def dump(out, op, sets, gate="bounded"):
  """Lowers ``op`` for an H200 on the CPU and writes each Triton kernel's IR (``NAME.ttir``) and
  its launch options (``kernels.json``) to ``out``."""
  sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
  import jax
  from jax._src.interpreters import mlir
  from jax._src.pallas.triton import gpu_info, lowering

  import pallas_kernels
  from timing import replace_options
  gpu_info.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  with pallas_kernels.target_platform("gpu"):
    config = _configs(op)
  if sets and config is None:
    raise SystemExit(f"triton_report: --set: no kernel config of {op} here")
  try:
    config = replace_options(config, sets) if sets else config
  except ValueError as e:
    raise SystemExit(f"triton_report: {e}") from None
  fn, args = _ops(op, config, gate)
  os.makedirs(out, exist_ok=True)
  last, kernels = {}, {}
  lower_module = lowering.lower_jaxpr_to_triton_module
  custom_call = mlir.custom_call

  def keep_module(*a, **kw):
    res = lower_module(*a, **kw)
    last["asm"] = res.module.operation.get_asm(large_elements_limit=16)
    return res

  def keep_call(call_target_name, *a, backend_config="", **kw):
    if call_target_name == "__gpu$xla.gpu.triton":
      name = backend_config["name"].value
      base, n = name, 1
      while name in kernels:  # the same kernel lowered twice (e.g. forward and recompute)
        n += 1
        name = f"{base}__{n}"
      with open(os.path.join(out, name + ".ttir"), "w") as f:
        f.write(last["asm"])
      kernels[name] = {k: backend_config[k].value for k in ("num_warps", "num_stages")}
    return custom_call(call_target_name, *a, backend_config=backend_config, **kw)

  lowering.lower_jaxpr_to_triton_module = keep_module
  mlir.custom_call = keep_call
  try:
    with pallas_kernels.target_platform("gpu"):  # the real lowering, not interpret mode
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    lowering.lower_jaxpr_to_triton_module = lower_module
    mlir.custom_call = custom_call
  with open(os.path.join(out, "kernels.json"), "w") as f:
    json.dump({"op": op, "shape": SHAPES[op], "sets": sets, "gate": gate, "kernels": kernels}, f,
              indent=1)
  print(f"{len(kernels)} kernels of {op} in {out}: {', '.join(kernels)}")


# SASS opcode -> class, by prefix (the first match wins)
_CLASSES = [("mma", ("HGMMA", "HMMA", "WARPGROUP")), ("mufu", ("MUFU",)),
            ("fp32", ("FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "FCHK", "FRND", "F2F",
                      "F2I", "I2F", "FSWZADD")),
            ("int/logic", ("IMAD", "IADD", "ISETP", "LOP", "SHF", "SEL", "IMNMX", "LEA", "PRMT",
                           "SGXT", "BMSK", "IABS", "FLO", "POPC", "PLOP", "P2R", "R2P", "VIADD",
                           "IDX")),
            ("shared", ("LDS", "STS", "LDSM", "STSM", "ATOMS")),
            ("local", ("LDL", "STL")), ("global", ("LDG", "STG", "LDGSTS", "UBLKCP", "UTMA",
                                                   "LDGDEPBAR", "RED", "ATOMG")),
            ("shuffle/sync", ("SHFL", "BAR", "SYNCS", "DEPBAR", "WARPSYNC", "MEMBAR", "FENCE",
                              "ELECT", "VOTE")),
            ("move", ("MOV", "UMOV", "CS2R", "S2R", "S2UR", "R2UR", "ULDC", "LDC"))]


def _sass_classes(sass):
  counts = collections.Counter()
  for line in sass.splitlines():
    m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    if not m:
      continue
    op = m.group(1)
    cls = next((c for c, pre in _CLASSES if op.startswith(pre)), "other")
    counts[cls] += 1
    counts["total"] += 1
  return counts


# The H200's (sm_90) per-SM limits that bound how many programs share an SM: registers (allocated
# per warp in units of 256), shared memory (228 KiB per SM, 1 KiB of it reserved per program),
# threads and programs.
SM_REGS, SM_SMEM, SM_THREADS, SM_PROGRAMS = 65536, 233472, 2048, 32


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
  """How many programs of ``warps`` warps, ``regs`` registers per thread and ``smem`` bytes of
  shared memory fit on one sm_90 SM at once."""
  per_warp = -(-regs * 32 // 256) * 256
  bounds = [SM_REGS // (per_warp * warps), SM_THREADS // (32 * warps), SM_PROGRAMS]
  if smem:
    bounds.append(SM_SMEM // (smem + 1024))
  return min(bounds)


def _compile_one(path, meta, bin_dir):
  """(registers, spill stores, spill loads, shared memory bytes, SASS classes) of one kernel's
  IR for sm_90a."""
  import triton
  from triton.backends.compiler import GPUTarget
  k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                     options={"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]})
  with tempfile.TemporaryDirectory() as tmp:
    ptx = os.path.join(tmp, "k.ptx")
    with open(ptx, "w") as f:
      f.write(k.asm["ptx"])
    info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx,
                           "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    log = info.stderr + info.stdout
    sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass",
                           os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stdout
  num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0
  return (num(r"Used (\d+) registers"), num(r"(\d+) bytes spill stores"),
          num(r"(\d+) bytes spill loads"), k.metadata.shared, _sass_classes(sass))


def report(folders):
  """One table per kernel name over ``folders`` (side by side)."""
  import triton
  bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  metas = []
  for d in folders:
    with open(os.path.join(d, "kernels.json")) as f:
      metas.append(json.load(f))
  names = list(dict.fromkeys(n for m in metas for n in m["kernels"]))
  classes = [c for c, _ in _CLASSES] + ["other", "total"]
  print(f"Triton {triton.__version__}, sm_90a; folders: " + ", ".join(folders))
  print("| kernel | folder | warps x stages | registers | spill st / ld B | shared B | "
        "programs / SM | " + " | ".join(classes) + " |")
  print("|---" * (7 + len(classes)) + "|")
  for name in names:
    for d, meta in zip(folders, metas):
      if name not in meta["kernels"]:
        continue
      km = meta["kernels"][name]
      try:
        regs, st, ld, smem, counts = _compile_one(os.path.join(d, name + ".ttir"), km, bin_dir)
      except Exception as e:  # noqa: BLE001 - the other kernels are still worth reporting
        print(f"| {name} | {d} | compile failed: {repr(e)[:300]} |")
        continue
      print(f"| {name} | {os.path.basename(os.path.normpath(d))} | {km['num_warps']} x "
            f"{km['num_stages']} | {regs} | {st} / {ld} | {smem} | "
            f"{programs_per_sm(regs, smem, km['num_warps'])} | "
            + " | ".join(str(counts.get(c, 0)) for c in classes) + " |", flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("dump", help="lower an op for CUDA and write its kernels' Triton IR")
  d.add_argument("out")
  d.add_argument("--op", default="kda", choices=sorted(SHAPES))
  d.add_argument("--gate", default="bounded", choices=("bounded", "softplus", "none"),
                 help="KDA's gate kind (none: a precomputed log decay)")
  d.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                 help="a field of the op's kernel config (a Python literal)")
  r = sub.add_parser("report", help="compile dumped kernels for sm_90a and report")
  r.add_argument("folders", nargs="+")
  a = p.parse_args()
  if a.cmd == "dump":
    dump(a.out, a.op, a.set, a.gate)
  else:
    report(a.folders)


if __name__ == "__main__":
  main()
