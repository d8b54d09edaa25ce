"""Block AttnRes mixing as Triton kernels through Pallas (interpret mode off GPU).

The S sources ``v_i`` (each ``[B, T, d]``) are viewed as ``[N, d]`` rows (N = B*T, a free
reshape) and passed as S separate refs: the kernels are built per S, nothing is stacked. With
``w = norm * proj`` (float32 ``[d]``), per row ``r_i = rsqrt(mean(v_i^2) + eps)``,
``logit_i = (w . v_i) r_i``, ``p = softmax_i(logit)`` and ``out = sum_i p_i v_i``.

Forward: one program per block of ``br`` rows. Pass 1 walks d in chunks of ``bd`` columns and
accumulates, per row and source, ``sum(v_i^2)`` and ``w . v_i`` in float32; then logits and p;
pass 2 walks the chunks again and writes out. With a single chunk (``bd >= d``) the tiles loaded
by pass 1 stay in registers for pass 2 (each source read once); with several, pass 2 re-reads a
program's few tens of KB, which are still in L1/L2. As S grows the row tile, then the column
tile, shrinks to bound the registers (:class:`Config`). Nothing is saved for the backward but the
inputs.

Backward, for ``dout = g``: one program per ``steps`` row blocks. Pass 1 recomputes the logits
and p, and accumulates ``dp_i = g . v_i``; the logits' cotangent is
``ds_i = p_i (dp_i - sum_j p_j dp_j)``. Since ``d logit_i / d v_i = r_i w - logit_i r_i^2 v_i / d``,
pass 2 writes ::

    dv_i = p_i g + ds_i r_i w - (ds_i logit_i r_i^2 / d) v_i

and accumulates ``dw = sum_rows sum_i ds_i r_i v_i`` in float32 registers (one ``[bd]`` vector
per chunk of d: pass 2's chunk loop is unrolled), written as per-program partials
``[programs, d]`` summed outside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import default_backend


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles and warps. Forward: ``br`` rows x ``bd`` columns per tile, ``warps`` warps.
  Backward: ``bwd_br`` x ``bwd_bd`` tiles, ``bwd_steps`` row blocks per program (fewer dw
  partials), ``bwd_warps`` warps. The column tile is capped at d's next power of two (a tile as
  wide as d keeps the sources in registers between the two passes). The row tile, then the
  column tile, is halved while the float32 tiles a pass holds at once (S, or S + 1 with g) would
  take more than ``regs`` registers per thread (ptxas's total is about twice that: ``regs=48``
  keeps the kernels near 128 registers, two or more programs per SM, without spills).
  Backward tiles and warps from ``benchmarks/attn_res.py``'s sweep on an H200, which this
  register rule gives (benchmarks/RESULTS.md, "Step glue kernels", Block AttnRes mixture)."""
  br: int = 2
  bd: int = 1024
  warps: int = 4
  bwd_br: int = 2
  bwd_bd: int = 1024
  bwd_steps: int = 16
  bwd_warps: int = 4
  regs: int = 48
  stages: int = 1


def _interpret() -> bool:
  return default_backend() != "gpu"


def _cdiv(n, blk):
  return -(-n // blk)


class _Tiles:
  """Masked ``[br, bd]`` tiles of ``[N, d]`` refs at row block r0 (trace-time helper)."""

  def __init__(self, r0, n, d, br, bd):
    self.r0, self.n, self.d, self.br, self.bd = r0, n, d, br, bd

  def mask(self, c0):
    """``[br, bd]`` in-range rows and columns, None where N and d are multiples of the tile."""
    ok = None
    if self.n % self.br:
      ok = (self.r0 + jnp.arange(self.br, dtype=jnp.int32) < self.n)[:, None]
    if self.d % self.bd:
      col = (c0 + jnp.arange(self.bd, dtype=jnp.int32) < self.d)[None, :]
      ok = col if ok is None else ok & col
    return None if ok is None else jnp.broadcast_to(ok, (self.br, self.bd))

  def load(self, ref, c0):
    """``ref[r0 : r0+br, c0 : c0+bd]`` as float32, zeros out of range."""
    mask = self.mask(c0)
    kw = {} if mask is None else {"mask": mask, "other": 0}
    return plgpu.load(ref.at[pl.ds(self.r0, self.br), pl.ds(c0, self.bd)], **kw).astype(jnp.float32)

  def load_w(self, w_ref, c0):
    """``w[c0 : c0+bd]`` as ``[1, bd]``, zeros past d."""
    kw = {}
    if self.d % self.bd:
      kw = {"mask": c0 + jnp.arange(self.bd, dtype=jnp.int32) < self.d, "other": 0}
    return plgpu.load(w_ref.at[pl.ds(c0, self.bd)], **kw)[None, :]

  def store(self, ref, c0, val):
    mask = self.mask(c0)
    plgpu.store(ref.at[pl.ds(self.r0, self.br), pl.ds(c0, self.bd)], val.astype(ref.dtype),
                **({} if mask is None else {"mask": mask}))


def _stats(tiles: _Tiles, w_ref, refs, nd, with_g):
  """Pass 1 over the d chunks: per source ``sum(v^2)`` and ``w . v`` (and ``g . v`` when
  ``with_g``: refs' last entry is g), each ``[br]`` float32. Returns (stats, the loaded tiles
  when there is one chunk else None)."""
  s = len(refs) - 1 if with_g else len(refs)

  def chunk(k, carry):
    c0 = k * tiles.bd
    wk = tiles.load_w(w_ref, c0)
    vs = [tiles.load(r, c0) for r in refs]
    g = vs[s] if with_g else None
    out = list(carry)
    for i in range(s):
      terms = [vs[i] * vs[i], vs[i] * wk] + ([vs[i] * g] if with_g else [])
      for j, x in enumerate(terms):
        out[len(terms) * i + j] = out[len(terms) * i + j] + jnp.sum(x, axis=1)
    return tuple(out), vs

  zeros = (jnp.zeros((tiles.br,), jnp.float32),) * (s * (3 if with_g else 2))
  # int32 chunk starts like the row start: under x64 interpret mode's masked loads and stores
  # refuse an int64 (a Python int, a Python-bounded loop index) beside it
  if nd == 1:
    return chunk(jnp.int32(0), zeros)
  return jax.lax.fori_loop(jnp.int32(0), nd, lambda k, c: chunk(k, c)[0], zeros), None


def _softmax(ssq, dots, d, eps):
  """(r, logit, p): lists of S ``[br]`` float32 from the sums of squares and ``w . v``."""
  r = [jax.lax.rsqrt(q * (1.0 / d) + eps) for q in ssq]
  logit = [a * ri for a, ri in zip(dots, r)]
  m = functools.reduce(jnp.maximum, logit)
  e = [jnp.exp(x - m) for x in logit]
  inv = 1.0 / functools.reduce(jnp.add, e)
  return r, logit, [x * inv for x in e]


def _fwd_kernel(w_ref, *refs, s, n, d, br, bd, eps):
  srcs, out_ref = refs[:s], refs[s]
  tiles = _Tiles(pl.program_id(0) * br, n, d, br, bd)
  nd = _cdiv(d, bd)
  st, cached = _stats(tiles, w_ref, srcs, nd, with_g=False)
  _, _, p = _softmax(st[0::2], st[1::2], d, eps)

  def mix(k, carry):
    c0 = k * bd
    vs = cached if cached is not None else [tiles.load(r, c0) for r in srcs]
    tiles.store(out_ref, c0, functools.reduce(jnp.add, [pi[:, None] * v for pi, v in zip(p, vs)]))
    return carry

  if nd == 1:
    mix(jnp.int32(0), 0)
  else:
    jax.lax.fori_loop(jnp.int32(0), nd, mix, 0)


def _bwd_kernel(w_ref, g_ref, *refs, s, n, d, br, bd, steps, blocks, eps):
  srcs, dsrcs, dw_ref = refs[:s], refs[s:2 * s], refs[2 * s]
  prog = pl.program_id(0)
  nd = _cdiv(d, bd)

  def step(j, dws):
    tiles = _Tiles((prog * steps + j) * br, n, d, br, bd)
    st, cached = _stats(tiles, w_ref, (*srcs, g_ref), nd, with_g=True)
    r, logit, p = _softmax(st[0::3], st[1::3], d, eps)
    dp = st[2::3]
    pdp = functools.reduce(jnp.add, [pi * x for pi, x in zip(p, dp)])
    ds = [pi * (x - pdp) for pi, x in zip(p, dp)]
    cw = [x * ri for x, ri in zip(ds, r)]  # coefficient of w (and of v in dw)
    cv = [-x * lg * ri * ri * (1.0 / d) for x, lg, ri in zip(ds, logit, r)]  # of v in dv
    out = []
    for k in range(nd):
      c0 = jnp.int32(k * bd)  # traced: a static start may not overrun d
      vs = cached if cached is not None else [tiles.load(x, c0) for x in (*srcs, g_ref)]
      g, wk = vs[s], tiles.load_w(w_ref, c0)
      acc = None
      for i in range(s):
        tiles.store(dsrcs[i], c0, p[i][:, None] * g + cw[i][:, None] * wk + cv[i][:, None] * vs[i])
        term = cw[i][:, None] * vs[i]
        acc = term if acc is None else acc + term
      out.append(dws[k] + jnp.sum(acc, axis=0))
    return tuple(out)

  todo = jnp.minimum(steps, blocks - prog * steps)  # the last program may have fewer blocks
  dws = jax.lax.fori_loop(0, todo, step, (jnp.zeros((bd,), jnp.float32),) * nd)
  for k in range(nd):
    c0 = jnp.int32(k * bd)
    kw = {}
    if d % bd:
      kw = {"mask": c0 + jnp.arange(bd, dtype=jnp.int32) < d}
    plgpu.store(dw_ref.at[prog, pl.ds(c0, bd)], dws[k], **kw)


def _fit(n, d, br, bd, held, warps, regs):
  """(br, bd) as powers of two: br capped at N's next power of two, bd at d's; then br, and once
  it is 1 bd (down to 16), halved while ``held`` float32 ``[br, bd]`` tiles exceed ``regs``
  registers per thread."""
  br, bd = min(br, pl.next_power_of_2(n)), min(bd, pl.next_power_of_2(d))
  while bd > 16 and held * br * bd > regs * 32 * warps:
    if br > 1:
      br //= 2
    else:
      bd //= 2
  return br, bd


def tiles(cfg: Config, s: int, n: int, d: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """The (rows, columns) tiles the forward and the backward use for S sources of ``[N, d]``."""
  return (_fit(n, d, cfg.br, cfg.bd, s, cfg.warps, cfg.regs),
          _fit(n, d, cfg.bwd_br, cfg.bwd_bd, s + 1, cfg.bwd_warps, cfg.regs))


def _forward(cfg: Config, eps, sources, w):
  shape, dtype = sources[0].shape, sources[0].dtype
  d = shape[-1]
  flat = [x.reshape(-1, d) for x in sources]
  n = flat[0].shape[0]
  br, bd = tiles(cfg, len(flat), n, d)[0]
  kern = functools.partial(_fwd_kernel, s=len(flat), n=n, d=d, br=br, bd=bd, eps=eps)
  out = pl.pallas_call(
      kern, grid=(_cdiv(n, br),), out_shape=jax.ShapeDtypeStruct((n, d), dtype),
      interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.warps, num_stages=cfg.stages),
      name="attn_res_fwd")(w, *flat)
  return out.reshape(shape)


def _backward(cfg: Config, eps, sources, w, g):
  """(d sources in their dtypes, dw float32 ``[d]``)."""
  shape = sources[0].shape
  d = shape[-1]
  flat = [x.reshape(-1, d) for x in sources]
  n = flat[0].shape[0]
  br, bd = tiles(cfg, len(flat), n, d)[1]
  blocks = _cdiv(n, br)
  steps = min(cfg.bwd_steps, blocks)
  progs = _cdiv(blocks, steps)
  kern = functools.partial(_bwd_kernel, s=len(flat), n=n, d=d, br=br, bd=bd, steps=steps,
                           blocks=blocks, eps=eps)
  *dsrc, dw = pl.pallas_call(
      kern, grid=(progs,),
      out_shape=(*(jax.ShapeDtypeStruct((n, d), x.dtype) for x in flat),
                 jax.ShapeDtypeStruct((progs, d), jnp.float32)),
      interpret=_interpret(),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.bwd_warps, num_stages=cfg.stages),
      name="attn_res_bwd")(w, g.reshape(n, d), *flat)
  return tuple(x.reshape(shape) for x in dsrc), jnp.sum(dw, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mix(cfg, eps, sources, w):
  return _forward(cfg, eps, sources, w)


def _mix_fwd(cfg, eps, sources, w):
  return _forward(cfg, eps, sources, w), (sources, w)


def _mix_bwd(cfg, eps, res, g):
  sources, w = res
  return _backward(cfg, eps, sources, w, g)


_mix.defvjp(_mix_fwd, _mix_bwd)


def attn_res(sources, proj, norm, eps, config: Config = Config()):
  """See :func:`pallas_kernels.attn_res.attn_res` (shapes checked there).

  sources: S arrays ``[B, T, d]``; proj, norm: ``[d]`` (norm None: proj is the query). Returns
  ``[B, T, d]`` in the sources' dtype (float32 arithmetic inside)."""
  w = proj.astype(jnp.float32)
  if norm is not None:
    w = norm.astype(jnp.float32) * w
  return _mix(config, float(eps), tuple(sources), w)
