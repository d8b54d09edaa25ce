"""Block AttnRes mixing (pallas_kernels.attn_res): the XLA reference and the Pallas GPU kernels
(interpret mode on CPU) against an independent float64 NumPy loop, values and gradients of every
source, proj and norm; input checks; the kernels' Triton lowering for an H200; one forward
kernel per call in the model's gradient under ``remat: dots_kernels``; the op under device
meshes (``python tests/test_attn_res_kernels.py mesh`` is that test's subprocess body)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err

from pallas_kernels import attn_res as ops
from pallas_kernels.attn_res import gpu

EPS = 1e-5
# A chunked tiling: 8-row blocks, 32-column chunks (several chunks, a partial last one when d is
# not a multiple of 32), 3 row blocks per backward program (dw partials from several programs,
# the last program with fewer blocks).
CHUNKED = gpu.Config(br=8, bd=32, bwd_br=8, bwd_bd=32, bwd_steps=3)


def np_attn_res(srcs, proj, norm, g, eps=EPS):
  """Float64 loop over tokens: out and the gradients of ``sum(out * g)`` wrt every source, proj
  and norm, through the softmax Jacobian ``diag(p) - p p^T`` and the quotient rule for
  ``logit_i = w . v_i / sigma_i`` with ``sigma_i = sqrt(mean(v_i^2) + eps)``."""
  srcs = [np.asarray(s, np.float64) for s in srcs]
  proj, norm, g = (np.asarray(a, np.float64) for a in (proj, norm, g))
  w = norm * proj
  bsz, t, d = srcs[0].shape
  out = np.zeros((bsz, t, d))
  dsrc = [np.zeros_like(s) for s in srcs]
  dw = np.zeros(d)
  for b in range(bsz):
    for i in range(t):
      v = np.stack([s[b, i] for s in srcs])  # [S, d]
      sigma = np.sqrt(np.mean(v * v, axis=1) + eps)
      logit = v @ w / sigma
      p = np.exp(logit - logit.max())
      p /= p.sum()
      out[b, i] = p @ v
      dp = v @ g[b, i]  # d sum(out g) / d p_k
      dlogit = (np.diag(p) - np.outer(p, p)) @ dp
      for k in range(len(srcs)):
        dlogit_dv = w / sigma[k] - (v[k] @ w) * v[k] / (d * sigma[k] ** 3)
        dlogit_dw = v[k] / sigma[k]
        dsrc[k][b, i] = p[k] * g[b, i] + dlogit[k] * dlogit_dv
        dw += dlogit[k] * dlogit_dw
  return out, dsrc, dw * norm, dw * proj


def operands(seed, s, shape, dtype):
  """S sources of different scales and offsets, proj ~ 2/sqrt(d) (logits of order one), norm
  around one, and a cotangent; all random, none zero."""
  rng = np.random.default_rng(seed)
  d = shape[-1]
  srcs = [jnp.asarray(rng.normal(size=shape) * (1 + i) + 0.3 * i, dtype) for i in range(s)]
  proj = jnp.asarray(rng.normal(size=d) * 2 / np.sqrt(d), jnp.float32)
  norm = jnp.asarray(1 + 0.5 * rng.normal(size=d), jnp.float32)
  g = jnp.asarray(rng.normal(size=shape), dtype)
  return srcs, proj, norm, g


def value_and_grads(f, srcs, proj, norm, g):
  """(out, d sources, d proj, d norm) of ``f`` for the cotangent g."""
  out, vjp = jax.jit(lambda s, p, n: jax.vjp(f, s, p, n))(srcs, proj, norm)
  ds, dp, dn = vjp(g)
  return out, list(ds), dp, dn


# (S, [B, T, d], dtype, kernel tiling): S = 1, 2, 5; B*T = 74 rows (not a multiple of the row
# block), T = 1; d = 80 (not a multiple of the column tile: a partial chunk) and 64; bf16 and f32.
CASES = [
    (1, (2, 37, 80), jnp.float32, gpu.Config()),
    (2, (2, 37, 80), jnp.bfloat16, CHUNKED),
    (2, (1, 1, 64), jnp.float32, gpu.Config()),
    (5, (2, 37, 80), jnp.float32, CHUNKED),
    (5, (2, 37, 64), jnp.bfloat16, gpu.Config()),
]


@pytest.mark.parametrize("s,shape,dtype,cfg", CASES,
                         ids=[f"S{c[0]}_{'x'.join(map(str, c[1]))}_{jnp.dtype(c[2]).name}_"
                              f"{'chunked' if c[3] == CHUNKED else 'default'}" for c in CASES])
def test_matches_numpy(s, shape, dtype, cfg):
  """Kernels (interpret mode) and the XLA reference vs the float64 loop; kernels vs reference."""
  srcs, proj, norm, g = operands(s, s, shape, dtype)
  want_out, want_ds, want_dp, want_dn = np_attn_res(srcs, proj, norm, g)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: outputs and source gradients rounded
  got = value_and_grads(lambda a, p, n: gpu.attn_res(a, p, n, EPS, cfg), srcs, proj, norm, g)
  ref = value_and_grads(lambda a, p, n: ops.attn_res(a, p, n, EPS, implementation="xla"),
                        srcs, proj, norm, g)
  assert got[0].dtype == dtype and all(x.dtype == dtype for x in got[1])
  assert got[2].dtype == jnp.float32 and got[3].dtype == jnp.float32
  for impl in (got, ref):
    assert rel_err(impl[0], want_out) < tol
    for a, b in zip(impl[1], want_ds):
      assert rel_err(a, b) < tol
    assert rel_err(impl[2], want_dp) < 1e-4 and rel_err(impl[3], want_dn) < 1e-4
  assert rel_err(got[0], ref[0]) < tol
  for a, b in zip(got[1], ref[1]):
    assert rel_err(a, b) < tol
  assert rel_err(got[2], ref[2]) < 1e-4 and rel_err(got[3], ref[3]) < 1e-4


def test_public_op_dispatches_and_checks_inputs():
  srcs, proj, norm, _ = operands(0, 2, (1, 3, 16), jnp.float32)
  np.testing.assert_allclose(ops.attn_res(srcs, proj, norm, EPS, implementation="pallas_gpu"),
                             ops.attn_res(srcs, proj, norm, EPS), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="no sources"):
    ops.attn_res([], proj, norm, EPS)
  with pytest.raises(ValueError, match="one shape"):
    ops.attn_res([srcs[0], srcs[1][:, :2]], proj, norm, EPS)
  with pytest.raises(ValueError, match="one shape"):
    ops.attn_res([srcs[0][0]], proj, norm, EPS)
  with pytest.raises(ValueError, match="proj"):
    ops.attn_res(srcs, proj[:8], norm, EPS)
  with pytest.raises(ValueError, match="norm"):
    ops.attn_res(srcs, proj, norm[None], EPS)
  with pytest.raises(ValueError, match="unknown implementation"):
    ops.attn_res(srcs, proj, norm, EPS, implementation="cuda")


def test_resolve():
  assert ops.resolve(None) == "xla"  # CPU
  assert ops.resolve("pallas") == "pallas_gpu"
  import pallas_kernels
  with pallas_kernels.target_platform("tpu"):
    assert ops.resolve("pallas") == "xla" and ops.resolve(None) == "xla"
  with pallas_kernels.target_platform("gpu"):
    assert ops.resolve(None) == "pallas_gpu"


def test_config_validates_the_implementation():
  from conftest import tiny_config
  from k3jax.config import ConfigError
  cfg = tiny_config("model.attn_res.implementation=pallas_gpu")
  assert cfg.model.attn_res.implementation == "pallas_gpu"
  with pytest.raises(ConfigError, match=r"model\.attn_res\.implementation"):
    tiny_config("model.attn_res.implementation=triton")


@pytest.mark.parametrize("s,d,cfg", [(2, 1024, gpu.Config()), (5, 1024, gpu.Config()),
                                     (3, 1000, gpu.Config(br=16, bd=256, bwd_br=16, bwd_bd=256))],
                         ids=["S2_d1024", "S5_d1024", "S3_d1000_chunked"])
def test_lowers_for_cuda(h200_lowering, s, d, cfg):
  """Forward and backward kernels through Pallas' Triton path for an H200, without a GPU, at the
  benchmark shape (inputs as shapes only) and with a partial column chunk."""
  srcs = tuple(jax.ShapeDtypeStruct((16, 4096, d), jnp.bfloat16) for _ in range(s))
  vec = jax.ShapeDtypeStruct((d,), jnp.float32)
  f = lambda a, p, n: gpu.attn_res(a, p, n, EPS, cfg)
  text = jax.jit(f).trace(srcs, vec, vec).lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "attn_res_fwd"' in text
  loss = lambda a, p, n: jnp.sum(f(a, p, n).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(srcs, vec, vec).lower(
      lowering_platforms=("cuda",)).as_text()
  assert 'name = "attn_res_bwd"' in text


@pytest.mark.parametrize("remat,fwd_runs", [("dots", 2), ("dots_kernels", 1)])
def test_remat_dots_kernels_keeps_the_mixture(h200_lowering, remat, fwd_runs):
  """In the gradient of the tiny preset's loss, every AttnRes call inside a decoder layer runs the
  forward kernel once under ``dots_kernels`` (its output kept), twice under ``dots`` (the layer
  recompute reruns it); the model-level mix (outside the remat) once; the backward kernel once
  per call. Traced, no GPU."""
  from conftest import tiny_config
  from test_model import _grad_kernel_counts
  cfg = tiny_config("model.attn_res.implementation=pallas_gpu", f"model.remat={remat}")
  n_layers = cfg.model.num_layers
  in_layers = 2 * n_layers - 1  # layer 0 has no blocks before its attention: no mix there
  counts = _grad_kernel_counts(cfg)
  assert counts["attn_res_fwd"] == fwd_runs * in_layers + 1
  assert counts["attn_res_bwd"] == in_layers + 1


@pytest.mark.slow
def test_on_meshes():
  """``k3jax.attn_res.attn_res`` with the kernels per device (batch, FSDP and sequence splits of
  8 simulated CPU devices) matches one device, values and gradients of sources, proj and norm."""
  root = str(Path(__file__).resolve().parents[1])
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=root)
  proc = subprocess.run([sys.executable, __file__, "mesh"], cwd=root, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(out) == 3
  for layout, err in out.items():
    assert err < 1e-5, (layout, err)


def _mesh_body():
  """Subprocess body of :func:`test_on_meshes`: prints {layout: max relative error}."""
  from k3jax.attn_res import attn_res
  from k3jax.config import MeshConfig
  from sharding import mesh as mesh_lib
  srcs, proj, norm, g = operands(7, 3, (8, 12, 64), jnp.float32)

  def step(s, p, n):
    out, vjp = jax.vjp(lambda s, p, n: attn_res(s, p, n, EPS, "pallas_gpu"), s, p, n)
    return [out, *jax.tree.leaves(vjp(g))]

  want = jax.jit(step)(srcs, proj, norm)
  errs = {}
  for name, sizes in (("data8", dict(data=8)), ("fsdp4_tensor2", dict(fsdp=4, tensor=2)),
                      ("data2_context4", dict(data=2, context=4))):
    with jax.set_mesh(mesh_lib.make_mesh(MeshConfig(**{"data": 1, **sizes}))):
      got = jax.jit(step)(srcs, proj, norm)
    errs[name] = max(float(rel_err(a, b)) for a, b in zip(got, want))
  print(json.dumps(errs))


if __name__ == "__main__" and sys.argv[1:] == ["mesh"]:
  _mesh_body()
