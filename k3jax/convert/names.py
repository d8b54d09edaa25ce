"""The name plan: which HF tensors make each parameter of :class:`~k3jax.model.K3Model`, and how.

:func:`plan` lists every parameter with its sources; :func:`validate` checks a checkpoint
against it and lists every missing, unexpected or wrongly shaped tensor in one error.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from k3jax.config import ModelConfig
from k3jax.convert.errors import ConversionError
from k3jax.convert.mxfp4 import mxfp4_shapes


# kinds: "copy" (same layout), "linear" (torch [out, in] -> [in, out]), "conv" ([C, 1, W] ->
# [W, C]), "row" ([1, d] -> [d]), "patch" (the vision tower's patch conv [D, C, p, p] ->
# [C * p * p, D]), "a_log" (any of [H], [1, 1, H, 1], or [P >= H] zero padded ->
# [H]), "gate_up" (per expert w1, w3 [F, L] -> [E, L, 2F]), "down" (per expert w2 [L, F] ->
# [E, F, L]).


@dataclasses.dataclass(frozen=True)
class Param:
  """One parameter of the model and the HF tensors it is built from."""

  path: str  # "layers.3.self_attn.q_proj.kernel"
  shape: tuple[int, ...]
  names: tuple[str | None, ...]  # logical sharding names
  kind: str
  sources: tuple[str, ...]  # HF base names (experts: "...experts.{e}.w1" etc., no ".weight")
  hf_shape: tuple[int, ...] | None = None  # the HF tensor's shape where the kind cannot tell it


def _model_params(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple]]:
  """(path, shape, sharding names) of every variable of K3Model(cfg), without allocating."""
  from flax import nnx
  from k3jax.train_state import abstract_model
  model = abstract_model(cfg)
  out = []
  for path, var in nnx.to_flat_state(nnx.state(model)):
    names = getattr(var, "sharding_names", None) or var.get_metadata().get("out_sharding")
    shape = tuple(var.get_value().shape)
    out.append((".".join(map(str, path)), shape, tuple(names or (None,) * len(shape))))
  return out


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# our path -> (HF base name, kind), outside the layers and (_LAYER_SPECIAL) inside one
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


# the vision tower and projector keep the released names (outside any language-model prefix);
# our projector's two linears are the released nn.Sequential's entries 0 and 2
_VISION = re.compile(r"(vision_tower|mm_projector)\.(.+)\.(kernel|weight|bias)")
_VISION_RENAME = {"mm_projector.proj_in": "mm_projector.proj.0",
                  "mm_projector.proj_out": "mm_projector.proj.2"}


def _vision_rule(cfg: ModelConfig, path: str) -> tuple:
  """(kind, HF base names, HF shape) of a vision tower or projector parameter."""
  m = _VISION.fullmatch(path)
  if not m:
    raise ConversionError(f"no HF name for parameter {path}")
  mod = f"{m.group(1)}.{m.group(2)}"
  mod = _VISION_RENAME.get(mod, mod)
  if m.group(3) == "bias":
    return "copy", (mod + ".bias",), None
  if m.group(3) == "weight":
    return "copy", (mod,), None
  if mod == "vision_tower.patch_embed.proj":
    v = cfg.vision
    return "patch", (mod,), (v.hidden_size, v.channels, v.patch_size, v.patch_size)
  return "linear", (mod,), None


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
  return [Param(path, shape, names, *_vision_rule(cfg, path))
          if path.startswith(("vision_tower.", "mm_projector.")) else
          Param(path, shape, names, *_rule(cfg, path, prefix))
          for path, shape, names in _model_params(cfg)]


def hf_source_shape(p: Param) -> tuple[int, ...] | None:
  """Expected HF shape of each source of ``p`` (None: checked by the kind itself)."""
  s = p.shape
  return {"copy": s, "linear": s[::-1], "patch": p.hf_shape, "conv": s[::-1][:1] + (1,) + s[:1] if len(s) == 2 else None,
          "row": (1,) + s, "gate_up": (s[2] // 2, s[1]) if len(s) == 3 else None,
          "down": (s[2], s[1]) if len(s) == 3 else None}.get(p.kind)


def _a_log_ok(shape: tuple[int, ...], heads: int) -> bool:
  return shape in ((heads,), (1, 1, heads, 1)) or (len(shape) == 1 and shape[0] >= heads)


def validate(params: Sequence[Param], tensors: dict[str, tuple[str, tuple[int, ...]]],
             prefix: str, floats: Sequence[str]) -> list[str]:
  """Checks ``tensors`` (name -> (dtype, shape)) against the plan; returns the HF names used.

  floats: the safetensors dtypes a floating parameter may have (the checkpoint's own and F32);
  MXFP4 blocks and scales must be U8. Raises one :class:`ConversionError` listing every missing,
  wrongly shaped or typed and unexpected tensor. Tensors outside ``prefix`` that the plan does not
  use (K3's vision tower for a text-only config) are left out silently.
  """
  missing, bad, used = [], [], []

  def need(name: str, shape, dtypes=tuple(floats)):
    if name not in tensors:
      missing.append(name)
      return
    used.append(name)
    dt, got = tensors[name]
    if (shape is not None and tuple(got) != tuple(shape)) or dt not in dtypes:
      bad.append(f"{name}: {dt}{list(got)}, expected {'/'.join(dtypes)}{list(shape) if shape else ''}")

  for p in params:
    expect = hf_source_shape(p)
    for base in p.sources:
      if p.kind in ("gate_up", "down"):
        if base + ".weight_packed" in tensors or base + ".weight" not in tensors:
          packed, scale = mxfp4_shapes(expect)
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
        need(hf_weight_name(p, base), expect)
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


def hf_weight_name(p: Param, base: str) -> str:
  """The HF tensor name of source ``base`` of ``p`` (most carry a ``.weight`` suffix)."""
  if p.kind == "a_log" or base.endswith((".dt_bias", ".e_score_correction_bias", ".bias")):
    return base
  return base + ".weight"
