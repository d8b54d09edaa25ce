"""GLU activations: SiTU-GLU (K3) and SiLU-GLU (Kimi Linear), in float32 with explicit VJPs.

:func:`glu` takes the gate and up halves apart (the dense GLU, whose halves may lie on different
tensor-parallel ranks); :func:`glu_packed` takes them packed as ``gu [..., 2F]``, as the routed
experts' grouped matmul writes them, and returns ``d gu`` whole (autodiff of two slices would
pad each half's cotangent and add them: an extra pass over ``[..., 2F]``).

``implementation`` (of both): ``"xla"`` (:mod:`pallas_kernels.glu.reference`),
``"pallas_gpu"`` (Triton kernels, :mod:`pallas_kernels.glu.gpu`; interpret mode on CPU),
``"pallas"`` (``pallas_gpu`` off TPU; on TPU, where XLA fuses the maths well, ``"xla"``) or
``None`` (``pallas_gpu`` on GPU, ``xla`` elsewhere); ``"pallas_tpu"`` means ``"xla"`` too, so a
MoE configured for the TPU kernels passes its setting through unchanged.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import default_backend, resolve_implementation
from pallas_kernels.glu import reference
from pallas_kernels.glu.reference import KINDS

IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu", "pallas")


def resolve(implementation: str | None) -> str:
  """``"xla"`` or ``"pallas_gpu"``: the concrete implementation on the current backend."""
  if implementation == "pallas_tpu" or (implementation == "pallas" and default_backend() == "tpu"):
    return "xla"
  return resolve_implementation("glu", implementation, IMPLEMENTATIONS,
                                {"gpu": "pallas_gpu", "tpu": "xla", "cpu": "xla"})


def _check(kind: str):
  if kind not in KINDS:
    raise ValueError(f"glu: unknown activation {kind!r}; expected one of {KINDS}")


def glu(a: jax.Array, b: jax.Array, kind: str = "situ", beta: float = 4.0,
        beta_lin: float = 25.0, *, implementation: str | None = None, config=None) -> jax.Array:
  """Gate ``a`` and up ``b`` ``[..., F]`` (or shapes that broadcast to one) -> ``h [..., F]`` in
  their dtype; differentiable.

  ``kind="situ"``: SiTU-GLU ``(beta * tanh(a / beta) * sigmoid(a)) * (beta_lin * tanh(b /
  beta_lin))``, bounded by ``beta * beta_lin`` (100 for K3), SwiGLU-like near the origin;
  ``kind="silu"``: ``silu(a) * b``. ``implementation`` and ``config`` as for :func:`glu_packed`."""
  _check(kind)
  try:
    shape = jnp.broadcast_shapes(a.shape, b.shape)
  except ValueError:
    raise ValueError(f"glu: gate {a.shape} and up {b.shape} do not broadcast to one "
                     "shape") from None
  dtype = jnp.result_type(a, b)
  a, b = jnp.broadcast_to(a, shape).astype(dtype), jnp.broadcast_to(b, shape).astype(dtype)
  return _glu(a, b, kind, float(beta), float(beta_lin), resolve(implementation), config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _glu(a, b, kind, beta, beta_lin, implementation, config):
  return _form("glu_pair_fwd", implementation, config)(a, b, kind, beta, beta_lin)


def _glu_fwd(a, b, kind, beta, beta_lin, implementation, config):
  # the kernel itself (see _glu_packed_fwd)
  return _form("glu_pair_fwd", implementation, config)(a, b, kind, beta, beta_lin), (a, b)


def _glu_bwd(kind, beta, beta_lin, implementation, config, res, g):
  a, b = res
  return _form("glu_pair_bwd", implementation, config)(a, b, g, kind, beta, beta_lin)


_glu.defvjp(_glu_fwd, _glu_bwd)


def _form(name: str, implementation: str, config):
  """The function ``name`` (``glu_fwd``, ``glu_bwd``, ``glu_pair_fwd``, ``glu_pair_bwd``) of
  ``implementation``: the reference's, or the GPU kernel's tiled by ``config`` (None: its
  default :class:`pallas_kernels.glu.gpu.Config`)."""
  if implementation == "xla":
    return getattr(reference, name)
  from pallas_kernels.glu import gpu
  return functools.partial(getattr(gpu, name), config=config or gpu.Config())


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _glu_packed(gu, f, kind, beta, beta_lin, implementation, config):
  return _form("glu_fwd", implementation, config)(gu, f, kind, beta, beta_lin)


def _glu_packed_fwd(gu, f, kind, beta, beta_lin, implementation, config):
  # The kernel itself, not ``_glu_packed`` (a nested custom_vjp call): a remat policy that keeps
  # Pallas outputs (``dots_kernels``) sees the pallas_call and keeps h.
  return _form("glu_fwd", implementation, config)(gu, f, kind, beta, beta_lin), gu


def _glu_packed_bwd(f, kind, beta, beta_lin, implementation, config, gu, g):
  d = _form("glu_bwd", implementation, config)(gu, g, f, kind, beta, beta_lin)
  pad = gu.shape[-1] - 2 * f  # the columns after the up half take no part: zero gradient
  return (jnp.pad(d, [(0, 0)] * (d.ndim - 1) + [(0, pad)]) if pad else d,)


_glu_packed.defvjp(_glu_packed_fwd, _glu_packed_bwd)


def glu_packed(gu: jax.Array, kind: str = "situ", beta: float = 4.0, beta_lin: float = 25.0, *,
               width: int | None = None, implementation: str | None = None,
               config=None) -> jax.Array:
  """:func:`glu` of ``gu [..., 2F]`` (gate then up) -> ``h [..., F]`` in gu's dtype;
  differentiable, its backward one pass that returns ``d gu`` whole. ``width``: F, where ``gu``
  has more columns after the up half (``[..., W >= 2F]``, a fused input projection's output;
  those columns are not read and get a zero gradient); None: half of gu's. ``config``: the GPU
  kernels' tiling (:class:`pallas_kernels.glu.gpu.Config`; None its defaults)."""
  _check(kind)
  w = gu.shape[-1]
  if width is None and w % 2:
    raise ValueError(f"glu_packed: gu {gu.shape} must have an even last dimension (gate, up)")
  f = w // 2 if width is None else width
  if not 0 < 2 * f <= w:
    raise ValueError(f"glu_packed: width {width} does not fit gu {gu.shape} twice")
  return _glu_packed(gu, f, kind, float(beta), float(beta_lin), resolve(implementation), config)


__all__ = ["glu", "glu_packed", "resolve", "IMPLEMENTATIONS", "KINDS"]
