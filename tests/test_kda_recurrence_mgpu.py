"""The Mosaic GPU sequential passes of the chunked KDA (``pallas_kernels.kda.recurrence_mgpu``), in
GPU interpret mode on CPU, against float64 NumPy loops with the kernels' bf16 roundings of the
matrix-unit operands (the state entering each chunk, V' and dV'); and their CUDA lowering at the
benchmark shape (layout inference, shared memory)."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numerics import max_rel_err
from pallas_kernels.kda import config, recurrence, recurrence_mgpu

C = recurrence_mgpu.CHUNK
BF16 = jnp.bfloat16
# An H200 as ``config.default_config`` reads a device
H200 = types.SimpleNamespace(platform="gpu", compute_capability="9.0", core_count=132)


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _bf(x):
  """float64 values rounded to bf16, as the kernels hand them to wgmma."""
  return _f64(jnp.asarray(x, jnp.float32).astype(BF16))


def _factors(seed, b, nc, hv, kd, vd):
  rng = np.random.default_rng(seed)
  tok = lambda d, s=0.3: jnp.asarray(rng.normal(size=(b, nc * C, hv, d)) * s, BF16)
  # W and KD small enough that the state stays O(1) (KD^T W contracts): a growing state would
  # turn single bf16 rounding flips into large differences
  w, qg, kdec, u, aqk = tok(kd, 0.03), tok(kd), tok(kd, 0.03), tok(vd), tok(C)
  gc = jnp.asarray(rng.uniform(0.3, 1.0, size=(b, nc, hv, kd)), jnp.float32)
  state = jnp.asarray(rng.normal(size=(b, hv, kd, vd)), jnp.float32)
  return w, u, qg, aqk, kdec, gc, state


def _forward_loop(w, u, qg, aqk, kdec, gc, s0):
  w, u, qg, a, kd, gc = map(_f64, (w, u, qg, aqk, kdec, gc))
  b, tp, hv, _ = w.shape
  nc = tp // C
  s = _f64(s0).copy()
  o, vn = np.zeros_like(u), np.zeros_like(u)
  h = np.zeros((b, nc, hv) + s.shape[2:])
  after = np.zeros_like(h)  # the state leaving each chunk, unrounded
  for bi in range(b):
    for hi in range(hv):
      for ci in range(nc):
        r = slice(ci * C, (ci + 1) * C)
        sb = _bf(s[bi, hi])
        h[bi, ci, hi] = sb
        v_new = _bf(u[bi, r, hi] - w[bi, r, hi] @ sb)
        vn[bi, r, hi] = v_new
        o[bi, r, hi] = qg[bi, r, hi] @ sb + a[bi, r, hi] @ v_new
        s[bi, hi] = gc[bi, ci, hi][:, None] * s[bi, hi] + kd[bi, r, hi].T @ v_new
        after[bi, ci, hi] = s[bi, hi]
  return o, s, h, vn, after


def _backward_loop(do, qg, aqk, kdec, w, gc, dst):
  do, qg, a, kd, w, gc = map(_f64, (do, qg, aqk, kdec, w, gc))
  b, tp, hv, _ = w.shape
  nc = tp // C
  ds = _f64(dst).copy()
  dvn = np.zeros_like(do)
  dh = np.zeros((b, nc, hv) + ds.shape[2:])
  for bi in range(b):
    for hi in range(hv):
      for ci in reversed(range(nc)):
        r = slice(ci * C, (ci + 1) * C)
        db = _bf(ds[bi, hi])
        dh[bi, ci, hi] = db
        d = _bf(a[bi, r, hi].T @ do[bi, r, hi] + kd[bi, r, hi] @ db)
        dvn[bi, r, hi] = d
        ds[bi, hi] = (gc[bi, ci, hi][:, None] * ds[bi, hi] + qg[bi, r, hi].T @ do[bi, r, hi]
                      - w[bi, r, hi].T @ d)
  return dvn, dh, ds


def _close(got, want, tol, name):
  err = max_rel_err(_f64(got), want)
  assert err < tol, f"{name}: max error {err:.2e} of the largest value"


# (batch, chunks, value heads, K, V, V tile, ring slots): one chunk (fewer chunks than the
# prologue fetches), two and five (both S / V' buffers reused, the ring wrapping), two V tiles;
# K = 128 with a 128-wide V tile: single-buffered S / V' / O, dS / dV' (three chunks reuse them).
# The state checkpoints every 2 chunks beside the stores of h and V', and every chunk alone
@pytest.mark.slow
@pytest.mark.parametrize("b,nc,hv,kd,vd,bv,stages", [
    (1, 1, 1, 64, 32, 32, 3), (2, 2, 2, 64, 16, 16, 2), (1, 5, 1, 128, 64, 32, 3),
    (1, 3, 1, 128, 128, 128, 3)])
def test_forward_and_backward_match_float64_loops(b, nc, hv, kd, vd, bv, stages):
  w, u, qg, aqk, kdec, gc, s0 = _factors(nc + kd, b, nc, hv, kd, vd)
  o_want, st_want, h_want, vn_want, after = _forward_loop(w, u, qg, aqk, kdec, gc, s0)
  for store, every in ((False, 0), (True, 0), (True, 2), (False, 1)):
    outs = recurrence_mgpu.recurrence_fwd(w, u, qg, aqk, kdec, gc, s0, out_dtype=BF16,
                                          store=store, block_v=bv, stages=stages, interpret=True,
                                          every=every)
    assert len(outs) == 2 + 2 * store + bool(every)
    _close(outs[0], o_want, 8e-3, "o")  # bf16 output
    _close(outs[1], st_want, 1e-4, "final state")
    if store:
      _close(outs[2], h_want, 1e-3, "h")  # the same bf16 values up to rounding flips
      _close(outs[3], vn_want, 1e-3, "vn")
    if every:  # float32 states after chunks every - 1, 2 every - 1, ... (none if nc < every)
      states = outs[-1]
      assert states.shape == (b, max(nc // every, 1), hv, kd, vd)
      assert states.dtype == jnp.float32
      for m in range(nc // every):
        _close(states[:, m], after[:, (m + 1) * every - 1], 1e-4, f"state {m} (every {every})")
  do = u[..., ::-1]  # any bf16 [B, Tp, HV, V] tile other than U
  dvn, dh, ds0 = recurrence_mgpu.recurrence_bwd(do, qg, aqk, kdec, w, gc, s0, block_v=bv,
                                                stages=stages, interpret=True)
  dvn_want, dh_want, ds0_want = _backward_loop(do, qg, aqk, kdec, w, gc, s0)
  _close(dvn, dvn_want, 8e-3, "dvn")
  _close(dh, dh_want, 8e-3, "dh")
  _close(ds0, ds0_want, 1e-4, "ds0")


def test_kernels_lower_for_cuda(h200_lowering):
  """Both passes inside the op at the benchmark shape (B1 T16384 H32 K128, bf16), lowered for
  an H200 on the CPU: Mosaic GPU's layout inference and shared-memory limit pass."""
  from pallas_kernels.kda import kda
  b, t, h, kd = 1, 16384, 32, 128
  tuning = config.default_config((b, t, h, kd), use_qk_l2norm=True, beta_is_logit=True,
                                 device=H200)

  def loss(q, k, v, g, beta):
    o, _ = kda(q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.zeros(h), dt_bias=jnp.zeros(h * kd),
               gate="bounded", beta_is_logit=True, implementation="pallas_gpu", config=tuning)
    return jnp.sum(o.astype(jnp.float32))

  args = [jax.ShapeDtypeStruct((b, t, h, kd), BF16)] * 4 + [jax.ShapeDtypeStruct((b, t, h), BF16)]
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    text = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
  for name in ("kda_fwd_recurrence_mgpu", "kda_bwd_recurrence_mgpu"):
    assert name in text, f"{name} is not in the lowered module"
  assert 'name = "kda_fwd_recurrence"' not in text  # the Triton passes are not used


@pytest.mark.parametrize("b,t,h", [(1, 16384, 32), (1, 65536, 16), (4, 4096, 32)])
def test_states_forward_lowers_on_the_mosaic_pass(h200_lowering, b, t, h):
  """``output_states_every`` (serving's prefix states) at the benchmark shapes takes the Mosaic
  forward pass too, lowered for an H200 on the CPU (the 64-wide V tile of B1 H32 and H16, the
  128-wide of B4 H32)."""
  from pallas_kernels.kda import kda
  kd = 128
  tuning = config.default_config((b, t, h, kd), use_qk_l2norm=True, beta_is_logit=True,
                                 device=H200)
  fn = lambda q, k, v, g, beta: kda(
      q, k, v, g, beta, use_qk_l2norm=True, A_log=jnp.zeros(h), dt_bias=jnp.zeros(h * kd),
      gate="softplus", beta_is_logit=True, implementation="pallas_gpu", config=tuning,
      output_states_every=4)
  args = [jax.ShapeDtypeStruct((b, t, h, kd), BF16)] * 4 + [jax.ShapeDtypeStruct((b, t, h), BF16)]
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "kda_fwd_recurrence_mgpu" in text
  assert 'name = "kda_fwd_recurrence"' not in text


def test_unsupported_factors_take_the_triton_passes():
  """float32 factors, 32-token chunks, float32 stores or K = 256: the Triton kernels."""
  w = jax.ShapeDtypeStruct((1, 64, 1, 64), BF16)
  assert recurrence_mgpu.supported(w, w, 64, BF16)
  assert not recurrence_mgpu.supported(jax.ShapeDtypeStruct((1, 64, 1, 64), jnp.float32), w, 64)
  assert not recurrence_mgpu.supported(w, w, 32)
  assert not recurrence_mgpu.supported(w, w, 64, jnp.float32)
  assert not recurrence_mgpu.supported(jax.ShapeDtypeStruct((1, 64, 1, 256), BF16), w, 64)


@pytest.mark.parametrize("kd,bv", [(64, 16), (128, 32), (128, 64), (128, 128)])
def test_every_supported_tiling_fits_shared_memory(kd, bv):
  """Both passes at each supported K and V tile, at most ``ring_slots`` slots, lowered for an
  H200 (Mosaic GPU refuses more than 227 KiB of SMEM per CTA), the forward also with the state
  checkpoints; double-buffered up to a 64-wide V tile at K = 128, single-buffered at 128."""
  assert recurrence_mgpu.buffers(kd, bv, True) == recurrence_mgpu.buffers(kd, bv, False) == (
      1 if kd * bv > 128 * 64 else 2)
  sds = jax.ShapeDtypeStruct
  tok = lambda d: sds((1, 256, 2, d), BF16)
  gc, state = sds((1, 4, 2, kd), jnp.float32), sds((1, 2, kd, 2 * bv), jnp.float32)
  fwd = lambda *a, every: recurrence_mgpu.recurrence_fwd(
      *a, out_dtype=BF16, store=True, block_v=bv, stages=8, interpret=False, every=every)
  bwd = lambda *a: recurrence_mgpu.recurrence_bwd(*a, block_v=bv, stages=8, interpret=False)
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  fwd_args = (tok(kd), tok(2 * bv), tok(kd), tok(C), tok(kd), gc, state)
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    for fn, args in ((functools.partial(fwd, every=0), fwd_args),
                     (functools.partial(fwd, every=1), fwd_args),
                     (bwd, (tok(2 * bv), tok(kd), tok(C), tok(kd), tok(kd), gc, state))):
      assert "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _options(tuning):
  return config.KdaOptions(scale=1.0, chunk=64, use_qk_l2norm=True, gate="bounded",
                           lower_bound=-5.0, beta_is_logit=True, diag_rows=32, dtype="bfloat16",
                           tuning=tuning)


def test_default_takes_the_mosaic_forward_within_one_wave(h200_lowering):
  """The default tuning on a Hopper GPU: the Mosaic backward always; the Mosaic forward only
  while its CTAs (batch x value heads x V tiles) fit one per SM, else Triton's. With the
  default V tile, 128 heads of V = 128 fit one wave at 128 wide; 256 do not."""
  sds = lambda b, hv, d: jax.ShapeDtypeStruct((b, 4096, hv, d), BF16)

  def tile(x, *stored, forward=False, **changes):
    tuning = dataclasses.replace(config.default_config(x.shape, device=H200), **changes)
    return recurrence.mosaic_tile(_options(tuning), x, x, *stored, forward=forward)

  assert tile(sds(16, 8, 128), BF16, forward=True) == 128
  assert tile(sds(32, 8, 128), BF16, forward=True) == 0
  assert tile(sds(32, 8, 128), BF16, BF16) == 128
  one_wave, two_waves = sds(1, 32, 128), sds(200, 1, 64)  # 64-wide tiles: 64 / 200 CTAs
  assert tile(one_wave, BF16, forward=True) == 64
  assert tile(two_waves, BF16, forward=True) == 0
  assert tile(two_waves, BF16, BF16) == 64
  for mode, want in (("triton", 0), ("mosaic", 64)):
    assert tile(two_waves, BF16, forward=True, recurrence=mode) == want
  # off Hopper (and not in interpret mode) neither pass
  cpu = types.SimpleNamespace(platform="cpu")
  assert config.default_config(one_wave.shape, device=cpu).recurrence == "triton"


@pytest.mark.slow
def test_single_buffered_tile_gives_the_same_op_results(monkeypatch):
  """The whole op (forward, final state, every gradient) at K = V = 128 with the 128-wide V tile
  (single-buffered passes) equals the default 64-wide tiles up to rounding: the V columns of the
  state are independent, so only the buffering (and the host's summation order) differs."""
  from pallas_kernels.kda import kda
  rng = np.random.default_rng(5)
  b, t, h, kd = 1, 130, 1, 128
  x = [jnp.asarray(rng.normal(size=(b, t, h, kd)), BF16) for _ in range(4)]
  beta = jnp.asarray(rng.normal(size=(b, t, h)), BF16)
  seg = jnp.asarray((np.arange(t) >= 70)[None], jnp.int32)
  wo = jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32)

  def loss(*a, tuning):
    o, s = kda(*a, use_qk_l2norm=True, A_log=jnp.full((h,), 0.3), dt_bias=jnp.zeros(h * kd),
               gate="bounded", beta_is_logit=True, segment_ids=seg, output_final_state=True,
               implementation="pallas_gpu", config=tuning)
    return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(s)

  tiles = []  # the V tile each pass was traced with: both runs must reach the Mosaic passes
  for name in ("recurrence_fwd", "recurrence_bwd"):
    run = getattr(recurrence_mgpu, name)
    monkeypatch.setattr(recurrence_mgpu, name,
                        lambda *a, _run=run, **kw: tiles.append(kw["block_v"]) or _run(*a, **kw))
  results = []
  default = config.default_config((b, t, h, kd), use_qk_l2norm=True, beta_is_logit=True)
  for tile in (64, 128):
    tuning = dataclasses.replace(default, mgpu_v_tile=tile)
    results.append(jax.jit(jax.value_and_grad(functools.partial(loss, tuning=tuning),
                                              argnums=tuple(range(5))))(*x, beta))
  assert tiles == [64, 64, 128, 128]
  (l64, g64), (l128, g128) = results
  # equal up to rounding: in interpret mode the tiles' products run through the host's BLAS,
  # whose blocking (so the summation order) depends on the product's shape and the CPU (bit for
  # bit on the hosts until 2026-12-06, one float32 ulp of the loss on 2026-12-07's AMD EPYC)
  np.testing.assert_allclose(float(l64), float(l128), rtol=1e-6)
  for a, c in zip(g64, g128):
    a, c = np.asarray(a, np.float32), np.asarray(c, np.float32)
    assert np.abs(a - c).max() <= 2 ** -7 * np.abs(c).max(), np.abs(a - c).max()  # bf16 rounding


def test_interpret_mode_needs_a_cpu_thread_per_warpgroup_beside_the_caller(monkeypatch):
  """With fewer XLA CPU client threads than warpgroups + 1, GPU interpret mode could hang (the
  forward: two warpgroups; on 2 CPUs it did, one run in six): the op raises, naming PJRT_NPROC,
  before it runs; the single-warpgroup backward needs no more than one thread."""
  import pallas_kernels
  w, u, qg, aqk, kdec, gc, s0 = _factors(5, 1, 1, 1, 64, 32)
  fwd = lambda: recurrence_mgpu.recurrence_fwd(w, u, qg, aqk, kdec, gc, s0, out_dtype=BF16,
                                               store=False, block_v=32, stages=2, interpret=True)
  monkeypatch.setenv("PJRT_NPROC", "2")
  with pytest.raises(RuntimeError, match="2 warpgroups .* needs 3 threads .* has 2 .* PJRT_NPROC=8"):
    fwd()
  monkeypatch.setenv("PJRT_NPROC", "1")
  recurrence_mgpu.recurrence_bwd(u, qg, aqk, kdec, w, gc, s0, block_v=32, stages=2, interpret=True)
  monkeypatch.setenv("PJRT_NPROC", "3")
  _close(fwd()[1], _forward_loop(w, u, qg, aqk, kdec, gc, s0)[1], 1e-4, "final state")
  # unset, XLA takes the CPUs this process may run on; NPROC is its second name
  monkeypatch.delenv("PJRT_NPROC")
  monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
  assert pallas_kernels.cpu_client_threads() == 2
  monkeypatch.setenv("NPROC", "4")
  assert pallas_kernels.cpu_client_threads() == 4
  monkeypatch.setenv("NPROC", "3")
  with pytest.raises(RuntimeError, match="3 warpgroups .* needs 4 threads .* has 3"):
    pallas_kernels.gpu_interpret(3)


def test_default_v_tile_widens_to_one_cta_per_head_only_past_one_wave():
  """The default Mosaic V tile: 64 wide while its CTAs fit the GPU's SMs, 128 wide (one CTA per
  (batch, head)) past that, never wider than V; a given one is taken as given."""
  v_tile = lambda heads, vd: config.default_config((1, 64, heads, vd), device=H200).mgpu_v_tile
  assert v_tile(32, 128) == 64    # B1 H32: 64 CTAs
  assert v_tile(66, 128) == 64    # 132 CTAs: one wave
  assert v_tile(67, 128) == 128   # 134 CTAs at 64 wide: two waves
  assert v_tile(128, 128) == 128  # B4 H32 and the k3_1b step (B16 HV8)
  assert v_tile(500, 64) == 64    # V = 64: nothing wider
  assert v_tile(500, 96) == 64
  tuning = dataclasses.replace(config.default_config((1, 64, 500, 128), device=H200),
                               mgpu_v_tile=32)
  w = jax.ShapeDtypeStruct((1, 64, 500, 128), BF16)
  assert recurrence.mosaic_tile(_options(tuning), w, w, BF16, BF16) == 32
