"""Hugging Face safetensors <-> k3jax parameters, for Kimi Linear and Kimi K3 (SPEC section 9).

Three layers, each usable on its own:

- Config: :func:`config_from_hf` maps a ``config.json`` (``kimi_linear``, or ``kimi_k3`` whose
  language model sits in ``text_config``; released field names or the transformers-native ones) to
  :class:`~k3jax.config.ModelConfig`; :func:`config_to_hf` goes back.
- Names: :func:`plan` lists, for every parameter of :class:`~k3jax.model.K3Model`, the HF tensors
  it is made of and how (transpose a torch ``Linear [out, in]``, reshape a conv ``[C, 1, W]``,
  stack per-expert ``w1/w3/w2`` into ``[E, L, 2F]`` / ``[E, F, L]``, ...). :func:`validate` checks
  a checkpoint against it and lists every missing, unexpected or wrongly shaped tensor in one error.
- Streaming: :func:`hf_to_orbax` reads one tensor (or one expert) at a time with ``pread`` from
  the safetensors shards and writes it straight into the Orbax/tensorstore array (a custom Orbax
  type handler), so host memory stays near one block, never a whole ``[E, ...]`` expert stack;
  :func:`orbax_to_hf` reads the Orbax arrays slice by slice and streams safetensors shards out.

K3's routed experts are stored MXFP4 (compressed-tensors ``mxfp4-pack-quantized``): per weight
``weight_packed [R, C/2] uint8`` (two E2M1 codes per byte, the even column in the low nibble) and
``weight_scale [R, C/32] uint8`` (E8M0: ``2 ** (s - 127)`` for each group of 32 columns).
:func:`mxfp4_dequantize` is exact in bfloat16/float32; :func:`mxfp4_quantize` follows the
compressed-tensors rule and is lossless on dequantized values, so HF -> Orbax -> HF reproduces
the original bytes.

Converted directory layout (``OUT_DIR``): ``params/`` (Orbax PyTree checkpoint: nested dicts
following the NNX attribute paths, layers keyed "0", "1", ...), ``config.json`` (the HF config as
found), ``k3jax.yaml`` (our :class:`ModelConfig`), ``hf_manifest.json`` (HF names, dtypes and
shapes, used by ``orbax-to-hf`` to reproduce the checkpoint exactly) and ``hf_extra/`` (the
source's other small files: tokenizer, generation config).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
import shutil
import struct
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, Sequence

import ml_dtypes
import numpy as np
import yaml

from k3jax import config as config_lib
from k3jax.config import ModelConfig


class ConversionError(ValueError):
  """A checkpoint or config cannot be converted; the message names every offending item."""


# ---------------------------------------------------------------------------------------------
# Config mapping.

ARCHS = ("kimi_linear", "kimi_k3")


def _text_config(hf: dict) -> dict:
  """The language-model part of an HF config (K3 keeps it under ``text_config``)."""
  return hf.get("text_config") or hf


def _arch(hf: dict) -> str:
  arch = hf.get("model_type")
  if arch not in ARCHS:
    raise ConversionError(f"config.json: model_type {arch!r} is not one of {ARCHS}")
  return arch


def _first(d: dict, *keys, default=None):
  for k in keys:
    if d.get(k) is not None:
      return d[k]
  return default


def config_from_hf(hf: dict, *, name: str = "hf", param_dtype: str | None = None) -> ModelConfig:
  """Maps an HF ``config.json`` (as a dict) to a validated :class:`ModelConfig`.

  Raises :class:`ConversionError` naming each field whose value k3jax cannot represent.
  """
  arch = _arch(hf)
  t = _text_config(hf)
  lin = t.get("linear_attn_config") or {}
  problems = []
  n = _first(t, "num_hidden_layers")
  if not isinstance(n, int):
    raise ConversionError("config.json: num_hidden_layers is missing")
  if "full_attn_layers" in lin:
    mla = tuple(sorted(i - 1 for i in lin["full_attn_layers"]))  # 1-based in the release
  elif t.get("layer_types"):
    mla = tuple(i for i, k in enumerate(t["layer_types"]) if k == "full_attention")
  else:  # transformers' default pattern
    mla = tuple(i for i in range(n) if i and i % 4 == 0)
  if t.get("mlp_layer_types"):
    dense = tuple(i for i, k in enumerate(t["mlp_layer_types"]) if k == "dense")
  else:
    dense = tuple(range(int(_first(t, "first_k_dense_replace", default=1))))
  if _first(t, "moe_layer_freq", default=1) != 1:
    problems.append(f"moe_layer_freq={t['moe_layer_freq']} (only 1 is supported)")
  if t.get("tie_word_embeddings"):
    problems.append("tie_word_embeddings=true (k3jax has an untied lm_head)")
  if t.get("mla_use_nope") is False:
    problems.append("mla_use_nope=false (k3jax implements NoPE MLA only)")
  heads = _first(t, "num_attention_heads")
  if _first(t, "num_key_value_heads", default=heads) != heads:
    problems.append(f"num_key_value_heads={t['num_key_value_heads']} != num_attention_heads={heads}")
  if _first(t, "moe_router_activation_func", "scoring_func", default="sigmoid") != "sigmoid":
    problems.append("moe_router_activation_func must be sigmoid")
  if _first(t, "num_expert_group", "n_group", default=1) != 1 or _first(t, "topk_group", default=1) != 1:
    problems.append("grouped routing (num_expert_group/topk_group > 1) is not supported")
  latent = _first(t, "routed_expert_hidden_size", "moe_latent_hidden_size", default=0)
  if latent and t.get("latent_moe_use_norm") is False:
    problems.append("latent_moe_use_norm=false (k3jax always normalises the latent)")
  act = t.get("hidden_act", "silu")
  if act not in ("silu", "situ"):
    problems.append(f"hidden_act={act!r} (silu or situ)")
  if problems:
    raise ConversionError("config.json: unsupported values: " + "; ".join(problems))

  kda_dim = _first(lin, "head_dim", default=_first(t, "linear_head_dim", default=128))
  eos = t.get("eos_token_id", 2)
  if isinstance(eos, list):
    eos = eos[0]
  dtype_name = param_dtype or {"float32": "float32", "bfloat16": "bfloat16"}.get(
      _first(hf, "torch_dtype", "dtype", default=_first(t, "torch_dtype", "dtype", default="bfloat16")),
      "bfloat16")
  model = dict(
      name=name, arch=arch,
      vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_layers=n,
      rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
      mla_layers=list(mla), dense_layers=list(dense),
      dense_intermediate=t["intermediate_size"],
      activation=act,
      situ_beta=float(_first(t, "activation_situ_beta", default=4.0)),
      situ_linear_beta=float(_first(t, "activation_situ_linear_beta", default=25.0)),
      max_position=int(_first(t, "model_max_length", "max_position_embeddings", default=1_048_576)),
      bos_token_id=_first(t, "bos_token_id", default=1),
      eos_token_id=eos,
      pad_token_id=_first(t, "pad_token_id", default=0),
      param_dtype=dtype_name, compute_dtype=dtype_name,
      kda=dict(
          num_heads=_first(lin, "num_heads", default=_first(t, "linear_num_heads", default=32)),
          head_dim=kda_dim, v_head_dim=kda_dim,
          conv_size=_first(lin, "short_conv_kernel_size", default=_first(t, "linear_conv_kernel_dim", default=4)),
          gate="bounded" if lin.get("gate_lower_bound") is not None else "softplus",
          gate_lower_bound=float(_first(lin, "gate_lower_bound", default=-5.0)),
          output_gate="full" if lin.get("use_full_rank_gate") else "low_rank",
          output_gate_rank=kda_dim),
      mla=dict(
          num_heads=heads, q_lora_rank=t.get("q_lora_rank") or 0,
          kv_lora_rank=t["kv_lora_rank"], qk_nope_head_dim=t["qk_nope_head_dim"],
          qk_rope_head_dim=t["qk_rope_head_dim"], v_head_dim=t["v_head_dim"],
          output_gate=bool(t.get("mla_use_output_gate", False))),
      moe=dict(
          num_experts=_first(t, "num_experts", "num_local_experts", "n_routed_experts"),
          top_k=_first(t, "num_experts_per_token", "num_experts_per_tok"),
          num_shared_experts=_first(t, "num_shared_experts", "n_shared_experts", default=0),
          expert_intermediate=t["moe_intermediate_size"],
          latent_dim=latent or 0,
          routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
          renormalize=bool(_first(t, "moe_renormalize", "norm_topk_prob", default=True))),
      attn_res=dict(enabled=t.get("attn_res_block_size") is not None,
                    block_size=t.get("attn_res_block_size") or 12),
  )
  try:
    return config_lib.from_dict({"model": model}).model
  except config_lib.ConfigError as e:
    raise ConversionError(f"config.json maps to an invalid k3jax config: {e}") from e


def config_to_hf(cfg: ModelConfig) -> dict:
  """An HF ``config.json`` in the released format for ``cfg`` (inverse of :func:`config_from_hf`)."""
  k, a, m = cfg.kda, cfg.mla, cfg.moe
  fixed = {"kda.v_head_dim": k.v_head_dim, "kda.value_heads / num_heads": k.value_heads // k.num_heads * k.head_dim,
           "kda.f_rank": k.f_rank}
  if k.output_gate == "low_rank":
    fixed["kda.output_gate_rank"] = k.output_gate_rank
  odd = [f"{n}={v}" for n, v in fixed.items() if v != k.head_dim]
  if odd:
    raise ConversionError(f"HF configs tie these KDA sizes to head_dim={k.head_dim}: " + ", ".join(odd))
  lin = {
      "num_heads": k.num_heads, "head_dim": k.head_dim, "short_conv_kernel_size": k.conv_size,
      "kda_layers": [i + 1 for i in range(cfg.num_layers) if cfg.layer_kind(i) == "kda"],
      "full_attn_layers": [i + 1 for i in cfg.mla_layers],
  }
  if k.gate == "bounded":
    lin["gate_lower_bound"] = k.gate_lower_bound
  if k.output_gate == "full":
    lin["use_full_rank_gate"] = True
  dense = sorted(cfg.dense_layers)
  if dense != list(range(len(dense))):
    raise ConversionError(f"dense_layers={cfg.dense_layers}: HF configs only express a dense prefix "
                          "(first_k_dense_replace)")
  dtype = {"float32": "float32", "bfloat16": "bfloat16", "float64": "float32"}[cfg.param_dtype]
  t = {
      "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers, "rms_norm_eps": cfg.rms_norm_eps,
      "intermediate_size": cfg.dense_intermediate, "first_k_dense_replace": len(dense),
      "hidden_act": cfg.activation, "model_max_length": cfg.max_position,
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
      "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": False, "torch_dtype": dtype,
      "linear_attn_config": lin,
      "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_heads,
      "q_lora_rank": a.q_lora_rank or None, "kv_lora_rank": a.kv_lora_rank,
      "qk_nope_head_dim": a.qk_nope_head_dim, "qk_rope_head_dim": a.qk_rope_head_dim,
      "v_head_dim": a.v_head_dim, "mla_use_nope": True,
      "num_experts": m.num_experts, "num_experts_per_token": m.top_k,
      "num_shared_experts": m.num_shared_experts, "moe_intermediate_size": m.expert_intermediate,
      "routed_scaling_factor": m.routed_scaling_factor, "moe_renormalize": m.renormalize,
      "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
      "moe_layer_freq": 1,
  }
  if cfg.activation == "situ":
    t.update(activation_situ_beta=cfg.situ_beta, activation_situ_linear_beta=cfg.situ_linear_beta)
  if a.output_gate:
    t["mla_use_output_gate"] = True
  if m.latent_dim:
    t.update(routed_expert_hidden_size=m.latent_dim, latent_moe_use_norm=True)
  if cfg.attn_res.enabled:
    t["attn_res_block_size"] = cfg.attn_res.block_size
  if cfg.arch == "kimi_linear":
    return t
  return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
          "torch_dtype": dtype, "text_config": t}


# ---------------------------------------------------------------------------------------------
# MXFP4 (compressed-tensors mxfp4-pack-quantized).

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
MXFP4_GROUP = 32
_CODES = np.concatenate([E2M1, -E2M1])  # code -> value; code 8 is -0.0
# byte -> (even, odd) values, each pair packed in one 64-bit (float32) / 32-bit (bfloat16) word so
# that dequantization is one np.take
_PAIRS = np.stack([_CODES[np.arange(256) & 15], _CODES[np.arange(256) >> 4]], 1)
_MXFP4_PAIRS = _PAIRS.astype(np.float32).view(np.float64).reshape(256)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_MXFP4_BF16_PAIRS = _PAIRS.astype(_BF16).view(np.uint32).reshape(256)
_MXFP4_NONZERO = np.where(_PAIRS != 0, 0xFFFF, 0).astype(np.uint16).view(np.uint32).reshape(256)
_E8M0 = np.append(np.ldexp(np.float32(1), np.arange(255) - 127), np.nan).astype(np.float32)  # 255: NaN


def mxfp4_dequantize(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
  """``packed [R, C/2] uint8``, ``scale [R, C/32] uint8`` -> ``[R, C]`` in ``dtype`` (float32 or
  bfloat16; exact in both)."""
  r, half = packed.shape
  c = 2 * half
  if packed.dtype != np.uint8 or scale.dtype != np.uint8:
    raise ConversionError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scale.dtype}")
  if c % MXFP4_GROUP or scale.shape != (r, c // MXFP4_GROUP):
    raise ConversionError(f"MXFP4 scale shape {scale.shape} does not fit packed shape {packed.shape}")
  if np.any(scale == 255):
    raise ConversionError("MXFP4 scale holds the E8M0 NaN code 255")
  if np.dtype(dtype) == _BF16 and scale.min() >= 2 and scale.max() <= 252:
    # bfloat16 directly: add (scale - 127) to the exponent field of the non-zero codes (the
    # result stays a normal number for scales in [2, 252])
    grouped = (r, c // MXFP4_GROUP, MXFP4_GROUP)
    bits = np.take(_MXFP4_BF16_PAIRS, packed).view(np.uint16).reshape(grouped)
    shift = np.take(_MXFP4_NONZERO, packed).view(np.uint16).reshape(grouped)
    shift &= ((scale.astype(np.int32) - 127) << 7).astype(np.uint16)[..., None]
    bits += shift  # uint16 arithmetic: a negative shift wraps correctly
    return bits.reshape(r, c).view(_BF16)
  vals = np.take(_MXFP4_PAIRS, packed).view(np.float32).reshape(r, c // MXFP4_GROUP, MXFP4_GROUP)
  vals *= _E8M0[scale][..., None]  # powers of two: exact
  return vals.reshape(r, c).astype(dtype, copy=False)


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``[R, C]`` float -> (``packed [R, C/2]``, ``scale [R, C/32]``), the compressed-tensors rule.

  The group scale is ``2 ** (floor(log2(round_to_power_2(amax))) - 2)`` and each value rounds
  to the nearest E2M1 code. Values that are already on the MXFP4 grid come back exactly, with the
  original scale whenever the group's largest code is 4 or 6 (always the case for checkpoints this
  rule produced). An all-zero group gets scale code 0.
  """
  r, c = w.shape
  if c % MXFP4_GROUP:
    raise ConversionError(f"MXFP4 needs a multiple of {MXFP4_GROUP} columns, got {c}")
  g = np.asarray(w, np.float32).reshape(r, c // MXFP4_GROUP, MXFP4_GROUP)
  amax = np.abs(g).max(-1)
  # round_to_power_2: add a quarter of the mantissa range, keep sign and exponent
  bits = (amax.view(np.uint32).astype(np.uint64) + (1 << 21)) & 0xFF800000
  biased = (bits >> 23).astype(np.int64)  # exponent field of the rounded power of two
  scale = np.where(amax > 0, np.clip(biased - 2, 0, 254), 0).astype(np.uint8)
  x = np.abs(np.ldexp(g, 127 - scale.astype(np.int32)[..., None]))
  idx = np.zeros(x.shape, np.uint8)
  # E2M1 rounding with the compressed-tensors tie rules
  for lo, inclusive, code in ((0.25, False, 1), (0.75, True, 2), (1.25, False, 3),
                              (1.75, True, 4), (2.5, False, 5), (3.5, True, 6), (5.0, False, 7)):
    idx = np.where((x >= lo) if inclusive else (x > lo), code, idx).astype(np.uint8)
  codes = (idx | (np.signbit(g).astype(np.uint8) << 3)).reshape(r, c)
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
  return packed, scale


# ---------------------------------------------------------------------------------------------
# Safetensors: a header-only index plus pread (no mmap, so bytes read never linger in RSS).

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
_NP_TO_ST = {v: k for k, v in _ST_DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  dtype: str  # safetensors dtype name, e.g. "BF16"
  shape: tuple[int, ...]
  file: Path
  offset: int  # absolute byte offset of the data in the file

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * _ST_DTYPES[self.dtype].itemsize


class SafetensorsReader:
  """Tensors of an HF directory (``model.safetensors`` or a sharded ``*.index.json`` set)."""

  def __init__(self, directory: str | Path):
    self.dir = Path(directory)
    index = self.dir / "model.safetensors.index.json"
    if index.is_file():
      weight_map = json.loads(index.read_text())["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(p.name for p in self.dir.glob("*.safetensors"))
    if not files:
      raise ConversionError(f"{self.dir}: no *.safetensors files")
    self.tensors: dict[str, TensorInfo] = {}
    for fname in files:
      path = self.dir / fname
      if not path.is_file():
        raise ConversionError(f"{index}: shard {fname} is missing")
      with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
      header.pop("__metadata__", None)
      for name, h in header.items():
        if h["dtype"] not in _ST_DTYPES:
          raise ConversionError(f"{name}: unsupported safetensors dtype {h['dtype']}")
        self.tensors[name] = TensorInfo(name, h["dtype"], tuple(h["shape"]), path,
                                        8 + n + h["data_offsets"][0])
    self._fds: dict[Path, int] = {}

  def close(self):
    for fd in self._fds.values():
      os.close(fd)
    self._fds.clear()

  def _pread(self, info: TensorInfo, start: int, nbytes: int) -> bytearray:
    fd = self._fds.get(info.file)
    if fd is None:
      fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
    buf = bytearray(nbytes)
    view, done = memoryview(buf), 0
    while done < nbytes:
      got = os.preadv(fd, [view[done:]], info.offset + start + done)
      if got <= 0:
        raise ConversionError(f"{info.file}: truncated while reading {info.name}")
      done += got
    return buf

  def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor (or rows ``[r0, r1)`` of its first axis) as a NumPy array."""
    info = self.tensors[name]
    dt = _ST_DTYPES[info.dtype]
    shape = info.shape
    row = math.prod(shape[1:]) * dt.itemsize if shape else dt.itemsize
    r0, r1 = rows if rows is not None else (0, shape[0] if shape else 1)
    data = np.frombuffer(self._pread(info, r0 * row, (r1 - r0) * row), dtype=dt)
    return data.reshape(((r1 - r0),) + shape[1:] if shape else ())


class SafetensorsWriter:
  """Streams tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards plus the index json.

  ``plan`` fixes names, dtypes and shapes up front (headers are written first); ``write`` must
  then be called once per tensor, in plan order.
  """

  def __init__(self, directory: Path, plan: Sequence[tuple[str, str, tuple[int, ...]]],
               max_shard_bytes: int = 5 << 30):
    self.dir = directory
    shards, cur, size = [], [], 0
    for item in plan:
      nbytes = math.prod(item[2]) * _ST_DTYPES[item[1]].itemsize
      if cur and size + nbytes > max_shard_bytes:
        shards.append(cur)
        cur, size = [], 0
      cur.append(item)
      size += nbytes
    shards.append(cur)
    self.files, self.order, self.weight_map = [], [], {}
    for i, shard in enumerate(shards):
      fname = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
               else "model.safetensors")
      header, off = {"__metadata__": {"format": "pt"}}, 0
      for name, dt, shape in shard:
        nbytes = math.prod(shape) * _ST_DTYPES[dt].itemsize
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
        self.order.append((name, dt, tuple(shape), fname))
        self.weight_map[name] = fname
      blob = json.dumps(header, separators=(",", ":")).encode()
      blob += b" " * (-len(blob) % 8)
      self.files.append((fname, blob, off))
    self.total_bytes = sum(f[2] for f in self.files)
    self._next, self._fh, self._fname = 0, None, None

  def write(self, name: str, array: np.ndarray):
    self.write_rows(name, [array], array.shape[0] if array.ndim else None)

  def write_rows(self, name: str, blocks, rows: int | None):
    """Writes tensor ``name`` from consecutive row blocks (``rows`` in all; None for a scalar)."""
    exp_name, dt, shape, fname = self.order[self._next]
    if name != exp_name or (shape[0] if shape else None) != rows:
      raise ConversionError(f"writer: got {name} with {rows} rows, expected {exp_name} {list(shape)}")
    if fname != self._fname:
      if self._fh:
        self._fh.close()
      blob = next(b for f, b, _ in self.files if f == fname)
      self._fh = open(self.dir / fname, "wb")
      self._fh.write(struct.pack("<Q", len(blob)) + blob)
      self._fname = fname
    done = 0
    for block in blocks:
      if tuple(block.shape[1:]) != tuple(shape[1:]) or _NP_TO_ST.get(block.dtype) != dt:
        raise ConversionError(f"writer: {name} block {block.dtype}{list(block.shape)} does not fit "
                              f"{dt}{list(shape)}")
      self._fh.write(np.ascontiguousarray(block).tobytes())
      done += block.shape[0] if block.ndim else 1
    if done != (shape[0] if shape else 1):
      raise ConversionError(f"writer: {name} got {done} rows, expected {list(shape)}")
    self._next += 1

  def close(self):
    if self._fh:
      self._fh.close()
    if self._next != len(self.order):
      raise ConversionError(f"writer: {len(self.order) - self._next} tensors were never written")
    if len(self.files) > 1:
      index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
      (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------------------------------------
# The name plan: which HF tensors make each k3jax parameter.

# kinds: "copy" (same layout), "linear" (torch [out, in] -> [in, out]), "conv" ([C, 1, W] ->
# [W, C]), "row" ([1, d] -> [d]), "a_log" (any of [H], [1, 1, H, 1], or [P >= H] zero padded ->
# [H]), "gate_up" (per expert w1, w3 [F, L] -> [E, L, 2F]), "down" (per expert w2 [L, F] ->
# [E, F, L]).


@dataclasses.dataclass(frozen=True)
class Param:
  path: str  # "layers.3.self_attn.q_proj.kernel"
  shape: tuple[int, ...]
  names: tuple[str | None, ...]  # logical sharding names
  kind: str
  sources: tuple[str, ...]  # HF base names (experts: "...experts.{e}.w1" etc., no ".weight")


def _model_params(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple]]:
  """(path, shape, sharding names) of every variable of K3Model(cfg), without allocating."""
  from flax import nnx
  from k3jax.model import K3Model
  model = nnx.eval_shape(lambda: K3Model(cfg, rngs=nnx.Rngs(0)))
  out = []
  for path, var in nnx.to_flat_state(nnx.state(model)):
    names = getattr(var, "sharding_names", None) or var.get_metadata().get("out_sharding")
    shape = tuple(var.get_value().shape)
    out.append((".".join(map(str, path)), shape, tuple(names or (None,) * len(shape))))
  return out


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_DIRECT = {
    "embed_tokens.embedding": ("model.embed_tokens", "copy"),
    "lm_head.kernel": ("lm_head", "linear"),
    "norm.weight": ("model.norm", "copy"),
    "output_attn_res.proj": ("model.output_attn_res_proj", "row"),
    "output_attn_res.norm": ("model.output_attn_res_norm", "copy"),
}
_LAYER_SPECIAL = {
    "self_attention_res.proj": ("self_attention_res_proj", "row"),
    "self_attention_res.norm": ("self_attention_res_norm", "copy"),
    "mlp_res.proj": ("mlp_res_proj", "row"),
    "mlp_res.norm": ("mlp_res_norm", "copy"),
    "self_attn.A_log": ("self_attn.A_log", "a_log"),
    "self_attn.dt_bias": ("self_attn.dt_bias", "copy"),
    "mlp.gate.bias": ("block_sparse_moe.gate.e_score_correction_bias", "copy"),
}


def _rule(cfg: ModelConfig, path: str, prefix: str) -> tuple[str, tuple[str, ...]]:
  """(kind, HF base names) for one of our parameter paths; raises for an unmapped path."""
  if path in _DIRECT:
    base, kind = _DIRECT[path]
    return kind, (prefix + base,)
  m = _LAYER.fullmatch(path)
  if not m:
    raise ConversionError(f"no HF name for parameter {path}")
  i, rest = int(m.group(1)), m.group(2)
  lp = f"{prefix}model.layers.{i}."
  if rest in _LAYER_SPECIAL:
    base, kind = _LAYER_SPECIAL[rest]
    return kind, (lp + base,)
  if rest.startswith("mlp.experts."):
    e = cfg.moe.num_experts
    if rest == "mlp.experts.w_gate_up":
      return "gate_up", tuple(f"{lp}block_sparse_moe.experts.{j}.{w}" for j in range(e)
                              for w in ("w1", "w3"))
    if rest == "mlp.experts.w_down":
      return "down", tuple(f"{lp}block_sparse_moe.experts.{j}.w2" for j in range(e))
  mod, leaf = rest.rsplit(".", 1)
  if cfg.is_moe(i) and mod.startswith("mlp."):
    mod = "block_sparse_moe." + mod[len("mlp."):]
  if leaf == "kernel":
    kind = "conv" if mod.endswith("_conv1d") else "linear"
  elif leaf == "weight":
    kind = "copy"
  else:
    raise ConversionError(f"no HF name for parameter {path}")
  return kind, (f"{lp}{mod}",)


def detect_prefix(names) -> str:
  """``"language_model."`` when the language model is nested (K3 release), else ``""``."""
  return "language_model." if any(n.startswith("language_model.") for n in names) else ""


def plan(cfg: ModelConfig, prefix: str = "") -> list[Param]:
  """Every parameter of K3Model(cfg) with the HF tensors it is built from."""
  return [Param(path, shape, names, *_rule(cfg, path, prefix))
          for path, shape, names in _model_params(cfg)]


def _hf_shape(p: Param) -> tuple[int, ...] | None:
  """Expected HF shape of each source of ``p`` (None: checked by the kind itself)."""
  s = p.shape
  return {"copy": s, "linear": s[::-1], "conv": s[::-1][:1] + (1,) + s[:1] if len(s) == 2 else None,
          "row": (1,) + s, "gate_up": (s[2] // 2, s[1]) if len(s) == 3 else None,
          "down": (s[2], s[1]) if len(s) == 3 else None}.get(p.kind)


def _mxfp4_shapes(shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
  return (shape[0], shape[1] // 2), (shape[0], shape[1] // MXFP4_GROUP)


def _a_log_ok(shape: tuple[int, ...], heads: int) -> bool:
  return shape in ((heads,), (1, 1, heads, 1)) or (len(shape) == 1 and shape[0] >= heads)


def validate(params: Sequence[Param], tensors: dict[str, tuple[str, tuple[int, ...]]],
             prefix: str) -> list[str]:
  """Checks ``tensors`` (name -> (dtype, shape)) against the plan; returns the HF names used.

  Raises one :class:`ConversionError` listing every missing, wrongly shaped and unexpected
  tensor. Tensors outside ``prefix`` (K3's vision tower) are not part of the language model and
  are left out silently.
  """
  missing, bad, used = [], [], []

  def need(name: str, shape, dtypes=None):
    if name not in tensors:
      missing.append(name)
      return
    used.append(name)
    dt, got = tensors[name]
    if (shape is not None and tuple(got) != tuple(shape)) or (dtypes and dt not in dtypes):
      bad.append(f"{name}: {dt}{list(got)}, expected "
                 f"{'/'.join(dtypes) if dtypes else ''}{list(shape) if shape else ''}")

  for p in params:
    expect = _hf_shape(p)
    for base in p.sources:
      if p.kind in ("gate_up", "down"):
        if base + ".weight_packed" in tensors or base + ".weight" not in tensors:
          packed, scale = _mxfp4_shapes(expect)
          need(base + ".weight_packed", packed, ("U8",))
          need(base + ".weight_scale", scale, ("U8",))
          continue
        need(base + ".weight", expect)
      elif p.kind == "a_log":
        name = base
        need(name, None)
        if name in tensors and not _a_log_ok(tuple(tensors[name][1]), p.shape[0]):
          bad.append(f"{name}: shape {list(tensors[name][1])}, expected [{p.shape[0]}], "
                     f"[1, 1, {p.shape[0]}, 1] or a zero-padded [>= {p.shape[0]}]")
      else:
        need(_hf_weight_name(p, base), expect)
  used_set = set(used)
  unexpected = sorted(n for n in tensors if n.startswith(prefix) and n not in used_set)
  if missing or bad or unexpected:
    parts = []
    for title, items in (("missing", missing), ("wrong shape or dtype", bad),
                         ("unexpected", unexpected)):
      if items:
        shown = items[:50] + ([f"... and {len(items) - 50} more"] if len(items) > 50 else [])
        parts.append(f"{len(items)} {title}:\n  " + "\n  ".join(shown))
    raise ConversionError("checkpoint does not match the config:\n" + "\n".join(parts))
  return used


def _hf_weight_name(p: Param, base: str) -> str:
  if p.kind == "a_log" or base.endswith((".dt_bias", ".e_score_correction_bias")):
    return base
  return base + ".weight"


# ---------------------------------------------------------------------------------------------
# HF -> our layout, block by block.


def _a_log(x: np.ndarray, heads: int, name: str) -> np.ndarray:
  flat = x.reshape(-1)
  if np.any(flat[heads:] != 0):
    raise ConversionError(f"{name}: padding after the first {heads} heads is not zero")
  return flat[:heads]


class _Source:
  """Builds any block of a parameter from the HF tensors (pread per block, no full copies)."""

  def __init__(self, reader: SafetensorsReader, p: Param):
    self.r, self.p = reader, p

  def _expert(self, base: str) -> np.ndarray:
    t = self.r.tensors
    if base + ".weight_packed" in t:
      return mxfp4_dequantize(self.r.read(base + ".weight_packed"), self.r.read(base + ".weight_scale"),
                              _BF16)
    return self.r.read(base + ".weight")

  def block(self, idx: tuple[slice, ...]) -> np.ndarray:
    p = self.p
    if p.kind == "gate_up":
      rows = []
      for e in range(idx[0].start, idx[0].stop):
        w1 = self._expert(p.sources[2 * e]).T[idx[1]]
        w3 = self._expert(p.sources[2 * e + 1]).T[idx[1]]
        rows.append(np.concatenate([w1, w3.astype(w1.dtype)], axis=1)[:, idx[2]])
      return np.stack(rows)
    if p.kind == "down":
      return np.stack([self._expert(p.sources[e]).T[idx[1:]]
                       for e in range(idx[0].start, idx[0].stop)])
    name = _hf_weight_name(p, p.sources[0])
    if p.kind == "copy":
      return self.r.read(name, (idx[0].start, idx[0].stop))[(slice(None),) + idx[1:]]
    if p.kind == "linear":  # our [in, out] block = HF rows out-range, cols in-range, transposed
      return self.r.read(name, (idx[1].start, idx[1].stop))[:, idx[0]].T
    x = self.r.read(name)
    if p.kind == "conv":
      return x[:, 0, :].T[idx]
    if p.kind == "row":
      return x.reshape(-1)[idx]
    if p.kind == "a_log":
      return _a_log(x, p.shape[0], name)[idx]
    raise ConversionError(f"unknown kind {p.kind}")


def _split_axis(p: Param) -> int:
  """The axis blocks are cut along: one HF row range (linear: HF rows are our last axis)."""
  return {"linear": len(p.shape) - 1, "gate_up": 0, "down": 0}.get(p.kind, 0)


def block_shape(p: Param, itemsize: int, shard: tuple[int, ...] | None = None,
                max_bytes: int = 256 << 20) -> tuple[int, ...]:
  """The write block (and zarr write shape) of ``p``: the mesh shard (or the whole array), cut
  along the streaming axis until it holds at most ``max_bytes`` (one expert for expert stacks)."""
  shape = list(shard or p.shape)
  if not shape:
    return ()
  ax = _split_axis(p)
  if p.kind in ("gate_up", "down"):
    shape[0] = 1
  row = math.prod(shape) // max(shape[ax], 1) * itemsize
  if row * shape[ax] > max_bytes:
    n = max(1, max_bytes // max(row, 1))
    while shape[ax] % n:  # keep blocks equal so they tile the shard
      n -= 1
    shape[ax] = n
  return tuple(shape)


def _blocks(shape: tuple[int, ...], block: tuple[int, ...]) -> Iterator[tuple[slice, ...]]:
  if not shape:
    yield ()
    return
  grid = [range(0, s, b) for s, b in zip(shape, block)]
  for starts in np.ndindex(*[len(g) for g in grid]):
    yield tuple(slice(g[k], min(g[k] + b, s))
                for g, k, b, s in zip(grid, starts, block, shape))


def mesh_shard_shape(p: Param, mesh: dict[str, int] | None) -> tuple[int, ...] | None:
  """Per-device shard of ``p`` under ``mesh`` (axis -> size) with the default sharding rules.

  A dimension whose size the mesh axes do not divide stays whole."""
  if not mesh:
    return None
  from sharding.rules import logical_spec
  spec = logical_spec(p.names, mesh_axes=[a for a, n in mesh.items() if n > 1])
  out = []
  for dim, axes in zip(p.shape, tuple(spec) + (None,) * len(p.shape)):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    n = math.prod(mesh[a] for a in axes)
    out.append(dim // n if dim % n == 0 else dim)
  return tuple(out)


# ---------------------------------------------------------------------------------------------
# Orbax output through a streaming type handler.


_IN_FLIGHT_BYTES = 192 << 20  # written blocks not yet committed, per array


@dataclasses.dataclass
class LazyArray:
  """An Orbax leaf whose data is produced block by block while it is saved."""

  shape: tuple[int, ...]
  dtype: np.dtype
  write_shape: tuple[int, ...]
  blocks: Callable[[], Iterator[tuple[tuple[slice, ...], np.ndarray]]]


def _register_lazy_handler():
  import orbax.checkpoint as ocp
  import tensorstore as ts
  from orbax.checkpoint import future
  from orbax.checkpoint._src.serialization import ocdbt_utils
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  from orbax.checkpoint._src.serialization import type_handlers

  class LazyArrayHandler(type_handlers.NumpyHandler):
    """Writes a :class:`LazyArray` like a NumPy array, one block (one tensorstore write) at a
    time; restores as ``np.ndarray`` (or ``jax.Array`` with a sharding)."""

    def __init__(self):
      super().__init__(deepcopy_host_arrays=False)

    async def _background_serialize(self, values, infos, args=None):
      for value, info, arg in zip(values, infos, args):
        await info.await_path_creation()
        spec = ts_utils.build_array_write_spec(
            info=info, arg=arg, global_shape=value.shape, local_shape=value.write_shape,
            dtype=value.dtype, use_ocdbt=info.is_ocdbt_checkpoint,
            process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint))
        t = await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)
        pending, in_flight = [], 0
        for idx, block in value.blocks():  # overlap producing the next block with writing
          pending.append((t[idx].write(block), block.nbytes))
          in_flight += block.nbytes
          while pending and (in_flight > _IN_FLIGHT_BYTES or len(pending) > 8):
            fut, n = pending.pop(0)
            await fut
            in_flight -= n
          await asyncio.sleep(0)
        for fut, _ in pending:
          await fut

    async def serialize(self, values, infos, args=None):
      args = args or [ocp.SaveArgs()] * len(values)
      return [future.CommitFutureAwaitingContractedSignals(
          self._background_serialize(values, infos, args), name="lazy_array")]

  ocp.type_handlers.register_type_handler(LazyArray, LazyArrayHandler(), override=True)


def _nest(flat: dict[str, object]) -> dict:
  tree: dict = {}
  for path, v in flat.items():
    node = tree
    *head, leaf = path.split(".")
    for k in head:
      node = node.setdefault(k, {})
    node[leaf] = v
  return tree


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
  out = {}
  for k, v in tree.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}


def _target_dtype(p: Param, reader: SafetensorsReader, dtype: str | None) -> np.dtype:
  """Storage dtype of ``p``: ``dtype`` if given, else the source's (bfloat16 for MXFP4)."""
  if p.kind == "a_log" or p.path.endswith((".dt_bias", ".gate.bias")):
    return np.dtype(np.float32)  # kept float32 by the model
  if dtype:
    return _DTYPES[dtype]
  first = p.sources[0]
  if p.kind in ("gate_up", "down") and first + ".weight_packed" in reader.tensors:
    return _DTYPES["bf16"]
  return _ST_DTYPES[reader.tensors[_hf_weight_name(p, first)].dtype]


class _Progress:
  """tqdm over bytes written, showing the rate."""

  def __init__(self, total: int, desc: str, enabled: bool = True):
    self.bar = None
    if enabled:
      from tqdm import tqdm
      self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                      dynamic_ncols=True, mininterval=1.0)

  def update(self, n: int):
    if self.bar:
      self.bar.update(n)

  def close(self):
    if self.bar:
      self.bar.close()


def _atomic_dir(dst: Path) -> Path:
  if dst.exists():
    raise ConversionError(f"destination {dst} already exists")
  dst.parent.mkdir(parents=True, exist_ok=True)
  tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir()
  return tmp


_EXTRA_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".py", ".tiktoken", ".md")


def _copy_extras(src: Path, dst: Path, skip: set[str]):
  for f in sorted(src.iterdir()):
    if (f.is_file() and f.suffix in _EXTRA_SUFFIXES and f.name not in skip
        and f.stat().st_size < 64 << 20):
      dst.mkdir(exist_ok=True)
      shutil.copy2(f, dst / f.name)


def read_hf_config(src: Path) -> dict:
  path = Path(src) / "config.json"
  if not path.is_file():
    raise ConversionError(f"{src}: config.json not found")
  return json.loads(path.read_text())


def load_hf_params(src: str | Path, cfg: ModelConfig | None = None,
                   dtype: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads an HF directory fully into memory: (config, {our path: array}). For small models
  (tests, from_pretrained); large ones go through :func:`hf_to_orbax`."""
  src = Path(src)
  hf = read_hf_config(src)
  cfg = cfg or config_from_hf(hf, name=src.name)
  reader = SafetensorsReader(src)
  try:
    prefix = detect_prefix(reader.tensors)
    params = plan(cfg, prefix)
    validate(params, {n: (t.dtype, t.shape) for n, t in reader.tensors.items()}, prefix)
    out = {}
    for p in params:
      full = tuple(slice(0, s) for s in p.shape)
      out[p.path] = _Source(reader, p).block(full).astype(_target_dtype(p, reader, dtype))
  finally:
    reader.close()
  return cfg, out


def hf_to_orbax(src: str | Path, dst: str | Path, *, dtype: str | None = None,
                mesh: dict[str, int] | None = None, progress: bool = True,
                max_block_bytes: int = 256 << 20) -> dict:
  """Converts the HF checkpoint in ``src`` into a new Orbax directory ``dst``.

  dtype: "bf16" or "fp32" for every floating tensor (default: keep each source dtype; MXFP4
  experts become bfloat16, exactly). mesh: axis sizes (e.g. ``{"fsdp": 8, "expert": 4}``): the
  arrays are chunked along the per-device shards of the default sharding rules. Returns stats
  (bytes, seconds, MB/s, peak RSS).
  """
  import orbax.checkpoint as ocp
  src, dst = Path(src), Path(dst)
  if dtype not in (None, "bf16", "fp32"):
    raise ConversionError(f"--dtype must be bf16 or fp32, got {dtype!r}")
  hf = read_hf_config(src)
  cfg = config_from_hf(hf, name=src.name)
  reader = SafetensorsReader(src)
  prefix = detect_prefix(reader.tensors)
  params = plan(cfg, prefix)
  tensors = {n: (t.dtype, t.shape) for n, t in reader.tensors.items()}
  used = validate(params, tensors, prefix)
  skipped = len(reader.tensors) - len(used)
  if dtype is None and cfg.param_dtype not in ("float32", "bfloat16"):
    dtype = "bf16"
  if dtype:
    cfg = dataclasses.replace(cfg, param_dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
                              compute_dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype])
  total_in = sum(reader.tensors[n].nbytes for n in used)
  bar = _Progress(total_in, f"hf-to-orbax {src.name}", progress)
  t0 = time.perf_counter()
  written = [0]

  owner = {base: p.path for p in params for base in p.sources}
  in_bytes: dict[str, int] = {}
  for n in used:
    base = re.sub(r"\.(weight_packed|weight_scale|weight)$", "", n)
    path = owner.get(base, owner.get(n))
    in_bytes[path] = in_bytes.get(path, 0) + reader.tensors[n].nbytes

  def leaf(p: Param) -> LazyArray:
    dt = _target_dtype(p, reader, dtype)
    block = block_shape(p, dt.itemsize, mesh_shard_shape(p, mesh), max_block_bytes)
    source = _Source(reader, p)
    n_blocks = math.prod(-(-s // b) for s, b in zip(p.shape, block)) if p.shape else 1

    def blocks():
      for idx in _blocks(p.shape, block):
        data = source.block(idx).astype(dt, copy=False)
        yield idx, data
        bar.update(in_bytes[p.path] // n_blocks)
        written[0] += data.nbytes
    return LazyArray(p.shape, dt, block, blocks)

  tmp = _atomic_dir(dst)
  try:
    _register_lazy_handler()
    tree = _nest({p.path: leaf(p) for p in params})
    ocp.PyTreeCheckpointer().save(tmp / "params", tree)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    (tmp / "k3jax.yaml").write_text(yaml.safe_dump({"model": config_lib.to_dict(cfg)}, sort_keys=False))
    manifest = {"format": 1, "prefix": prefix,
                "tensors": {n: {"dtype": reader.tensors[n].dtype, "shape": list(reader.tensors[n].shape)}
                            for n in used},
                "order": sorted(used, key=lambda n: (str(reader.tensors[n].file), reader.tensors[n].offset))}
    (tmp / "hf_manifest.json").write_text(json.dumps(manifest))
    _copy_extras(src, tmp / "hf_extra", {"config.json", "model.safetensors.index.json"})
    os.replace(tmp, dst)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    reader.close()
    bar.close()
  secs = time.perf_counter() - t0
  return _stats(total_in, written[0], secs, skipped)


def _stats(read_bytes: int, written: int, secs: float, skipped: int = 0) -> dict:
  import resource
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return {"read_bytes": read_bytes, "written_bytes": written, "seconds": secs,
          "read_MBps": read_bytes / 1e6 / max(secs, 1e-9), "peak_rss_bytes": peak,
          "skipped_tensors": skipped}


# ---------------------------------------------------------------------------------------------
# Orbax -> HF.


class OrbaxReader:
  """Reads slices of the arrays of an Orbax PyTree checkpoint through tensorstore."""

  def __init__(self, directory: str | Path):
    import orbax.checkpoint as ocp
    self.dir = Path(directory)
    meta = ocp.PyTreeCheckpointer().metadata(self.dir)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    self.meta = _flatten(dict(tree))
    self._open: dict[str, object] = {}

  def shape(self, path: str) -> tuple[int, ...]:
    return tuple(self.meta[path].shape)

  def dtype(self, path: str) -> np.dtype:
    return np.dtype(self.meta[path].dtype)

  def _array(self, path: str):
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    t = self._open.get(path)
    if t is None:
      kv = ts_utils.build_kvstore_tspec(self.dir.as_posix(), name=path,
                                        use_ocdbt=(self.dir / "manifest.ocdbt").exists())
      ctx = ts_utils.get_ts_context(use_ocdbt=True)
      try:
        t = ts.open({"driver": "zarr", "kvstore": kv}, open=True, read=True, context=ctx).result()
      except ValueError:
        t = ts.open({"driver": "zarr3", "kvstore": kv}, open=True, read=True, context=ctx).result()
      self._open[path] = t
    return t

  def read(self, path: str, idx: tuple = ()) -> np.ndarray:
    return np.asarray(self._array(path)[idx].read().result())


def _from_ours(p: Param, base: str, hf_shape: tuple[int, ...], reader: OrbaxReader,
               expert: int | None = None, half: int | None = None) -> np.ndarray:
  """The HF tensor ``base`` (float, before the HF dtype cast) from our parameter ``p``."""
  if p.kind == "gate_up":
    x = reader.read(p.path, (expert,))  # [L, 2F]
    f = x.shape[1] // 2
    return x[:, half * f:(half + 1) * f].T
  if p.kind == "down":
    return reader.read(p.path, (expert,)).T
  x = reader.read(p.path)
  if p.kind == "copy":
    return x.reshape(hf_shape)
  if p.kind == "linear":
    return x.T
  if p.kind == "conv":
    return x.T[:, None, :]
  if p.kind == "row":
    return x.reshape(1, -1)
  if p.kind == "a_log":
    out = np.zeros(math.prod(hf_shape), x.dtype)
    out[: x.shape[0]] = x
    return out.reshape(hf_shape)
  raise ConversionError(f"unknown kind {p.kind}")


ROW_BLOCK_BYTES = 256 << 20  # orbax-to-hf: rows of a large tensor read and written at a time


def _hf_row_blocks(p: Param, reader: OrbaxReader, hf_shape: tuple[int, ...],
                   dtype: np.dtype) -> Iterator[np.ndarray]:
  """The HF tensor of a "copy" / "linear" parameter in row blocks of at most ROW_BLOCK_BYTES."""
  max_bytes = ROW_BLOCK_BYTES
  rows = hf_shape[0]
  row_bytes = max(1, math.prod(hf_shape[1:]) * max(dtype.itemsize, reader.dtype(p.path).itemsize))
  step = max(1, max_bytes // row_bytes)
  for r in range(0, rows, step):
    sl = slice(r, min(r + step, rows))
    if p.kind == "linear":  # HF rows are our last axis
      yield reader.read(p.path, (Ellipsis, sl)).T.astype(dtype)
    else:
      yield reader.read(p.path, (sl,)).reshape((sl.stop - sl.start,) + hf_shape[1:]).astype(dtype)


def load_orbax_config(src: Path, config: str | Path | None) -> ModelConfig:
  if config is not None:
    return config_lib.load(config).model
  if (src / "k3jax.yaml").is_file():
    return config_lib.load(src / "k3jax.yaml").model
  if (src / "config.json").is_file():
    return config_from_hf(json.loads((src / "config.json").read_text()))
  raise ConversionError(f"{src}: neither k3jax.yaml nor config.json found (pass --config)")


def orbax_to_hf(src: str | Path, dst: str | Path, *, config: str | Path | None = None,
                experts: str = "auto", progress: bool = True, max_shard_bytes: int = 5 << 30) -> dict:
  """Writes the Orbax directory ``src`` (from :func:`hf_to_orbax`, or any ``params/`` tree of
  K3Model with a ``k3jax.yaml``) as an HF checkpoint in the new directory ``dst``.

  With the ``hf_manifest.json`` of a conversion, names, dtypes, shapes (padded ``A_log``) and the
  MXFP4 packing of the source come back exactly; otherwise the released layout is used, in the
  parameter dtype. experts: "auto" (as in the manifest), "mxfp4" or "bf16".
  """
  src, dst = Path(src), Path(dst)
  cfg = load_orbax_config(src, config)
  mpath = src / "hf_manifest.json"
  manifest = json.loads(mpath.read_text()) if mpath.is_file() else None
  if manifest:
    prefix = manifest["prefix"]
  else:
    prefix = "language_model." if cfg.arch == "kimi_k3" else ""
  params = plan(cfg, prefix)
  ckpt = src / "params" if (src / "params").is_dir() else src
  reader = OrbaxReader(ckpt)
  problems = []
  for p in params:
    if p.path not in reader.meta:
      problems.append(f"missing {p.path}")
    elif reader.shape(p.path) != p.shape:
      problems.append(f"{p.path}: shape {list(reader.shape(p.path))}, expected {list(p.shape)}")
  extra = sorted(set(reader.meta) - {p.path for p in params})
  problems += [f"unexpected {x}" for x in extra]
  if problems:
    raise ConversionError(f"{ckpt} does not match the config:\n  " + "\n  ".join(problems))

  # The HF tensor list: (name, dtype, shape, producer).
  default_dt = {"float32": "F32", "bfloat16": "BF16", "float64": "F32"}[cfg.param_dtype]
  items = []
  for p in params:
    hf_shape = _hf_shape(p)
    if p.kind in ("gate_up", "down"):
      for k, base in enumerate(p.sources):
        e, half = (k // 2, k % 2) if p.kind == "gate_up" else (k, None)
        packed = (base + ".weight_packed" in manifest["tensors"]) if manifest and experts == "auto" \
            else experts == "mxfp4" or (experts == "auto" and cfg.arch == "kimi_k3")
        if packed:
          ps, ss = _mxfp4_shapes(hf_shape)
          items.append((base + ".weight_packed", "U8", ps, (p, base, hf_shape, e, half, "packed")))
          items.append((base + ".weight_scale", "U8", ss, (p, base, hf_shape, e, half, "scale")))
        else:
          name = base + ".weight"
          dt = manifest["tensors"][name]["dtype"] if manifest and name in manifest["tensors"] else default_dt
          items.append((name, dt, hf_shape, (p, base, hf_shape, e, half, None)))
      continue
    name = _hf_weight_name(p, p.sources[0])
    if manifest and name in manifest["tensors"]:
      dt, shape = manifest["tensors"][name]["dtype"], tuple(manifest["tensors"][name]["shape"])
    else:
      shape = (p.shape[0],) if p.kind == "a_log" else hf_shape
      dt = "F32" if (p.kind == "a_log" or name.endswith((".dt_bias", ".e_score_correction_bias"))) \
          else default_dt
    items.append((name, dt, shape, (p, name, shape, None, None, None)))
  if manifest:
    rank = {n: i for i, n in enumerate(manifest["order"])}
    items.sort(key=lambda it: rank.get(it[0], len(rank)))

  tmp = _atomic_dir(dst)
  writer = SafetensorsWriter(tmp, [(n, dt, s) for n, dt, s, _ in items], max_shard_bytes)
  bar = _Progress(writer.total_bytes, f"orbax-to-hf {src.name}", progress)
  t0 = time.perf_counter()
  try:
    pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, dt, shape, (p, base, hf_shape, e, half, part) in items:
      if part is None and p.kind in ("copy", "linear") and len(shape) >= 1 and shape == hf_shape:
        writer.write_rows(name, _hf_row_blocks(p, reader, shape, _ST_DTYPES[dt]), shape[0])
        bar.update(math.prod(shape) * _ST_DTYPES[dt].itemsize)
        continue
      if part is None:
        arr = np.asarray(_from_ours(p, base, hf_shape, reader, e, half)).astype(_ST_DTYPES[dt])
      else:
        if base not in pending:
          pending[base] = mxfp4_quantize(_from_ours(p, base, hf_shape, reader, e, half))
        arr = pending[base][0] if part == "packed" else pending.pop(base)[1]
      writer.write(name, arr)
      bar.update(arr.nbytes)
    writer.close()
    hf = (json.loads((src / "config.json").read_text()) if (src / "config.json").is_file()
          else config_to_hf(cfg))
    _set_quantization(hf, any(name.endswith(".weight_packed") for name, *_ in items))
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    if (src / "hf_extra").is_dir():
      for f in (src / "hf_extra").iterdir():
        shutil.copy2(f, tmp / f.name)
    os.replace(tmp, dst)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    bar.close()
  return _stats(writer.total_bytes, writer.total_bytes, time.perf_counter() - t0)


MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False}}},
}


def _set_quantization(hf: dict, packed: bool):
  """Keeps ``quantization_config`` consistent with how the routed experts were written."""
  holders = [d for d in (hf, hf.get("text_config")) if isinstance(d, dict)]
  has = any("quantization_config" in d for d in holders)
  if packed and not has:
    hf["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
  elif not packed:
    for d in holders:
      d.pop("quantization_config", None)


def load_orbax_params(src: str | Path, *, config: str | Path | None = None,
                      shardings: dict | None = None) -> tuple[ModelConfig, dict[str, object]]:
  """Restores an Orbax directory: (config, {our path: np.ndarray}); with ``shardings`` (our path
  -> ``jax.sharding.Sharding`` for every parameter) each device reads only its shard and the
  values are ``jax.Array``."""
  import orbax.checkpoint as ocp
  src = Path(src)
  cfg = load_orbax_config(src, config)
  ckpt = src / "params" if (src / "params").is_dir() else src
  if shardings:
    args = _nest({k: ocp.ArrayRestoreArgs(sharding=s) for k, s in shardings.items()})
    tree = ocp.PyTreeCheckpointer().restore(ckpt, restore_args=args)
  else:
    tree = ocp.PyTreeCheckpointer().restore(ckpt)
  return cfg, _flatten(tree)
