"""KDA on one GPU: check the Pallas kernels against the float32 token recurrence, then time them
next to jla ``kda`` (Mosaic GPU) and fla ``chunk_kda`` / ``fused_recurrent_kda`` (torch + triton)
when importable, in the same run, within a time budget (the H200 run takes about 150 s).

  python3 benchmarks/kda.py                # check, B1 T16384 H32 K128, parts, decode, fla
  python3 benchmarks/kda.py --sweep        # also warps per chunk kernel, chunk_dqkg K slices
                                           # and the gate-gradient matrix-unit algorithm
                                           # (accuracy and time)
  python3 benchmarks/kda.py --sweep --ours-only --no-decode --budget 105
                                           # the sweep next to the default (~140 s at most)
  python3 benchmarks/kda.py --budget 135   # seconds after which optional steps are skipped
  python3 benchmarks/kda.py --quick        # a small shape instead (B1 T2048 H8 K128)
  python3 benchmarks/kda.py --ours-only    # no peers
  python3 benchmarks/kda.py --profile      # also each kernel's GPU time per call, ours and jla's
                                           # (profiler trace, first shape, fwd and fwd+bwd)
  python3 benchmarks/kda.py --all-shapes   # also the other PERF.md shapes and the XLA path
  python3 benchmarks/kda.py --shapes 4x4096x32x128,1x65536x16x128 --no-parts --no-decode
  python3 benchmarks/kda.py --fla-first    # fla right after ours at each shape (its autotuning
                                           # outlasts the budget when it comes last), then jla
  python3 benchmarks/kda.py --check-only   # only the checks (random, similar keys, V tile 128)
  python3 benchmarks/kda.py --set "recurrence='mosaic'"  # a ``KdaGpuConfig`` option (a Python
                                           # literal) over each shape's default_config for the
                                           # whole run (repeatable; --emulate too);
                                           # chunk_a='mosaic', chunk_dqkg='mosaic',
                                           # chunk_dwy='mosaic': those kernels on Mosaic GPU
  python3 benchmarks/kda.py --emulate      # CPU: the check with the GPU's matrix-unit roundings
                                           # emulated, for the default and kda_sweep.GATE_DOTS (~2 min);
                                           # with --gate-kinds K1,K2 the default for those kinds
  python3 benchmarks/kda.py --gates --budget 540
                                           # issue 40's run: every gate kind (GATE_KINDS) at
                                           # GATE_SHAPES beside jla (same decay), each checked,
                                           # the kernels of the softplus gate one by one and
                                           # profiled beside jla's, the decode pool kernel for
                                           # both gates at GATE_DECODE_N, then fla per shape
                                           # (its default gate, then its bounded one) while the
                                           # budget lasts; --gate-kinds softplus,general picks;
                                           # --fla-only: fla alone (a second call)
  python3 benchmarks/kda.py --gates --ours-only --no-check --no-parts --no-decode \
      --shapes 1x128x2x64 --budget 60      # CPU smoke run of the same (interpret mode)

The decode kernel's tunings are swept by ``benchmarks/kda_decode.py``; this script times its
default (rows in ``$OUT/kda_decode.json``).

Every row is written to ``$OUT/kda_bench.json`` as soon as it is measured, so a run cut short
keeps what it measured.

Training/prefill shapes from ../shared/PERF.md: q, k, v ``[B, T, H, 128]`` bf16, bounded
(safe) gate with lower bound -5 computed in the kernel from the raw projection, L2 norm and beta
sigmoid in the kernel (fla's configuration). jla gets the precomputed log decay and beta (its
API), with its in-kernel L2 norm. Decode: one token for N requests, H=32, K=V=128, float32
state pool updated in place; reported as state traffic (read + write) per second.
JAX times: median over repeats of 5 back-to-back calls; fla times: triton's do_bench median.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.kda import kda, kda_decode, kda_gate  # noqa: E402
from pallas_kernels.kda import chunk_dense, chunk_ops, config, prep_vjp, recurrence  # noqa: E402
import kda_decode as kda_decode_bench  # noqa: E402
import kda_sweep  # noqa: E402
from kda_decode import DECODE_TOL  # noqa: E402
from timing import (Rows, gpu_span, kernel_times, median_ms as jtime,  # noqa: E402
                    rel_err as rel, replace_options)

SHAPES = [(1, 16384, 32, 128), (4, 4096, 32, 128), (1, 65536, 16, 128)]
# issue 40: the PERF.md shapes and Kimi Linear 48B's KDA layer (configs/kimi_linear_48b.yaml:
# 32 heads, K = V = 128) at B1 T8192
GATE_SHAPES = SHAPES + [(1, 8192, 32, 128)]
# Kimi Linear's softplus gate fused from the raw f, a precomputed log decay g (gate=None; the
# softplus gate's values), K3's bounded gate
GATE_KINDS = ("softplus", "general", "bounded")
GATE_DECODE_N = (64, 256, 1024)
LB = -5.0
_ROWS = Rows("kda_bench.json")
ROWS = _ROWS.rows


def emit(**r):
  """Prints one result row and rewrites $OUT/kda_bench.json (a run cut short keeps its rows)."""
  _ROWS.emit(r)


def inputs(b, t, h, kd, seed=0, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 7)
  q = jax.random.normal(ks[0], (b, t, h, kd), dtype)
  k = jax.random.normal(ks[1], (b, t, h, kd), dtype)
  v = jax.random.normal(ks[2], (b, t, h, kd), dtype)
  f = jax.random.normal(ks[3], (b, t, h, kd), dtype)
  beta = jax.random.normal(ks[4], (b, t, h), dtype)
  a_log = 0.3 * jax.random.normal(ks[5], (h,), jnp.float32)
  dt_bias = 0.3 * jax.random.normal(ks[6], (h * kd,), jnp.float32)
  return q, k, v, f, beta, a_log, dt_bias


def gate_inputs(shape, kind, seed=0):
  """``inputs`` for the gate kind (``GATE_KINDS``): for "general" f replaced by the precomputed
  log decay, the softplus gate's values (float32)."""
  q, k, v, f, beta, a_log, dt_bias = inputs(*shape, seed=seed)
  if kind == "general":
    f = kda_gate(f, a_log, dt_bias, "softplus")
  return q, k, v, f, beta, a_log, dt_bias


def gate_of(kind):
  """``kda``'s ``gate`` for a gate kind."""
  return None if kind == "general" else kind


SETS: list[str] = []  # --set NAME=VALUE over each shape's default tuning, for the whole run


def tuning(v_shape, **changes):
  """The kernels' tuning at values ``v_shape``: ``default_config`` with ``--set`` and
  ``changes`` (a sweep's variant) applied."""
  base = replace_options(config.default_config(v_shape, use_qk_l2norm=True, beta_is_logit=True),
                         SETS)
  for table in ("warps", "chunk_loop"):  # a variant's partial table updates the current one
    if table in changes:  # (KdaGpuConfig fills a given table from the module defaults)
      changes[table] = {**dict(getattr(base, table)), **dict(changes[table])}
  return dataclasses.replace(base, **changes)


def ours(q, k, v, f, beta, a_log, dt_bias, segment_ids=None, initial_state=None,
         impl="pallas_gpu", save_residuals=True, changes=None, kind="bounded", every=None):
  """The op with the gate ``kind`` (``GATE_KINDS``; "general": f is the log decay, A_log and
  dt_bias unused), with ``every`` also the states every that many chunks."""
  extra = ({"save_residuals": save_residuals, "config": tuning(v.shape, **(changes or {}))}
           if impl == "pallas_gpu" else {})
  gate = gate_of(kind)
  return kda(q, k, v, f, beta, use_qk_l2norm=True, A_log=gate and a_log,
             dt_bias=gate and dt_bias, gate=gate, lower_bound=LB, beta_is_logit=True,
             segment_ids=segment_ids, initial_state=initial_state, output_final_state=True,
             implementation=impl, output_states_every=every, **extra)


CHECK_TOL = 3e-2  # relative error of the bf16 kernel vs the float32 recurrence
CHECK_SHAPE = (2, 600, 4, 128)  # B, T (3 segments: 5/12, 1/6, 5/12 of T), H, K


def check(decode=True, tag="pallas_gpu", similar=False, changes=None, kind="bounded"):
  """bf16 kernel (its tuning with ``changes``, the gate ``kind``) vs float32 naive recurrence:
  outputs, final state, all gradients (and the decode kernel vs the XLA path if ``decode``).
  Returns the relative errors. ``similar``: keys of cosine similarity about 0.94, gates near 0
  and beta near 1, so that (I + diag(beta) A_kk) has entries near 1 across whole chunks (the
  inverse's hard case)."""
  b, t, h, kd = CHECK_SHAPE
  q, k, v, f, beta, a_log, dt_bias = gate_inputs((b, t, h, kd), kind, seed=1)
  if kind != "bounded":
    tag += f" {kind}"
  if similar:
    common = jax.random.normal(jax.random.key(11), (1, 1, h, kd), jnp.float32)
    k = (0.97 * common + 0.24 * k.astype(jnp.float32)).astype(k.dtype)
    f, beta = f - 8, beta + 3
    tag += " similar keys"
  seg = jnp.broadcast_to((jnp.arange(t) >= 5 * t // 12).astype(jnp.int32)
                         + (jnp.arange(t) >= 7 * t // 12).astype(jnp.int32), (b, t))
  s0 = jax.random.normal(jax.random.key(9), (b, h, kd, kd), jnp.float32)
  args = (q, k, v, f, beta, a_log, dt_bias, s0)

  def run(impl, *a):
    *a, s = a
    return ours(*a, segment_ids=seg, initial_state=s, impl=impl, changes=changes, kind=kind)

  def loss(impl, *a):
    o, s = run(impl, *a)
    return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(kd))) + jnp.sum(s * 0.01)

  if (similar, kind) not in _REF:  # the float32 reference, once per run
    up = tuple(x.astype(jnp.float32) for x in args)
    _REF[similar, kind] = (
        jax.jit(lambda *a: run("naive", *a))(*up),
        jax.jit(jax.grad(lambda *a: loss("naive", *a), argnums=tuple(range(8))))(*up))
  (o2, s2), g2 = _REF[similar, kind]
  o1, s1 = jax.jit(lambda *a: run("pallas_gpu", *a))(*args)
  g1 = jax.jit(jax.grad(lambda *a: loss("pallas_gpu", *a), argnums=tuple(range(8))))(*args)
  errs = {"o": rel(o1, o2), "state": rel(s1, s2)}
  errs.update({f"d{n}": rel(x, y) for n, x, y in
               zip("q k v f beta A_log dt_bias s0".split(), g1, g2)
               if kind != "general" or n not in ("A_log", "dt_bias")})  # (unused there)
  emit(name=f"check {tag} bf16 vs naive f32 (B{b} T{t} H{h} K{kd}, 3 segments)",
       **{k_: round(v_, 5) for k_, v_ in errs.items()})
  bad = {k_: v_ for k_, v_ in errs.items() if not v_ < CHECK_TOL}
  if bad:
    _ROWS.fail(tag, bad)
  if decode:
    check_decode(h, kd, a_log, dt_bias)
  return errs


_REF = {}


def check_decode(h, kd, a_log, dt_bias):
  """Decode kernel vs the XLA path, non-contiguous slots, 3 tokens."""
  n, tn = 8, 3
  qd, kdd, vd, fd, bd, _, _ = inputs(n, tn, h, kd, seed=2)
  pool = jax.random.normal(jax.random.key(3), (2 * n, h, kd, kd), jnp.float32)
  slots = jnp.arange(n, dtype=jnp.int32)[::-1] * 2
  kw = dict(slots=slots, use_qk_l2norm=True, A_log=a_log, dt_bias=dt_bias, gate="bounded",
            beta_is_logit=True)
  od1, p1 = jax.jit(lambda *a: kda_decode(*a, implementation="pallas_gpu", **kw))(
      qd, kdd, vd, fd, bd, pool)
  od2, p2 = kda_decode(qd, kdd, vd, fd, bd, pool, implementation="naive", **kw)
  errs = {"o": rel(od1, od2), "pool": rel(p1, p2)}
  emit(name="check decode vs naive (N8 Tn3)", o=round(errs["o"], 5), pool=round(errs["pool"], 6))
  bad = {k_: v_ for (k_, v_), tol in zip(errs.items(), DECODE_TOL) if not v_ < tol}
  if bad:
    _ROWS.fail("decode", bad)


def fwd_bwd(loss, n):
  """The loss and its gradients wrt the first ``n`` arguments, jitted. The loss value needs the
  forward's output, so the forward kernels run as in training: with ``jax.grad`` alone XLA drops
  a forward whose only use is the output when the backward needs just the inputs (ours, unless
  ``save_residuals``), and fwd+bwd would time the backward alone (runs before 2026-12-01)."""
  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n))))


def time_ours(shape, impl="pallas_gpu", kind="bounded"):
  args = gate_inputs(shape, kind)
  fwd = jax.jit(lambda *a: ours(*a, impl=impl, kind=kind)[0])
  loss = lambda *a: jnp.sum(ours(*a, impl=impl, kind=kind)[0].astype(jnp.float32))
  fb = fwd_bwd(loss, 5 if kind == "general" else 7)  # (A_log, dt_bias unused for "general")
  return {"fwd": jtime(fwd, *args), "fwdbwd": jtime(fb, *args, reps=7)}


def time_states(shape, kind, every):
  """The forward (ms) that also returns the states every ``every`` chunks."""
  fwd = jax.jit(lambda *a: ours(*a, kind=kind, every=every)[::2])  # (o, the states)
  return jtime(fwd, *gate_inputs(shape, kind))


def check_states(shape, kind, every=4):
  """The forward's states every ``every`` chunks (serving's prefix cache) at ``shape`` on the
  card, bf16 inputs, against the float32 token recurrence's (the same inputs upcast): the
  largest relative error over the boundaries, and the output's. A restart at 5/12 of T."""
  b, t, h, kd = shape
  q, k, v, f, beta, a_log, dt_bias = gate_inputs(shape, kind, seed=4)
  seg = jnp.broadcast_to((jnp.arange(t) >= 5 * t // 12).astype(jnp.int32), (b, t))
  args = (q, k, v, f, beta, a_log, dt_bias)
  run = lambda impl, *a: ours(*a, segment_ids=seg, impl=impl, kind=kind, every=every)
  o1, _, st1 = jax.jit(lambda *a: run("pallas_gpu", *a))(*args)
  o2, _, st2 = jax.jit(lambda *a: run("naive", *a))(*(x.astype(jnp.float32) for x in args))
  assert st1.shape == st2.shape and st1.shape[1] > 0, (st1.shape, st2.shape)
  errs = {"o": rel(o1, o2), "states": max(rel(st1[:, m], st2[:, m]) for m in range(st1.shape[1])),
          "n_states": int(st1.shape[1])}
  emit(name=f"check {kind} output_states_every={every} bf16 vs naive f32 "
       "(B{} T{} H{} K{}, 2 segments)".format(*shape), **{k_: round(v_, 5) for k_, v_ in errs.items()})
  if not (errs["o"] < CHECK_TOL and errs["states"] < CHECK_TOL):
    _ROWS.fail(f"states {kind}", errs)
  return errs


def time_chunked(shape):
  """The XLA chunked path (``implementation="chunked"``), same inputs and fusions."""
  return time_ours(shape, impl="chunked")


def options(shape, kind="bounded", **changes):
  """The op's static options at ``shape`` [B, T, H, K] (bf16, the gate ``kind``) with
  ``tuning(...)``."""
  kd = shape[-1]
  tune = tuning(shape, **changes)
  rows, sub = config.chunk_path(gate_of(kind), LB, 64, tune)
  return config.KdaOptions(scale=kd ** -0.5, chunk=64, use_qk_l2norm=True, gate=gate_of(kind),
                           lower_bound=LB, beta_is_logit=True, diag_rows=rows, sub_chunks=sub,
                           dtype="bfloat16", tuning=tune)


class Parts:
  """The intermediates of one forward + backward of ours at ``shape`` (zero segments, no initial
  state) with the gate ``kind``, to time each pallas_call alone."""

  def __init__(self, shape, kind="bounded"):
    b, t, h, kd = shape
    self.shape, self.kind = shape, kind
    self.cfg = cfg = options(shape, kind)
    q, k, v, f, beta, a_log, dt_bias = gate_inputs(shape, kind)
    self.seg = jnp.zeros((b, t), jnp.int32)
    self.t = t
    self.x = (q, k, v, f, beta, a_log, dt_bias.reshape(h, kd))
    self.s0 = jnp.zeros((b, h, kd, kd), jnp.float32)
    self.do = jax.random.normal(jax.random.key(7), (b, t, h, kd), jnp.bfloat16)
    self.a = jax.jit(lambda *x: chunk_dense.chunk_a(cfg, *x, self.seg, t))(*self.x)
    pkk, _, _, _, kg, _, _, _, _ = self.a
    self.wu = jax.jit(lambda *x: chunk_dense.chunk_wu(cfg, *x, self.seg, t, True))(
        pkk, kg, v, beta)
    w, u, x = self.wu
    _, aqk, qg, kdec, _, gc, _, _, _ = self.a
    self.fac = (w, u, qg, aqk, kdec, gc)
    _, _, self.hs, self.vn = jax.jit(lambda *p: recurrence.recurrence_fwd(
        cfg, *p, self.s0, jnp.bfloat16, store=True))(*self.fac)
    self.dvn, self.dh, _ = jax.jit(lambda *p: recurrence.recurrence_bwd(cfg, *p))(
        self.do, qg, aqk, kdec, w, gc, self.s0)
    self.dwy = jax.jit(lambda *p: chunk_dense.chunk_dwy(cfg, *p, t))(
        v, beta, self.seg, x, pkk, kg, self.hs, self.dvn)

  def fns(self, changes=None, diag_rows=None):
    """name -> (jitted function, args) for each kernel alone and the XLA pre-processing VJP, at
    the tuning with ``changes`` (the intermediates converted to its storage dtypes) and
    ``diag_rows`` reference blocks (default: the op's)."""
    cfg, seg, t = options(self.shape, self.kind, **(changes or {})), self.seg, self.t
    cfg = dataclasses.replace(cfg, diag_rows=diag_rows or cfg.diag_rows)
    q, k, v, f, beta, a_log, dtb = self.x
    pkk, _, _, _, kg, _, rq, rk, redo = self.a
    w, u, qg, aqk, kdec, gc = self.fac
    _, _, x = self.wu
    dpkk, dy, _, dbeta = self.dwy
    hs, dh, dvn = (a.astype(config.store_dtype(cfg, n))
                   for a, n in ((self.hs, "h"), (self.dh, "dh"), (self.dvn, "dvn")))
    j = jax.jit
    dq, dg = (dy.astype(config.store_dtype(cfg, n)) for n in ("dqk", "dg"))
    dy = dy.astype(config.store_dtype(cfg, "dy"))
    op = lambda save: lambda *a: jnp.sum(ours(*a, save_residuals=save, changes=changes,
                                              kind=self.kind)[0].astype(jnp.float32))
    whole = (q, k, v, f, beta, a_log, dtb.reshape(-1))
    return {
        "fwdbwd": (fwd_bwd(op(True), 7), whole),
        "fwdbwd_recompute": (fwd_bwd(op(False), 7), whole),  # save_residuals=False
        "chunk_a": (j(lambda *a: chunk_dense.chunk_a(cfg, *a, seg, t)), self.x),
        "chunk_wu": (j(lambda *a: chunk_dense.chunk_wu(cfg, *a, seg, t, False)),
                     (pkk, kg, v, beta)),
        "chunk_wu_keep": (j(lambda *a: chunk_dense.chunk_wu(cfg, *a, seg, t, True)),
                          (pkk, kg, v, beta)),
        "recur_fwd": (j(lambda *p: recurrence.recurrence_fwd(cfg, *p, self.s0, jnp.bfloat16,
                                                              store=False)), self.fac),
        "recur_fwd_store": (j(lambda *p: recurrence.recurrence_fwd(cfg, *p, self.s0, jnp.bfloat16,
                                                                    store=True)), self.fac),
        "recur_bwd": (j(lambda *p: recurrence.recurrence_bwd(cfg, *p)),
                      (self.do, qg, aqk, kdec, w, gc, self.s0)),
        "chunk_dwy": (j(lambda *p: chunk_dense.chunk_dwy(cfg, *p, t)),
                      (v, beta, seg, x, pkk, kg, hs, dvn)),
        "chunk_dqkg": (j(lambda *p: chunk_dense.chunk_dqkg(cfg, *p, t)),
                       (q, k, v, f, beta, a_log, dtb, seg, hs, dh, self.vn, self.do,
                        dy, dpkk, rq, rk, redo)),
        "prep_vjp": (j(lambda *a: prep_vjp.preprocess_vjp(cfg, *a, config=cfg.tuning.prep_vjp)),
                     (q, k, f, beta, a_log, dtb, dq, dq, dg, dbeta)),
    }


def time_parts(shape, kind="bounded"):
  """Per-kernel breakdown (the gate ``kind``): each pallas_call alone, with the forward (chunk_a
  + chunk_wu + recur_fwd) and backward (chunk_a + chunk_wu_keep + recur_fwd_store + recur_bwd +
  chunk_dwy + chunk_dqkg + prep_vjp) sums."""
  parts = Parts(shape, kind)
  res = {name: jtime(fn, *args) for name, (fn, args) in parts.fns().items()}
  res["sum_fwd"] = res["chunk_a"] + res["chunk_wu"] + res["recur_fwd"]
  res["sum_bwd"] = sum(res[n] for n in ("chunk_a", "chunk_wu_keep", "recur_fwd_store",
                                        "recur_bwd", "chunk_dwy", "chunk_dqkg", "prep_vjp"))
  return res, parts


def jla_op(shape, kind="bounded"):
  """jla's KDA output as a function of its inputs, and those inputs at ``shape``: ours'
  (``inputs``) with the gate and beta pre-computed (its API), L2 norm in its kernel. The decay
  of the gate ``kind``: the bounded gate's ``LB sigmoid(f)`` or the softplus gate's values (also
  the precomputed g of "general")."""
  from jla.ops.mosaic_gpu.kda import kda as jla_kda
  q, k, v, f, beta, a_log, dt_bias = inputs(*shape)
  g = (LB * jax.nn.sigmoid(f.astype(jnp.float32)) if kind == "bounded"
       else kda_gate(f, a_log, dt_bias, "softplus"))
  bb = jax.nn.sigmoid(beta.astype(jnp.float32)).astype(jnp.bfloat16)
  return (lambda *a: jla_kda(*a, use_qk_l2norm=True)[0]), (q, k, v, g, bb)


def time_jla(shape, kind="bounded"):
  op, args = jla_op(shape, kind)
  fb = fwd_bwd(lambda *a: jnp.sum(op(*a).astype(jnp.float32)), len(args))
  return {"fwd": jtime(jax.jit(op), *args), "fwdbwd": jtime(fb, *args, reps=7)}


def profile_kernels(shape, peers=True, reps=5, kind="bounded"):
  """GPU time per call of each kernel of ours (the gate ``kind``) and (``peers``) of jla at
  ``shape``, forward and forward+backward (the profiler's trace, ``reps`` calls after a
  warm-up): where the two differ."""
  import tempfile
  b, t, h, kd = shape
  total = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
  runs = {f"ours {kind}": (lambda *a: ours(*a, kind=kind)[0], gate_inputs(shape, kind))}
  if peers:
    runs["jla"] = jla_op(shape, kind)
  for name, (fn, args) in runs.items():
    for mode, jf in (("fwd", jax.jit(fn)), ("fwdbwd", fwd_bwd(total(fn), len(args)))):
      jax.block_until_ready(jf(*args))
      with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
          for _ in range(reps):
            out = jf(*args)
          jax.block_until_ready(out)
        by_name = kernel_times(d)[1]
        busy, span = gpu_span(d)
      emit(name=f"profile {name} {mode} B{b} T{t} H{h} K{kd} (ms per call)",
           busy=round(busy / reps / 1e3, 4), span=round(span / reps / 1e3, 4),
           **{n[:60]: round(us / reps / 1e3, 4)
              for n, us in sorted(by_name.items(), key=lambda x: -x[1]) if us / reps > 1})


def time_fla(shape, kind="bounded"):
  """fla's ``chunk_kda`` with its gate fused: the bounded one (``safe_gate``) for "bounded",
  its default (Kimi Linear's softplus gate) otherwise."""
  import torch
  from fla.ops.kda import chunk_kda
  from triton.testing import do_bench
  b, t, h, kd = shape
  torch.manual_seed(0)
  mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
  q, k, v, g = (mk(b, t, h, kd) for _ in range(4))
  beta = mk(b, t, h)
  gate = dict(safe_gate=True, lower_bound=LB) if kind == "bounded" else {}
  kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, A_log=torch.zeros(h, device="cuda"),
            dt_bias=torch.zeros(h * kd, device="cuda"), **gate)
  f = lambda: chunk_kda(q, k, v, g, beta, **kw)[0]
  r = {"fwd": do_bench(f, warmup=25, rep=100, return_mode="median")}
  do = torch.randn_like(f())

  def fb():
    chunk_kda(q, k, v, g, beta, **kw)[0].backward(do)
  r["fwdbwd"] = do_bench(fb, warmup=10, rep=100, return_mode="median",
                         grad_to_none=[q, k, v, g, beta])
  return r


def emulate(kinds=None):
  """On the CPU (interpret mode) the kernels' products are exact float32; this runs the check
  with the GPU's roundings emulated (``chunk_ops.gpu_rounding``) at B1 T256 H2 K128 for the
  default gate-gradient algorithms and each of ``kda_sweep.GATE_DOTS``, then with similar keys; with
  ``kinds`` (gate kinds) the default's check for each of them instead."""
  global CHECK_SHAPE
  CHECK_SHAPE = (1, 256, 2, 128)
  with chunk_ops.gpu_rounding():
    if kinds:
      for kind in kinds:
        check(decode=False, tag="emulated", kind=kind)
      return
    for name, dot in [("default", None)] + list(kda_sweep.GATE_DOTS.items()):
      check(decode=False, tag=f"emulated gate_dot={name}", changes=dot and {"gate_dot": dot})
    check(decode=False, tag="emulated", similar=True)


def _try(label, fn):
  """``fn()``, or its error printed under ``label`` (the run goes on)."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001
    print(f"{label} FAILED", repr(e)[:1500], flush=True)
    return None


def gates(shapes, kinds, peers, left):
  """Issue 40's run (``--gates``): each gate kind checked against the float32 recurrence, then
  at each shape ours per kind and jla (the softplus gate's decay precomputed; its time does not
  depend on the decay's values), forward and forward+backward, and the first kind's forward with
  the states every 4 chunks, after the first shape :func:`gates_first` (the kernels one by one,
  decode); the first kind's
  profile beside jla's; fla's ``chunk_kda`` per shape while ``left()`` allows (its autotuning
  takes minutes per shape). Steps are skipped, and said so, when the budget runs out."""
  argv = sys.argv
  if "--fla-only" in argv:  # a second call for fla where its autotuning outlasted the first
    return gates_fla(shapes, kinds, left)
  if "--no-check" not in argv:
    for kind in kinds:
      _try(f"check {kind}", lambda: check(decode=False, kind=kind))
  for i, shape in enumerate(shapes):
    tag = "B{} T{} H{} K{}".format(*shape)
    for kind in kinds + (("jla",) if peers else ()):
      if left() < 30:
        print(f"{kind} {tag}: time budget spent", flush=True)
        continue
      fn = (lambda: time_jla(shape, "softplus")) if kind == "jla" else (
          lambda: time_ours(shape, kind=kind))
      res = _try(f"{kind} {tag}", fn)
      if res:
        name = "jla" if kind == "jla" else f"ours {kind}"
        emit(name=f"{name} {tag}", **{k: round(v, 4) for k, v in res.items()})
    if left() > 60:  # the prefix cache's states every 4 chunks from the same forward
      if "--no-check" not in argv:
        _try("states check", lambda: check_states(shape, kinds[0], 4 if shape[1] >= 1024 else 1))
      res = _try("states", lambda: time_states(shape, kinds[0], 4))
      if res:
        emit(name=f"ours {kinds[0]} output_states_every=4 {tag}", fwd=round(res, 4))
    if i == 0:  # the breakdown and decode before the other shapes (the budget may end first)
      gates_first(shape, tag, kinds, left)
  if "--no-profile" not in argv and left() > 60:
    _try("profile", lambda: profile_kernels(shapes[0], peers, kind=kinds[0]))
  gates_table(shapes, kinds)
  if peers:
    gates_fla(shapes, kinds, left)


def gates_first(shape, tag, kinds, left):
  """At the first shape: the first kind's kernels one by one and the decode pool kernel for both
  gates."""
  argv = sys.argv
  if "--no-parts" not in argv and left() > 60:
    res = _try(f"parts {kinds[0]}", lambda: time_parts(shape, kinds[0])[0])
    if res:
      emit(name=f"ours parts {kinds[0]} {tag}", **{k: round(v, 4) for k, v in res.items()})
  if "--no-decode" not in argv and left() > 30:
    kda_decode_bench.decode(GATE_DECODE_N, ("softplus", "bounded"))


def gates_fla(shapes, kinds, left):
  """fla's ``chunk_kda`` at each shape, its default (softplus) gate, then its bounded one where
  ``kinds`` has it, while ``left()`` allows; then the table."""
  for fla_kind in ("softplus",) + (("bounded",) if "bounded" in kinds else ()):
    for shape in shapes:
      tag = "B{} T{} H{} K{}".format(*shape)
      if left() < 60:
        print(f"fla {fla_kind} {tag}: time budget spent", flush=True)
        continue
      res = _try(f"fla {fla_kind} {tag}", lambda: time_fla(shape, fla_kind))
      if res:
        emit(name=f"fla {fla_kind} {tag}", **{k: round(v, 4) for k, v in res.items()})
  gates_table(shapes, kinds)


def gates_table(shapes, kinds):
  """The ``--gates`` rows as one table: ours per gate kind beside jla (same decay) and fla (its
  bounded gate for "bounded", its default softplus gate for the others); ratios > 1: ours
  faster."""
  by = {r["name"]: r for r in ROWS + kda_decode_bench._ROWS.rows}
  if _ROWS.failed:
    print(f"\nCHECK FAILED ({', '.join(_ROWS.failed)}): the times below are not results")
  print("\n| shape | gate | pass | ours ms | jla ms | fla ms | jla/ours | fla/ours |\n"
        "|---|---|---|---|---|---|---|---|")
  for shape in shapes:
    tag = "B{} T{} H{} K{}".format(*shape)
    for kind in kinds:
      o = by.get(f"ours {kind} {tag}")
      if not o:
        continue
      fla = by.get(f"fla {'bounded' if kind == 'bounded' else 'softplus'} {tag}", {})
      for p in ("fwd", "fwdbwd"):
        peer = [by.get(f"jla {tag}", {}).get(p), fla.get(p)]
        cells = " | ".join(f"{x:.3f}" if x else "-" for x in peer)
        ratios = " | ".join(f"{x / o[p]:.2f}x" if x else "-" for x in peer)
        print(f"| {tag} | {kind} | {p} | {o[p]:.3f} | {cells} | {ratios} |", flush=True)
  for shape in shapes:  # item 4: the states every 4 chunks cost at most 5% of the forward
    tag = "B{} T{} H{} K{}".format(*shape)
    o, st = by.get(f"ours {kinds[0]} {tag}"), by.get(f"ours {kinds[0]} output_states_every=4 {tag}")
    if o and st:
      print(f"states every 4 chunks {kinds[0]} {tag}: {st['fwd']:.3f} ms against "
            f"{o['fwd']:.3f} forward ({100 * (st['fwd'] / o['fwd'] - 1):+.1f}%)", flush=True)
  for kind in ("softplus", "bounded"):
    for n in GATE_DECODE_N:
      r = by.get(f"ours decode {kind} N{n} H32 K128")
      if r:
        print(f"decode {kind} N{n}: {r['ms']:.4f} ms, {r['tbps']:.2f} TB/s (state read + write)",
              flush=True)


def _shapes_arg(default):
  """``--shapes`` (B x T x H x K, comma separated) or ``default``."""
  if "--shapes" not in sys.argv:
    return default
  return [tuple(int(x) for x in s.split("x"))
          for s in sys.argv[sys.argv.index("--shapes") + 1].split(",")]


def main():
  for i, arg in enumerate(sys.argv):
    if arg == "--set":  # a KdaGpuConfig option over each shape's default for the whole run
      SETS.append(sys.argv[i + 1])
      replace_options(config.KdaGpuConfig(), SETS)  # a bad name fails here, not mid-run
      print("KdaGpuConfig", sys.argv[i + 1], flush=True)
  if "--emulate" in sys.argv:
    return emulate(sys.argv[sys.argv.index("--gate-kinds") + 1].split(",")
                   if "--gate-kinds" in sys.argv else None)
  t0 = time.perf_counter()
  budget = float(sys.argv[sys.argv.index("--budget") + 1]) if "--budget" in sys.argv else 135.0
  left = lambda: budget - (time.perf_counter() - t0)
  quick = "--quick" in sys.argv
  shapes = _shapes_arg([(1, 2048, 8, 128)] if quick else SHAPES if "--all-shapes" in sys.argv
                       else SHAPES[:1])
  peers = "--ours-only" not in sys.argv
  print("jax", jax.__version__, jax.devices(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "warps", dict(tuning(shapes[0]).warps), flush=True)
  if "--gates" in sys.argv:
    kinds = (tuple(sys.argv[sys.argv.index("--gate-kinds") + 1].split(","))
             if "--gate-kinds" in sys.argv else GATE_KINDS)
    unknown = set(kinds) - set(GATE_KINDS)
    if unknown:
      raise SystemExit(f"--gate-kinds: unknown {sorted(unknown)} (of {GATE_KINDS})")
    gates(_shapes_arg(GATE_SHAPES), kinds, peers, left)
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
    return
  try:
    check()
    check(decode=False, similar=True)
    # the default takes it past one wave (B4 H32, the k3_1b step)
    check(decode=False, tag="pallas_gpu V tile 128", changes={"mgpu_v_tile": 128})
  except Exception as e:  # noqa: BLE001 - the timings below are still worth having
    print("CHECK ERROR", repr(e)[:2000], flush=True)
  if "--check-only" in sys.argv:
    return
  fla_first = peers and "--fla-first" in sys.argv  # fla beside ours at each shape, then jla
  runners = [("ours", time_ours)] + [("fla", time_fla)] * fla_first + [("jla", time_jla)] * peers
  if "--all-shapes" in sys.argv:
    runners.append(("chunked", time_chunked))
  parts = None
  for i, shape in enumerate(shapes):
    tag = "B{} T{} H{} K{}".format(*shape)
    for name, fn in runners:
      if name != "ours" and left() < 20:
        print(f"{name} {tag}: time budget spent", flush=True)
        continue
      try:
        emit(name=f"{name} {tag}", **{k: round(v, 4) for k, v in fn(shape).items()})
      except Exception as e:  # noqa: BLE001
        print(f"{name} {tag} FAILED", repr(e)[:1500], flush=True)
    if i == 0 and "--no-parts" not in sys.argv:
      try:
        res, parts = time_parts(shape)
        emit(name=f"ours parts {tag}", **{k: round(v, 4) for k, v in res.items()})
      except Exception as e:  # noqa: BLE001
        print(f"ours parts {tag} FAILED", repr(e)[:1500], flush=True)
  if "--profile" in sys.argv:
    try:
      profile_kernels(shapes[0], peers)
    except Exception as e:  # noqa: BLE001
      print("profile FAILED", repr(e)[:1500], flush=True)
  if "--no-decode" not in sys.argv:
    kda_decode_bench.decode()
  table()
  tag = "B{} T{} H{} K{}".format(*shapes[0])
  if "--sweep" in sys.argv and parts is not None:
    kda_sweep.sweep(sys.modules[__name__], parts, shapes[0], tag, left)
  if peers and not fla_first and left() > 45:
    for shape in shapes:
      try:
        emit(name="fla B{} T{} H{} K{}".format(*shape), **{
            k: round(v, 4) for k, v in time_fla(shape).items()})
      except Exception as e:  # noqa: BLE001
        print("fla unavailable:", repr(e)[:300], flush=True)
        break
    if left() > 15:
      kda_decode_bench.decode_fla()
    table()
  print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


def table():
  by = {r["name"]: r for r in ROWS}
  if _ROWS.failed:
    print(f"\nCHECK FAILED ({', '.join(_ROWS.failed)}): the times below are not results")
  print("\n| shape | pass | ours ms | fla ms | jla ms | XLA chunked ms | fla/ours | jla/ours |"
        " chunked/ours |")
  print("|---|---|---|---|---|---|---|---|---|")
  for tag in [r["name"].removeprefix("ours ") for r in ROWS
              if r["name"].startswith("ours B") and "fwd" in r]:
    o = by.get(f"ours {tag}")
    if not o:
      continue
    for p in ("fwd", "fwdbwd"):
      peer = [by.get(f"{n} {tag}", {}).get(p) for n in ("fla", "jla", "chunked")]
      ratio = lambda x: f"{x / o[p]:.2f}x" if x else "-"
      cells = " | ".join(f"{x:.3f}" if x else "-" for x in peer)
      print(f"| {tag} | {p} | {o[p]:.3f} | {cells} | " + " | ".join(ratio(x) for x in peer) + " |",
            flush=True)


if __name__ == "__main__":
  main()
