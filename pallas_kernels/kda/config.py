"""The Pallas GPU KDA kernels' static options: the op's settings (:class:`KdaOptions`) and their
tuning (:class:`KdaGpuConfig`, today's choices by shape and device in :func:`default_config`),
with the small helpers every kernel module shares (interpret mode, storage dtypes, pipeline
stages within shared memory).

Both are frozen and hashable: the custom VJP takes :class:`KdaOptions` (with its tuning) as a
static argument, so JAX's caches key on every option.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend
from pallas_kernels.kda import prep_vjp

SUB = 16  # sub-tile rows of the general path (its pair products and inverse blocks)
MAX_EXP = 85.0  # largest exponent a dense diagonal block may need (float32 max ~ e^88)

# Matrix-unit algorithms of the chunk kernels' products: three bf16 passes (~16 mantissa bits) or one
X3 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
BF16 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32

# Warps per chunk-local kernel (by pallas_call name); benchmarks/RESULTS.md, KDA runs 35-36 and
# 43-44 (``benchmarks/kda.py --sweep`` times others).
WARPS = {"kda_chunk_prep": 4, "kda_chunk_prep_bwd": 4, "kda_chunk_a": 8, "kda_chunk_a_sub": 8,
         "kda_chunk_wu": 4, "kda_chunk_dwy": 4, "kda_chunk_dqkg": 4, "kda_chunk_dqkg_sub": 4}
# (chunks per program, pipeline stages) of the dense chunk kernels that walk several chunks per
# program (the rest: (1, 1)); benchmarks/RESULTS.md, KDA runs 43-44.
CHUNK_LOOP = {"kda_chunk_a": (8, 3)}


def _frozen(mapping, defaults: Mapping) -> tuple:
  """``defaults`` updated by ``mapping`` (a dict or pairs) as sorted (name, value) pairs."""
  return tuple(sorted({**defaults, **dict(mapping)}.items()))


@dataclasses.dataclass(frozen=True)
class KdaGpuConfig:
  """Tuning of the Pallas GPU KDA kernels; none of it changes the maths beyond rounding.

  ``warps`` and ``chunk_loop`` take a dict of kernel names (or pairs) that updates
  :data:`WARPS` / :data:`CHUNK_LOOP`; the rest as documented per field.
  """
  warps: tuple = _frozen({}, WARPS)  # warps per chunk kernel (pallas_call name)
  # (chunks per program, pipeline stages) per chunk kernel: a program walks consecutive chunks,
  # Triton loading the next one's tiles while the current one's products run
  chunk_loop: tuple = _frozen({}, CHUNK_LOOP)
  slice_k: int = 64  # K channels per slice of the dense path's kernels
  dqkg_slice_k: int = 32  # K channels per program of kda_chunk_dqkg
  # The same for kda_chunk_dqkg_sub (the chunks redone on sub-chunks): its diagonal blocks'
  # pair-by-pair loop spills at 32 (ptxas for sm_90a, ``tools/triton_report.py``: 1652 / 2188
  # bytes of spill stores / loads per thread at 32, 212 / 212 at 16, the bounded gate's 216 /
  # 216 at 32)
  dqkg_slice_k_sub: int = 16
  # kda_chunk_dqkg forms the gate's cumulative sum as matrix-unit products (``dot_cumsum``)
  # instead of a scan across its rows' threads: fewer spills (benchmarks/RESULTS.md, KDA run 39)
  dqkg_dot_cumsum: bool = True
  # Matrix-unit algorithms of kda_chunk_dqkg's pair-product gradients ((P_qk: d q, d k), (P_kk:
  # d k_row, d k_col)). The gate gradient takes small differences of their large terms: P_qk's
  # need ~16 mantissa bits (three bf16 passes), P_kk's do not (``benchmarks/kda.py --emulate``).
  gate_dot: tuple = ((X3, X3), (BF16, BF16))
  # Backward intermediates stored in the kernels' dtype on the dense path (bf16 inputs), by
  # name: the chunk states "h", their gradients "dh", dV' "dvn", dY "dy" and kda_chunk_dqkg's
  # dq, dk "dqk" (the others float32). The gate gradient "dg" would lose accuracy in dA_log
  # (benchmarks/RESULTS.md, KDA runs 16-22).
  bf16_stores: frozenset = frozenset({"h", "dh", "dvn", "dy", "dqk"})
  # Software-pipeline stages of the Triton sequential passes' loads (fewer where they do not fit
  # the shared memory): the next chunks' factors load while the current chunk's products run
  recur_stages: int = 3
  v_tile: int = 64  # V tile of the Triton sequential passes
  # Sequential passes as Mosaic GPU kernels (``recurrence_mgpu``, where it takes the operands):
  # "mosaic" (both), "backward" (the backward's; its products are issued in pairs) or "triton"
  recurrence: str = "mosaic"
  mgpu_v_tile: int = 64  # V tile of the Mosaic passes
  # Ring slots the Mosaic passes ask for (``recurrence_mgpu.ring_slots`` caps them by SMEM)
  mgpu_stages: int = 3
  chunk_wu: str = "mosaic"  # WY factors: "mosaic" (``wu_mgpu`` where it applies) or "triton"
  # kda_chunk_a: "mosaic" (``a_mgpu`` where it applies: 64-token chunks, K = 64 or 128),
  # "bounded" (``a_mgpu`` for the bounded gate only) or "triton". ``default_config`` takes
  # "mosaic" where the Mosaic kernels run: a fifth off the forward (benchmarks/RESULTS.md, issue
  # 40 run 16)
  chunk_a: str = "triton"
  # kda_chunk_dqkg likewise: "mosaic" (``dqkg_mgpu`` where it applies: 64-token chunks, K and V 64
  # or 128), "bounded" (the bounded gate only) or "triton"; Triton's is 2.4x faster (KDA run 12)
  chunk_dqkg: str = "triton"
  # kda_chunk_dwy: "mosaic" (``dwy_mgpu`` where it applies: 64-token chunks, K and V 64 or 128,
  # bf16) or "triton"; the same time on an H100 (KDA run 12)
  chunk_dwy: str = "triton"
  # The Mosaic inverse's products as three bf16 products of split operands (about 16 bits, any
  # range) instead of one float16 product (11 bits, for entries of order 1)
  wu_split: bool = False
  prep_vjp: prep_vjp.Config = prep_vjp.Config()  # tiling of the pre-processing VJP kernel
  # Gates without the bounded gate's exponent bound (softplus, a precomputed g, a bounded gate
  # below -MAX_EXP / 8): "subchunk" (the dense kernels with 16-token sub-chunk references,
  # diagonal sub-blocks pair by pair: ``chunk_dense``) or "general" (``chunk_general``)
  unbounded: str = "subchunk"
  # "subchunk": rows per middle-row reference block that every chunk tries first, as the bounded
  # gate's blocks (at most the chunk); the chunks whose gates do not keep those exponents within
  # MAX_EXP (checked at run time) are redone on the sub-chunks, forward and backward
  speculative_rows: int = 32

  def __post_init__(self):
    object.__setattr__(self, "warps", _frozen(self.warps, WARPS))
    object.__setattr__(self, "chunk_loop", _frozen(self.chunk_loop, CHUNK_LOOP))
    object.__setattr__(self, "bf16_stores", frozenset(self.bf16_stores))
    if self.recurrence not in ("mosaic", "backward", "triton"):
      raise ValueError(f"KdaGpuConfig: recurrence {self.recurrence!r} must be 'mosaic', "
                       "'backward' or 'triton'")
    if self.chunk_wu not in ("mosaic", "triton"):
      raise ValueError(f"KdaGpuConfig: chunk_wu {self.chunk_wu!r} must be 'mosaic' or 'triton'")
    if self.chunk_a not in ("mosaic", "bounded", "triton"):
      raise ValueError(f"KdaGpuConfig: chunk_a {self.chunk_a!r} must be 'mosaic', 'bounded' or "
                       "'triton'")
    if self.chunk_dqkg not in ("mosaic", "bounded", "triton"):
      raise ValueError(f"KdaGpuConfig: chunk_dqkg {self.chunk_dqkg!r} must be 'mosaic', 'bounded' "
                       "or 'triton'")
    if self.chunk_dwy not in ("mosaic", "triton"):
      raise ValueError(f"KdaGpuConfig: chunk_dwy {self.chunk_dwy!r} must be 'mosaic' or 'triton'")
    if self.speculative_rows not in (16, 32, 64):
      raise ValueError(f"KdaGpuConfig: speculative_rows {self.speculative_rows} must be 16, 32 "
                       "or 64")
    if self.unbounded not in ("subchunk", "general"):
      raise ValueError(f"KdaGpuConfig: unbounded {self.unbounded!r} must be 'subchunk' or "
                       "'general'")

  def warps_of(self, name: str) -> int:
    return dict(self.warps)[name]

  def chunk_loop_of(self, name: str) -> tuple[int, int]:
    return dict(self.chunk_loop).get(name, (1, 1))


def interpret() -> bool:
  """Whether the kernels run in interpret mode (the target platform is not a GPU)."""
  return default_backend() != "gpu"


def _device_traits(device) -> tuple[bool, int]:
  """(Hopper, streaming multiprocessors) of ``device``; 132 SMs where it does not say."""
  hopper = (device.platform == "gpu"
            and str(getattr(device, "compute_capability", "")).startswith("9"))
  return hopper, int(getattr(device, "core_count", 0) or 132)


def default_config(v_shape, *, use_qk_l2norm: bool = False, beta_is_logit: bool = False,
                   device=None) -> KdaGpuConfig:
  """The tuning for values ``v_shape`` ``[B, T, HV, V]`` on ``device`` (a JAX device, or anything
  with its ``platform``, ``compute_capability`` and ``core_count``; default the first device).

  - The Mosaic GPU kernels where they run (the WY factors, ``kda_chunk_a``, the sequential
    passes): on Hopper, or in interpret mode.
  - Their V tile: 64 wide where its CTAs fit one wave on the SMs, else 128 (one CTA per (batch,
    head), single-buffered); the Mosaic forward pass only while its CTAs fit one wave (beyond
    that Triton's, whose programs overlap better), the backward's always (benchmarks/RESULTS.md,
    KDA runs 27-29 and 39).
  - Triton's V tile: at least 16 wide, halved while fewer than 128 programs would run.
  - The Mosaic inverse in float16 where keys are L2-normalised and beta a sigmoid (entries of
    order 1), else in split bf16.
  """
  bsz, _, hv, vd = v_shape
  heads = bsz * hv
  hopper, sms = _device_traits(device if device is not None else jax.devices()[0])
  mosaic = interpret() or hopper
  bv = min(64, vd)
  if heads * (vd // bv) > sms and vd % 128 == 0:
    bv = 128
  one_wave = interpret() or heads * (vd // bv) <= sms
  tile = min(vd, 64)
  while tile > 16 and heads * (vd // tile) < 128:
    tile //= 2
  return KdaGpuConfig(
      v_tile=tile, recurrence=("mosaic" if one_wave else "backward") if mosaic else "triton",
      mgpu_v_tile=bv, chunk_wu="mosaic" if mosaic else "triton",
      chunk_a="mosaic" if mosaic else "triton",
      wu_split=not (use_qk_l2norm and beta_is_logit))


@dataclasses.dataclass(frozen=True)
class KdaOptions:
  """The static settings of one KDA call (the custom VJP's nondifferentiable argument)."""
  scale: float
  chunk: int
  use_qk_l2norm: bool
  gate: str | None
  lower_bound: float
  beta_is_logit: bool
  diag_rows: int  # rows per reference block of the dense path (0: the general path)
  dtype: str  # matrix-unit operand dtype of the kernels
  save_residuals: bool = True  # the backward reuses the forward's intermediates
  # any gate: middle-row blocks of ``diag_rows`` rows where a chunk's gates allow (checked at run
  # time), else references at the start of each 16-row sub-chunk (every exponent <= 0),
  # diagonal sub-blocks pair by pair
  sub_chunks: bool = False
  tuning: KdaGpuConfig = KdaGpuConfig()


def diag_rows(gate: str | None, lower_bound: float, chunk: int) -> int:
  """Rows per reference block of the bounded gate's dense path: the largest block (at most the
  chunk) whose middle-row reference keeps every exponent within ``MAX_EXP``; 0 when even 16
  rows do not (or the gate is not bounded): then the general path."""
  if gate != "bounded":
    return 0
  return next((n for n in (64, 32, SUB) if n <= chunk and n / 2 * -lower_bound <= MAX_EXP), 0)


def chunk_path(gate: str | None, lower_bound: float, chunk: int,
               tuning: KdaGpuConfig) -> tuple[int, bool]:
  """(``diag_rows``, ``sub_chunks``) of :class:`KdaOptions`: the bounded gate's middle-row blocks
  where :func:`diag_rows` finds some, else the tuning's ``speculative_rows`` with the 16-row
  sub-chunks behind them (or, with the tuning's ``unbounded`` "general", the general path)."""
  rows = diag_rows(gate, lower_bound, chunk)
  if rows or tuning.unbounded == "general":
    return rows, False
  return min(tuning.speculative_rows, chunk), True


def store_dtype(opts: KdaOptions, name: str):
  """Storage dtype of the backward residual ``name`` (see ``KdaGpuConfig.bf16_stores``)."""
  bf16 = opts.diag_rows and opts.dtype == "bfloat16" and name in opts.tuning.bf16_stores
  return jnp.dtype(opts.dtype) if bf16 else jnp.float32


# Shared memory one program may use on the H200 (as Triton reports it) and what a pipelined
# kernel takes besides its stages' buffers.
SMEM, SMEM_OWN = 232448, 8192


def stages(want: int, stage_bytes: int) -> int:
  """Software-pipeline stages: ``want``, or as many buffers of ``stage_bytes`` (one loop step's
  loads) as fit beside the kernel's own shared memory (fewer for float32 inputs, K = 256)."""
  return max(1, min(want, (SMEM - SMEM_OWN) // max(stage_bytes, 1)))


def compiler_params(num_warps: int = 4, num_stages: int = 2):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
