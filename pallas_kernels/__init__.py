"""Ops with a pure-JAX reference and Pallas backends, selected by ``implementation=``.

- :mod:`pallas_kernels.kda`: Kimi Delta Attention (chunked training/prefill and decode).
- :mod:`pallas_kernels.mla`: MLA attention (prefill/training) and paged latent decode.
- :mod:`pallas_kernels.moe`: grouped matmuls and token permutation for the MoE layer.
- :mod:`pallas_kernels.conv`: the KDA layer's causal short convolution + SiLU.
- :mod:`pallas_kernels.select`: the k-th smallest value of each column (exact QB's quantile).
- :mod:`pallas_kernels.glu`: the gated activations (SiTU-GLU, SiLU-GLU), packed gate and up.
- :mod:`pallas_kernels.logsumexp`: row log-sum-exp of the LM head's float32 logits.
- :mod:`pallas_kernels.attn_res`: Block Attention Residuals' softmax mixture over depth sources.
"""

import contextlib
import os

import jax
from jax.ad_checkpoint import checkpoint_name

KERNEL_OUTPUT = "kernel_output"


def kernel_output(x: jax.Array) -> jax.Array:
  """``x`` named :data:`KERNEL_OUTPUT` for the remat policies that keep kernel outputs (the
  model's ``dots_kernels``): a kernel whose primitive such a policy cannot see (a Mosaic GPU
  kernel is an ``mpmd_map`` inside a ``custom_vmap``) marks its output with it."""
  return checkpoint_name(x, KERNEL_OUTPUT)


# The platform kernels are built for inside target_platform (None: the default device's). A jit
# cache key includes it, so a trace made for one platform is never reused for another.
_TARGET = jax.make_user_context(default_value=None)


def default_backend() -> str:
  """'gpu', 'tpu' or 'cpu': the platform kernels are selected and built for; that of the default
  device unless inside :func:`target_platform`."""
  return _TARGET.value or jax.default_backend()


@contextlib.contextmanager
def target_platform(platform: str):
  """Selects and builds kernels for ``platform`` ('gpu', 'tpu' or 'cpu') instead of the default
  device's, interpret mode included: for tracing or lowering a program for another machine (e.g.
  :mod:`k3jax.plan` on a CPU host). What is traced inside cannot run here. The platform is part
  of JAX's jit cache key: a function traced inside is traced again outside."""
  if platform not in ("gpu", "tpu", "cpu"):
    raise ValueError(f"target_platform: expected 'gpu', 'tpu' or 'cpu', got {platform!r}")
  with _TARGET(platform):
    yield


def num_sms() -> int:
  """Streaming multiprocessors (cores) of the default device; 132 (an H100 / H200) where the
  device does not say."""
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def cpu_client_threads() -> int:
  """The threads of XLA's CPU client (as it sizes its pool): ``PJRT_NPROC`` (or ``NPROC``) where
  set, else the CPUs this process may run on; at least the number of CPU devices."""
  cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  for var in ("PJRT_NPROC", "NPROC"):
    try:
      cpus = int(os.environ[var])
      break
    except (KeyError, ValueError):
      pass
  return max(cpus or 1, len(jax.devices("cpu")))


def gpu_interpret(threads: int = 1):
  """GPU interpret mode's parameters for a Mosaic GPU kernel of ``threads`` warpgroups.

  The interpreter runs each warpgroup as an XLA CPU computation of its own, which blocks at the
  kernel's barriers until the others arrive, while the computation that calls the kernel may hold
  one more thread of the CPU client's pool. With fewer than ``threads + 1`` threads a warpgroup
  can wait forever for one that never starts (seen with 2 CPUs, in about one run of six), so that
  is an error here, raised before the kernel runs."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  have = cpu_client_threads()
  if threads > 1 and have < threads + 1:
    raise RuntimeError(
        f"GPU interpret mode runs this kernel's {threads} warpgroups as {threads} XLA CPU "
        f"computations beside their caller and needs {threads + 1} threads in XLA's CPU client; "
        f"this process has {have} (its CPUs): set PJRT_NPROC={max(8, threads + 1)} in the "
        "environment before JAX starts")
  return plgpu.InterpretGPUParams()


def resolve_implementation(op: str, implementation: str | None, known: tuple[str, ...],
                           defaults: dict[str, str]) -> str:
  """The concrete implementation of ``op`` on the current backend.

  ``None`` takes ``defaults[backend]``; ``"pallas"`` becomes ``"pallas_tpu"`` on TPU and
  ``"pallas_gpu"`` elsewhere; a name outside ``known`` is an error naming the op.
  """
  backend = default_backend()
  if implementation is None:
    implementation = defaults[backend if backend in defaults else "cpu"]
  if implementation == "pallas":
    implementation = "pallas_tpu" if backend == "tpu" else "pallas_gpu"
  if implementation not in known:
    raise ValueError(f"{op}: unknown implementation {implementation!r}; expected one of {known}")
  return implementation


def resolve_gpu_kernel(op: str, implementation: str | None, known: tuple[str, ...]) -> str:
  """:func:`resolve_implementation` for an op with a GPU kernel and no TPU kernel: ``None`` is
  ``"pallas_gpu"`` on GPU and ``"xla"`` elsewhere; ``"pallas"`` is ``"xla"`` on TPU (XLA's fusion
  of the reference) and ``"pallas_gpu"`` elsewhere (interpret mode on CPU)."""
  if implementation == "pallas" and default_backend() == "tpu":
    return "xla"
  return resolve_implementation(op, implementation, known,
                                {"gpu": "pallas_gpu", "tpu": "xla", "cpu": "xla"})
