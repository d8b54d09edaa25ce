"""MLA kernels on one GPU (H200): check each against the reference, then time them.

Prefill (q/k dim 192, v dim 128, bf16): Pallas forward and forward+backward against cuDNN
(``jax.nn.dot_product_attention`` with v zero-padded to 192) at B1 T16384 H32 and B2 T8192 H96,
causal and with 4096-token packed documents. Decode: paged latent cache (576 per token, page
size 64, shuffled pages), H=96, Tn=1, N = 1, 64, 256 with lengths 1K-64K, against the XLA
reference. Prints achieved TFLOP/s (useful work: v padding and skipped blocks not counted) and
TB/s of cache traffic, and writes a markdown table (and JSON) under $OUT when set.

  PYTHONPATH=. python3 benchmarks/mla.py [--sweep {none,prefill,decode,all}] [--cudnn-mask]
                                         [--budget SECONDS] [--decode-only]

``--decode-only``: the decode kernels (Mosaic GPU ``mosaic``, then Triton) each checked against
the reference, then timed at N = 256, 64, 1 (the Mosaic one also with 2x and 4x its default
split count at N = 256, 64); skips what is left after ``--budget`` seconds (default 90 here, to
finish within two minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mla import decode, mla_attention, prefill, reference
from timing import Rows, median_ms, rel_err

DK, DV, R, DR = 192, 128, 512, 64
SCALE = DK ** -0.5
START = time.perf_counter()
_ROWS = Rows("mla.json")
ROWS = _ROWS.rows


emit = _ROWS.emit
timeit = functools.partial(median_ms, inner=3, reps=5)


def rand(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def docs(b, t, doc):
  return jnp.broadcast_to(jnp.arange(t) // doc, (b, t)).astype(jnp.int32)


def attn(impl, causal=True, seg=None, blocks=None):
  if impl == "pallas":
    return lambda q, k, v: prefill.mla_attention(q, k, v, segment_ids=seg, causal=causal,
                                                 scale=SCALE, backend="gpu", blocks=blocks)
  return lambda q, k, v: mla_attention(q, k, v, segment_ids=seg, causal=causal, scale=SCALE,
                                       implementation=impl)


def fwd_bwd(f):
  return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))


# --------------------------------------------------------------------------- checks


def check_prefill():
  ks = jax.random.split(jax.random.key(1), 4)
  b, t, h = 2, 1000, 4
  q, k = rand(ks[0], (b, t, h, DK)), rand(ks[1], (b, t, h, DK))
  v, do = rand(ks[2], (b, t, h, DV)), rand(ks[3], (b, t, h, DV))
  seg = jnp.stack([jnp.arange(t) // 300, jnp.arange(t) // 77]).astype(jnp.int32)
  up = lambda x: x.astype(jnp.float32)
  for impl, name, sg in (("pallas", "causal", None), ("pallas", "causal+docs", seg),
                         (None, "causal", None)):
    ref = lambda q, k, v: reference.attention(q, k, v, segment_ids=sg, causal=True, scale=SCALE)
    o_ref, g_ref = jax.vjp(ref, up(q), up(k), up(v))
    o, g = jax.vjp(attn(impl, seg=sg), q, k, v)
    errs = [rel_err(o, o_ref)] + [rel_err(x, y) for x, y in zip(g(do), g_ref(up(do)))]
    errs.append(rel_err(jax.jit(attn(impl, seg=sg))(q, k, v), o_ref))  # undifferentiated call
    emit({"check": f"prefill {impl or 'default'} {name} B{b} T{t} H{h}",
          "rel_err o,dq,dk,dv,o(no grad)": [round(e, 5) for e in errs], "ok": max(errs) < 2e-2})


def paged(key, lengths, ps=64):
  """A shuffled page pool holding each request's tokens, its page table and lengths."""
  lengths = np.asarray(lengths)
  pages = -(-lengths // ps)
  total, maxp = int(pages.sum()), int(pages.max())
  perm = np.random.default_rng(0).permutation(total)
  table = np.zeros((len(lengths), maxp), np.int32)
  off = 0
  for i, n in enumerate(pages):
    table[i, :n] = perm[off:off + n]
    off += n
  cache = rand(key, (total, ps, R + DR))
  return cache, jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


# Decode variants: name -> DecodeConfig fields for N requests (None: not timed at that N).
# Split counts above the default shorten the longest program (lengths 1K-64K, one program per SM).
DECODE_VARIANTS = {
    "triton": lambda n: {"gpu_kernel": "triton"},
    "mosaic": lambda n: {"gpu_kernel": "mosaic"},
    "mosaic 2x splits": lambda n: ({"gpu_kernel": "mosaic", "num_splits": 2 * _mosaic_splits(n)}
                                   if n > 1 else None),
    "mosaic 4x splits": lambda n: ({"gpu_kernel": "mosaic", "num_splits": 4 * _mosaic_splits(n)}
                                   if n > 1 else None),
}


def _mosaic_splits(n):
  """The Mosaic kernel's default split count at the timed shapes (2 row blocks of 64 rows, 1024
  steps)."""
  return decode.default_splits(n, 2, 65536 // 64, "gpu", decode.DecodeConfig().mgpu_waves)


def check_decode(variants=("triton",), lengths=(1000, 4096, 333, 8192, 64)):
  """Each variant against the float32 XLA reference, N5 ragged lengths, Tn 1 (default splits)
  and Tn 4 (3 splits). Returns the variants that passed."""
  ks = jax.random.split(jax.random.key(2), 2)
  cache, table, lens = paged(ks[0], lengths)
  good = []
  for name in variants:
    ok = True
    for tn, splits in ((1, None), (4, 3)):
      q = rand(ks[1], (5, tn, 96, R + DR))
      ref = reference.paged_decode(q.astype(jnp.float32), cache.astype(jnp.float32), table, lens,
                                   kv_lora_rank=R, scale=SCALE)
      cfg = dict(DECODE_VARIANTS[name](5), num_splits=splits)
      try:
        o = jax.jit(functools.partial(decode.mla_decode, kv_lora_rank=R, scale=SCALE,
                                      backend="gpu", config=decode.DecodeConfig(**cfg)))(
                                          q, cache, table, lens)
        err = rel_err(o, ref)
      except Exception as e:  # noqa: BLE001 (report and go on with the other variants)
        emit({"check": f"decode {name} N5 Tn{tn} H96 ragged", "error": repr(e)[:600],
              "ok": False})
        ok = False
        break
      emit({"check": f"decode {name} N5 Tn{tn} H96 ragged splits {splits or 'auto'}",
            "rel_err": round(err, 5), "ok": err < 2e-2})
      ok = ok and err < 2e-2
    if ok:
      good.append(name)
  return good


# --------------------------------------------------------------------------- timing


def prefill_flops(b, t, h, seg_len=None):
  pairs = b * h * (t * t / 2 if seg_len is None else (t // seg_len) * seg_len * seg_len / 2)
  return 2 * pairs * (DK + DV), 2 * pairs * (4 * DK + 3 * DV)  # fwd, fwd+bwd (useful)


CUDNN_CAUSAL: dict = {}  # (b, t, h) -> {"f": fwd ms, "fb": fwd+bwd ms}


def time_prefill(b, t, h, blocks, budget, with_cudnn=True):
  ks = jax.random.split(jax.random.key(3), 4)
  q, k = rand(ks[0], (b, t, h, DK)), rand(ks[1], (b, t, h, DK))
  v, do = rand(ks[2], (b, t, h, DV)), rand(ks[3], (b, t, h, DV))
  seg = docs(b, t, 4096)
  cases = [("cudnn", "causal", attn("cudnn"), None),
           ("pallas", "causal", attn("pallas", blocks=blocks), None),
           ("pallas", "docs4K", attn("pallas", seg=seg, blocks=blocks), 4096),
           ("default", "causal", attn(None), None)]
  if with_cudnn == "mask":
    cases.append(("cudnn", "docs4K(mask)", attn("cudnn", seg=seg), 4096))
  elif not with_cudnn:
    cases = [c for c in cases if c[0] == "pallas"]
  base = CUDNN_CAUSAL.get((b, t, h), {})
  for impl, mode, f, seg_len in cases:
    if time.perf_counter() - START > budget:
      emit({"skipped": f"prefill {impl} {mode} B{b} T{t} H{h} (time budget)"})
      continue
    ff, fb = prefill_flops(b, t, h, seg_len)
    try:
      ms_f = timeit(jax.jit(f), q, k, v)
      ms_fb = timeit(fwd_bwd(f), q, k, v, do)
    except Exception as e:  # noqa: BLE001 (report and go on)
      emit({"name": f"prefill {impl} {mode} B{b} T{t} H{h}", "error": repr(e)[:300]})
      continue
    if impl == "cudnn" and mode == "causal":
      base = CUDNN_CAUSAL[(b, t, h)] = {"f": ms_f, "fb": ms_fb}
    emit({"name": f"prefill {impl} {mode} B{b} T{t} H{h}", "fwd_ms": round(ms_f, 3),
          "fwd_tflops": round(ff / ms_f / 1e9, 1), "fwdbwd_ms": round(ms_fb, 3),
          "fwdbwd_tflops": round(fb / ms_fb / 1e9, 1),
          "cudnn_causal/this fwd": round(base["f"] / ms_f, 2) if base else None,
          "cudnn_causal/this fwdbwd": round(base["fb"] / ms_fb, 2) if base else None})


def decode_case(n, key):
  rng = np.random.default_rng(n)
  lengths = [65536] if n == 1 else rng.integers(1024, 65536, n, endpoint=True)
  cache, table, lens = paged(key, lengths)
  q = rand(jax.random.fold_in(key, 1), (n, 1, 96, R + DR))
  return q, cache, table, lens


def time_decode(n, cfg, budget, with_xla=True, variants=None, note=""):
  """Times ``decode.mla_decode`` with ``cfg`` (or each of ``variants``) and, if asked, the XLA
  reference at N requests; TB/s = cache bytes of the requests' tokens / time."""
  q, cache, table, lens = decode_case(n, jax.random.key(4))
  nbytes = int(np.asarray(lens).sum()) * (R + DR) * 2
  dec = lambda cfg: (lambda q, c, t, l: decode.mla_decode(
      q, c, t, l, kv_lora_rank=R, scale=SCALE, backend="gpu", config=decode.DecodeConfig(**cfg)))
  if variants is None:
    impls = [("pallas", dec(cfg))]
  else:
    impls = [(v, dec(DECODE_VARIANTS[v](n))) for v in variants
             if DECODE_VARIANTS[v](n) is not None]
  if with_xla:
    impls.append(("xla", lambda q, c, t, l: reference.paged_decode(q, c, t, l, kv_lora_rank=R,
                                                                    scale=SCALE)))
  out = {}
  for impl, f in impls:
    if time.perf_counter() - START > budget:
      emit({"skipped": f"decode {impl} N{n} (time budget)"})
      continue
    try:
      ms = timeit(jax.jit(f), q, cache, table, lens, inner=5)
    except Exception as e:  # noqa: BLE001
      emit({"name": f"decode {impl} N{n}", "error": repr(e)[:600]})
      continue
    out[impl] = ms
    row = {"name": f"decode {impl} N{n} H96 Tn1 lengths {int(np.min(lens))}-{int(np.max(lens))}"
                   f"{note}",
           "ms": round(ms, 3), "cache_tbps": round(nbytes / ms / 1e9, 2)}
    if impl == "xla" and "pallas" in out:
      row["xla/this"] = round(ms / out["pallas"], 2)
    emit(row)


# --------------------------------------------------------------------------- sweep


FWD = [dict(fwd_q=128, fwd_k=64, fwd_warps=8, fwd_stages=3),
       dict(fwd_q=128, fwd_k=128, fwd_warps=8, fwd_stages=2),
       dict(fwd_q=64, fwd_k=64, fwd_warps=4, fwd_stages=3)]
BWD = [dict(dkv_q=a, dkv_k=b, dkv_warps=w, dkv_stages=st, dq_q=c, dq_k=d, dq_warps=w, dq_stages=st)
       for a, b, c, d, w, st in ((64, 64, 64, 64, 4, 2), (64, 128, 128, 64, 8, 2),
                                 (32, 128, 128, 32, 8, 2), (64, 64, 64, 64, 8, 3))]
# Triton decode launch configurations as DecodeConfig fields (block_rows, step_tokens, warps
# apply to Triton only)
DEC = [dict(gpu_kernel="triton", block_rows=32, step_tokens=64, warps=4, stages=2),
       dict(gpu_kernel="triton", block_rows=32, step_tokens=32, warps=4, stages=2),
       dict(gpu_kernel="triton", block_rows=16, step_tokens=64, warps=4, stages=2),
       dict(gpu_kernel="triton", block_rows=32, step_tokens=64, warps=8, stages=2),
       dict(gpu_kernel="triton", block_rows=64, step_tokens=64, warps=8, stages=2),
       dict(gpu_kernel="triton", block_rows=32, step_tokens=64, warps=4, stages=2, num_splits=2),
       dict(gpu_kernel="triton", block_rows=32, step_tokens=32, warps=4, stages=3)]


def fastest(label, cfgs, ms_of, budget):
  """(fastest cfg, its ms) of ``cfgs`` timed by ``ms_of(cfg)`` until ``budget`` seconds into the
  run; each timing (or failure) is emitted. (None, None) when none ran."""
  best, best_ms = None, None
  for cfg in cfgs:
    if time.perf_counter() - START > budget:
      break
    try:
      ms = ms_of(cfg)
    except Exception as e:  # noqa: BLE001
      emit({"sweep": f"{label} {cfg}", "error": repr(e)[:200]})
      continue
    emit({"sweep": f"{label} {cfg}", "ms": round(ms, 3)})
    if best_ms is None or ms < best_ms:
      best, best_ms = cfg, ms
  return best, best_ms


def sweep_prefill(budget):
  """Best Blocks (fwd, then bwd on top of it) at B2 T8192 H96 causal."""
  ks = jax.random.split(jax.random.key(5), 4)
  b, t, h = 2, 8192, 96
  q, k = rand(ks[0], (b, t, h, DK)), rand(ks[1], (b, t, h, DK))
  v, do = rand(ks[2], (b, t, h, DV)), rand(ks[3], (b, t, h, DV))
  best = prefill.GPU_BLOCKS
  for cfgs, timed in ((FWD, lambda f: timeit(jax.jit(f), q, k, v, reps=3)),
                      (BWD, lambda f: timeit(fwd_bwd(f), q, k, v, do, reps=3))):
    base = best
    cfg, _ = fastest("prefill", cfgs, lambda c: timed(attn("pallas", blocks=dataclasses.replace(
        base, **c))), budget)
    best = base if cfg is None else dataclasses.replace(base, **cfg)
  emit({"best_blocks": dataclasses.asdict(best)})
  return best


def sweep_decode(budget):
  """Best Triton decode launch configuration at N=256."""
  q, cache, table, lens = decode_case(256, jax.random.key(4))
  dec = lambda cfg: jax.jit(lambda q, c, t, l: decode.mla_decode(
      q, c, t, l, kv_lora_rank=R, scale=SCALE, backend="gpu", config=decode.DecodeConfig(**cfg)))
  best, _ = fastest("decode N256", DEC, lambda cfg: timeit(dec(cfg), q, cache, table, lens, reps=3),
                    budget)
  best = best or {}
  emit({"best_decode": best})
  return best


def markdown(blocks, dec_cfg):
  dev = jax.devices()[0]
  lines = [f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on "
           f"{dev.device_kind}, jax {jax.__version__}, bf16, `benchmarks/mla.py`. "
           f"Prefill blocks: {dataclasses.asdict(blocks)}; decode config: {dec_cfg}.", "",
           "| case | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
           "| cuDNN causal / this (fwd, fwd+bwd) |",
           "|---|---|---|---|---|---|"]
  for r in ROWS:
    if "fwd_ms" in r:
      lines.append(f"| {r['name']} | {r['fwd_ms']} | {r['fwd_tflops']} | {r['fwdbwd_ms']} | "
                   f"{r['fwdbwd_tflops']} | {r['cudnn_causal/this fwd']}, "
                   f"{r['cudnn_causal/this fwdbwd']} |")
  lines += ["", "| decode case | ms | cache TB/s | XLA reference / this |", "|---|---|---|---|"]
  for r in ROWS:
    if "cache_tbps" in r:
      lines.append(f"| {r['name']} | {r['ms']} | {r['cache_tbps']} | {r.get('xla/this') or ''} |")
  errs = lambda r: r.get("rel_err", r.get("rel_err o,dq,dk,dv,o(no grad)"))
  lines += ["", "Checks: " + "; ".join(
      f"{r['check']}: {'ok' if r['ok'] else 'FAIL'} {errs(r)}" for r in ROWS if "check" in r)]
  return "\n".join(lines) + "\n"


def decode_only(budget):
  """Per kernel (Mosaic GPU, Triton): check it, then time its variants at
  N = 256, 64, 1. A variant that fails its check is still timed (its rows say so); a watchdog
  ends the process 15 s after the budget, so a kernel that hangs on the card costs only what
  follows it."""
  faulthandler.dump_traceback_later(budget + 15, exit=True)
  for kernel in ("mosaic", "triton"):
    ok = check_decode((kernel,))
    if any("error" in r for r in ROWS if r.get("check", "").startswith(f"decode {kernel} ")):
      continue  # it does not build: timing would only repeat the error
    variants = [v for v in DECODE_VARIANTS if v.split()[0] == kernel]
    for n in (256, 64, 1):
      time_decode(n, {}, budget, with_xla=False, variants=variants,
                  note="" if ok else " (CHECK FAILED)")
  faulthandler.cancel_dump_traceback_later()
  lines = ["| decode case | ms | cache TB/s |", "|---|---|---|"]
  lines += [f"| {r['name']} | {r['ms']} | {r['cache_tbps']} |" for r in ROWS if "cache_tbps" in r]
  lines += [f"| {r['name']} | error: {r['error'][:200]} | |" for r in ROWS
            if "error" in r and "name" in r]
  lines += ["", "Checks: " + "; ".join(
      f"{r['check']}: {'ok' if r['ok'] else 'FAIL'} {r.get('rel_err', r.get('error', ''))}"
      for r in ROWS if "check" in r)]
  md = "\n".join(lines) + "\n"
  print(md, flush=True)
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "mla_decode.md"), "w") as f:
      f.write(md)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", choices=("none", "prefill", "decode", "all"), default="none",
                  help="pick tile sizes first (prefill at B2 T8192 H96, decode at N=256)")
  ap.add_argument("--cudnn-mask", action="store_true", help="also time cuDNN with a dense mask")
  ap.add_argument("--budget", type=float, default=None,
                  help="seconds before skipping the rest (default 480; 90 with --decode-only)")
  ap.add_argument("--decode-only", action="store_true",
                  help="check and time only the decode variants (Mosaic GPU, Triton)")
  args = ap.parse_args()
  print(jax.devices(), flush=True)
  if args.decode_only:
    decode_only(args.budget or 90.0)
    return
  args.budget = args.budget or 480.0
  check_prefill()
  check_decode()
  blocks, dec_cfg = prefill.GPU_BLOCKS, {}
  left = lambda frac: time.perf_counter() - START + frac * args.budget  # a share of the budget
  if args.sweep in ("prefill", "all"):
    blocks = sweep_prefill(left(0.4))
  if args.sweep in ("decode", "all"):
    dec_cfg = sweep_decode(left(0.25))
  for n in (256, 64, 1):
    time_decode(n, dec_cfg, args.budget, with_xla=n == 256)
  for b, t, h in ((1, 16384, 32), (2, 8192, 96)):
    time_prefill(b, t, h, blocks, args.budget, with_cudnn="mask" if args.cudnn_mask else True)
  md = markdown(blocks, dec_cfg)
  print(md, flush=True)
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "mla.md"), "w") as f:
      f.write(md)


if __name__ == "__main__":
  main()
