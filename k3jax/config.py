"""Configuration: frozen dataclasses loaded from YAML with ``key=value`` overrides.

``load(path, overrides=["model.num_layers=8", "train.steps=10"])`` returns a validated
:class:`Config`. Every error names the offending key: an unknown key, a value of the wrong type,
or values that do not fit together (top-k above the expert count, a layer index out of range, a
head dim the kernels cannot take).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
  """A configuration value is unknown, of the wrong type, or inconsistent."""


KERNEL_HEAD_DIMS = (64, 128)  # head dims the KDA kernels take
# model.{kda,mla,moe}.implementation: None or one of the kernels' IMPLEMENTATIONS
# (pallas_kernels.{kda,mla,moe}).
IMPLEMENTATIONS = {
    "kda": ("naive", "chunked", "pallas_gpu", "pallas_tpu", "pallas"),
    "mla": ("xla", "pallas_gpu", "pallas_tpu", "pallas", "cudnn", "cudnn_fwd"),
    "moe": ("xla", "pallas_gpu", "pallas_tpu", "pallas"),
}


@dataclasses.dataclass(frozen=True)
class KDAConfig:
  num_heads: int = 4
  num_v_heads: int = 0  # grouped values: a multiple of num_heads; 0 means num_heads
  head_dim: int = 64  # K
  v_head_dim: int = 64  # V
  conv_size: int = 4
  gate: str = "bounded"  # "bounded" (K3, g in (lower_bound, 0)) or "softplus" (Kimi Linear)
  gate_lower_bound: float = -5.0
  output_gate: str = "full"  # "full" (g_proj) or "low_rank" (g_a_proj, g_b_proj)
  output_gate_rank: int = 128
  forget_rank: int = 0  # f_a_proj width; 0 means v_head_dim
  chunk_size: int = 64
  implementation: str | None = None  # None: pallas on GPU/TPU, chunked on CPU
  # The short convs (pallas_kernels.conv): None = the fused Pallas kernels on GPU, XLA elsewhere.
  conv_implementation: str | None = None
  # Pallas GPU under differentiation: the forward keeps its intermediates for the backward
  # (~2.6 KB per token and value head, a faster backward); False recomputes them.
  save_residuals: bool = True

  @property
  def value_heads(self) -> int:
    return self.num_v_heads or self.num_heads

  @property
  def f_rank(self) -> int:
    return self.forget_rank or self.v_head_dim


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  num_heads: int = 4
  q_lora_rank: int = 0  # 0: plain q_proj (Kimi Linear)
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64  # the shared, never rotated key part
  v_head_dim: int = 128
  output_gate: bool = True
  norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm eps of the reference code
  implementation: str | None = None

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  num_shared_experts: int = 1
  expert_intermediate: int = 64
  latent_dim: int = 0  # 0: experts work at full width (Kimi Linear)
  routed_scaling_factor: float = 1.0
  renormalize: bool = True
  balancing: str = "quantile"  # "quantile" (exact), "quantile_hist", "sign", "none"
  balancing_bins: int = 1000
  # Exact QB: updates computed on the same batch, each from the bias the last produced. One is
  # the SPEC's rule; more fit the batch closer at a radix select per update (benchmarks/
  # RESULTS.md, Training run 37).
  balancing_iters: int = 1
  sign_update_rate: float = 1e-3
  capacity_factor: float = 0.0  # 0: dropless
  implementation: str | None = None  # grouped matmul: None picks per backend


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
  enabled: bool = True
  block_size: int = 12
  # The mixing op (pallas_kernels.attn_res): None = the fused Pallas kernels on GPU, XLA elsewhere.
  implementation: str | None = None


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """MoonViT-V2, the vision tower and projector (k3jax.vision, docs/vision.md). The defaults are
  K3's settings with a tower small enough for CPU tests; the released K3 and K2.5 values are
  noted beside the fields (their ``vision_config`` and ``media_proc_cfg``)."""
  patch_size: int = 14  # pixels per patch side (14)
  channels: int = 3
  hidden_size: int = 64  # tower width (K2.5 1152, K3 1024)
  num_layers: int = 2  # (27)
  num_heads: int = 2  # (K2.5 16, K3 12)
  qkv_size: int = 0  # attention width, 0: hidden_size (K2.5 1152, head dim 72; K3 1536, 128)
  intermediate_size: int = 128  # tower MLP width (K2.5 4304, K3 4096)
  merge_kernel: tuple[int, ...] = (2, 2)  # pixel shuffle: patches per visual token (rows, cols)
  pos_emb_height: int = 64  # learned positional grid, interpolated to each image's grid (64)
  pos_emb_width: int = 64
  pos_emb_frames: int = 4  # most frames of one video chunk (init_pos_emb_time, 4)
  pos_emb_interpolation: str = "bilinear"  # "bicubic" (K2.5) or "bilinear" (K3)
  rope_max_grid: int = 512  # largest patch grid side the reference's 2D rotary table covers
  rope_theta: float = 10000.0
  norm: str = "rmsnorm"  # "layernorm" (K2.5) or "rmsnorm" (K3)
  norm_eps: float = 1.1920929e-07  # K2.5 LayerNorm 1e-5; K3's RMSNorm: float32 epsilon
  patch_bias: bool = False  # patch_embed.proj bias (K2.5 true, K3 false)
  attn_bias: bool = False  # wqkv / wo biases (K2.5 true, K3 false)
  mlp_bias: bool = False  # fc0 / fc1 biases (K2.5 true, K3 false)
  # Video: "joint" attends over all patches of a chunk's frames at once (the public K2.5 and K3
  # code; converted checkpoints);
  # "divided" runs a spatial pass within each frame, then a temporal pass across frames at each
  # patch position, both with the layer's attention weights (SPEC section 6, unconfirmed).
  video_attention: str = "divided"
  temporal_pool: bool = True  # average a chunk's frames into one set of visual tokens (sd2_tpool)
  # "patchmerger" (K2.5: LayerNorm, Linear, GELU, Linear, with biases) or "patchmerger_v2"
  # (K3: Linear, GELU, Linear without biases, then RMSNorm into the text width)
  projector: str = "patchmerger_v2"
  projector_eps: float = 1e-5
  # the placeholder token each visual token replaces, in order (K2.5 and K3: 163605,
  # <|media_pad|>)
  image_token_id: int = 259
  # RGBA input: "chessboard" (K3's processor: resized, then composited onto a white and grey
  # chessboard) or "drop" (K2.5's: the alpha channel dropped before resizing)
  alpha: str = "chessboard"
  image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
  image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
  # Resizing, as the reference processor: an image is scaled down (never up) until it has at
  # most in_patch_limit patches (frame_patch_limit per video frame) and at most side_limit patches
  # a side, then zero-padded right and bottom to a multiple of patch_size * merge_kernel.
  in_patch_limit: int = 65536  # K2.5 16384, K3 65536
  frame_patch_limit: int = 4096  # K2.5's in_patch_limit_each_frame
  side_limit: int = 512
  # Hard limits: an item with more patches after resizing, or an input with more pixels, is
  # refused (static shapes in training; decoding bombs in serving). The resize rule can exceed
  # in_patch_limit by its rounding and padding (to about 67100 at the defaults): the default
  # leaves that room.
  max_patches: int = 65536 + 4096
  max_pixels: int = 7168 * 7168  # K3's processor: (side_limit * patch_size) ** 2

  @property
  def attn_size(self) -> int:
    """Width of q, k and v (all heads)."""
    return self.qkv_size or self.hidden_size

  @property
  def head_dim(self) -> int:
    return self.attn_size // self.num_heads

  @property
  def merge(self) -> int:
    """Patches merged into one visual token."""
    return self.merge_kernel[0] * self.merge_kernel[1]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  name: str = "k3_tiny"
  arch: str = "kimi_k3"  # "kimi_k3" or "kimi_linear"
  vocab_size: int = 512
  hidden_size: int = 128
  num_layers: int = 4
  rms_norm_eps: float = 1e-5
  mla_layers: tuple[int, ...] = (3,)  # 0-based; every other layer is KDA
  dense_layers: tuple[int, ...] = (0,)  # 0-based; every other layer is MoE
  dense_intermediate: int = 256
  activation: str = "situ"  # "situ" (SiTU-GLU) or "silu" (SiLU-GLU)
  situ_beta: float = 4.0
  situ_linear_beta: float = 25.0
  # The dense GLU's and the shared experts' activation (pallas_kernels.glu): None = the Triton
  # pair kernels on GPU, XLA elsewhere; "xla" keeps the XLA form.
  glu_implementation: str | None = None
  max_position: int = 1_048_576
  bos_token_id: int = 1
  eos_token_id: int = 2
  pad_token_id: int = 0
  init_std: float = 0.02
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # Rematerialisation per decoder layer: "none", "full", "dots" (keep matmul outputs), or
  # "dots_kernels" (also keep the outputs of the Pallas kernels: KDA, MLA, grouped matmuls).
  remat: str = "none"
  # The last remat_skip decoder layers keep every activation (no remat): spends memory left over
  # under a remat policy on less recompute.
  remat_skip: int = 0
  # Each decoder layer's backward hands out its weight gradients together with its input
  # gradient, so the layer below starts only when they are done: otherwise XLA defers them (their
  # results only feed the optimizer) and keeps every layer's operands and unreduced gradients
  # live to the end of the backward (benchmarks/RESULTS.md, MLA: K3 at 1M). Off lets a layer's
  # gradient reductions overlap the next layer's backward.
  layer_grad_barrier: bool = True
  # Run the decoder's repeated layer groups (:meth:`layer_groups`) as one ``lax.scan`` over their
  # parameters stacked on a leading ``layers`` axis (k3jax/scan.py): one group is compiled
  # instead of every layer. Parameters keep the per-layer layout everywhere else.
  scan_layers: bool = False
  kda: KDAConfig = KDAConfig()
  mla: MLAConfig = MLAConfig()
  moe: MoEConfig = MoEConfig()
  attn_res: AttnResConfig = AttnResConfig()
  vision: VisionConfig | None = None  # None: text only

  @property
  def pdtype(self):
    """Parameter storage dtype."""
    return dtype(self.param_dtype)

  @property
  def cdtype(self):
    """Compute dtype of activations and matmuls."""
    return dtype(self.compute_dtype)

  def layer_kind(self, i: int) -> str:
    return "mla" if i in self.mla_layers else "kda"

  def is_moe(self, i: int) -> bool:
    return i not in self.dense_layers

  @property
  def remat_layers(self) -> int:
    """Decoder layers run under the remat policy (the first ones)."""
    return 0 if self.remat == "none" else self.num_layers - self.remat_skip

  def is_remat(self, i: int) -> bool:
    return i < self.remat_layers

  def layer_groups(self) -> tuple[int, int, int]:
    """(first layer, period, groups) of the scanned decoder layers: the longest run of at least
    two back-to-back groups of ``period`` layers, after layer 0, whose layers agree in mixer,
    MLP kind and remat (K3: layers 1-88 as 22 groups of 3 KDA + 1 MLA); the smallest period
    among equals. (1, 1, 0) when nothing repeats."""
    return _layer_groups(tuple((self.layer_kind(i), self.is_moe(i), self.is_remat(i))
                               for i in range(self.num_layers)))


@functools.lru_cache(maxsize=64)
def _layer_groups(keys: tuple) -> tuple[int, int, int]:
  """See :meth:`ModelConfig.layer_groups` (``keys``: one hashable per layer)."""
  n, best = len(keys), (1, 1, 0)
  for p in range(1, n // 2 + 1):
    for s in range(1, n - 2 * p + 1):
      g = 1
      while s + (g + 1) * p <= n and keys[s + g * p:s + (g + 1) * p] == keys[s:s + p]:
        g += 1
      if g >= 2 and g * p > best[1] * best[2]:
        best = (s, p, g)
  return best


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = "stdlib"  # "stdlib" (embedded default), or a path/glob of text/jsonl/parquet/arrayrecord
  tokenizer: str = "byte"  # "byte", a tokenizer.json path, or a tiktoken model file path
  text_field: str = "text"
  seq_len: int = 256
  eval_fraction: float = 0.02
  seed: int = 0
  shuffle: bool = True
  prefetch: int = 2  # batches prepared ahead in a background thread (0: none)
  # image-text data (model.vision set; k3jax.vision_data): the text standing for an image in a
  # document, and the vision patches of one packed row (0: model.vision.max_patches)
  image_marker: str = "<image>"
  max_patches: int = 0
  # A resume whose data settings (k3jax.train.DATA_KEYS) differ from its checkpoint's is refused unless this
  # is true: then the new data starts from its beginning instead of the saved iterator position.
  reset_iterator: bool = False


@dataclasses.dataclass(frozen=True)
class StageConfig:
  seq_len: int = 256
  steps: int = 0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  name: str = "adamw"  # "adamw" or "muon"
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  schedule: str = "wsd"  # "wsd" (warmup-stable-decay), "cosine", "constant"
  warmup_steps: int = 20
  decay_fraction: float = 0.2
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  muon_per_head: bool = False
  muon_beta: float = 0.95  # Muon momentum
  # Matmul operands of Muon's Newton-Schulz iteration: "bf16" (float32 accumulation; float32
  # elsewhere) or "f32" (the backend's float32 matmul: TF32 on NVIDIA GPUs, exact on CPU).
  muon_ns_precision: str = "bf16"
  # The form of each Newton-Schulz step: "polynomial" or "sums" (k3jax.optim.NS_FORMS).
  ns_form: str = "polynomial"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300
  batch_size: int = 8
  grad_accum: int = 1
  seed: int = 0
  eval_every: int = 50
  eval_batches: int = 4
  log_every: int = 10
  max_nonfinite: int = 5
  stages: tuple[StageConfig, ...] = ()
  peak_tflops: float = 0.0  # 0: look the device up
  # Tokens per chunk of the LM-head loss (logits [chunk, vocab] at a time): larger chunks
  # accumulate the head's gradient fewer times (benchmarks/RESULTS.md, Training run 20).
  loss_chunk: int = 4096
  # Store the head's logits in bf16 between its matmul and the softmax (k3jax/losses.py): half
  # the traffic of the step's largest tensors, each logit rounded to bf16 before the softmax.
  bf16_logits: bool = False
  # Start from the weights of this directory (an HF checkpoint, a converted Orbax directory or a
  # train.py run): parameters and router biases only, a fresh optimizer, step 0. "": random init.
  init_from: str = ""
  # "pretrain" (next-token loss on data.source), "sft" (chat JSONL, loss on assistant tokens),
  # "rl" (GRPO on posttrain.tasks) or "opd" (on-policy distillation from posttrain.teachers):
  # docs/posttraining.md.
  mode: str = "pretrain"


@dataclasses.dataclass(frozen=True)
class PostTrainConfig:
  """``train.mode`` sft, rl and opd (k3jax.posttrain, docs/posttraining.md)."""
  tasks: tuple[str, ...] = ("copy",)  # built-in verifiable tasks (k3jax.posttrain.tasks.TASKS)
  prompts_per_step: int = 8  # problems whose groups an iteration trains on
  group_size: int = 8  # samples per problem (GRPO normalises rewards within a group)
  token_budget: int = 4  # generated tokens a problem may use (eos included); over it: reward -1
  temperature: float = 1.0
  # Partial rollout: an iteration trains once this fraction of its groups has finished; the rest
  # are paused with their cache and resumed first in the next iteration (1.0: wait for all).
  partial_fraction: float = 1.0
  clip_eps: float = 0.2  # PPO clip of the importance ratio against the behaviour policy
  kl_coef: float = 0.0  # per-token KL(current || behaviour) penalty (k3 estimator)
  stale_kl_coef: float = 0.1  # added to kl_coef on tokens sampled by an older policy
  # OPD: teacher weight directories (HF, Orbax or run directories of this model) and the task each
  # one scores (same length; a task not listed goes to the first teacher).
  teachers: tuple[str, ...] = ()
  teacher_tasks: tuple[str, ...] = ()
  eval_prompts: int = 16  # fixed problems on which OPD measures the student's KL to its teachers
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  enabled: bool = True  # false: neither restore nor save (benchmarks)
  every: int = 100
  keep: int = 3
  async_save: bool = True


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = -1
  fsdp: int = 1
  expert: int = 1
  context: int = 1
  tensor: int = 1
  moonep: bool = True
  # Mesh axes the routed experts are split over (expert parallelism). ("expert", "context") also
  # spreads them over the sequence-parallel ranks, whose tokens then go to experts by all-to-all.
  expert_axes: tuple[str, ...] = ("expert",)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """``serve.py`` and :class:`k3jax.serve.engine.Engine` (docs/serving.md)."""
  host: str = "127.0.0.1"
  port: int = 8000  # 0: any free port (the URL printed when ready names it)
  model_name: str = ""  # the id /v1/models lists ("": the model config's name)
  max_batch: int = 64  # requests decoding together; decode steps compile for powers of two up to it
  prefill_rows: int = 4  # requests whose prompt chunks run in one prefill step
  block_size: int = 256  # prefix-cache block and largest prefill chunk (tokens; a multiple of page_size)
  page_size: int = 64  # MLA latent tokens per cache page
  num_pages: int = 0  # MLA pages per layer (0: enough for max_batch requests of max_model_len)
  num_slots: int = 0  # KDA state slots, requests' and prefix checkpoints' (0: 2 * max_batch + 1)
  max_model_len: int = 8192  # prompt plus generated tokens of one request
  token_budget: int = 2048  # prompt tokens prefilled per engine step (decode tokens not counted)
  prefix_cache: bool = True
  checkpoint_every: int = 1  # a KDA state checkpoint every this many blocks of a prompt
  default_max_tokens: int = 256  # max_tokens when a request leaves it out


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  data: DataConfig = DataConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  mesh: MeshConfig = MeshConfig()
  serve: ServeConfig = ServeConfig()
  posttrain: PostTrainConfig = PostTrainConfig()


# ---------------------------------------------------------------------------------------------
# Building dataclasses from plain dicts, with errors that name the key.


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, tp: Any, key: str) -> Any:
  origin = typing.get_origin(tp)
  if origin in (types.UnionType, typing.Union):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    others = [a for a in args if a is not type(None)]
    if len(others) == 1:  # an optional field: the inner type's error names the inner key
      return _coerce(value, others[0], key)
    for a in args:
      if a is type(None):
        continue
      try:
        return _coerce(value, a, key)
      except ConfigError:
        pass
    raise ConfigError(f"{key}: expected {tp}, got {value!r}")
  if origin is tuple:
    (elem, *_rest) = typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}: expected a list, got {value!r}")
    return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if not isinstance(value, dict):
      raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
    return _build(tp, value, key)
  if tp is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{key}: expected true/false, got {value!r}")
  if tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise ConfigError(f"{key}: expected an integer, got {value!r}")
  if tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
      return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    raise ConfigError(f"{key}: expected a number, got {value!r}")
  if tp is str:
    if isinstance(value, str):
      return value
    raise ConfigError(f"{key}: expected a string, got {value!r}")
  raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  for k in data:
    if k not in names:
      full = f"{prefix}.{k}" if prefix else k
      raise ConfigError(f"unknown config key {full!r} (known: {', '.join(sorted(names))})")
  kwargs = {}
  for k, v in data.items():
    full = f"{prefix}.{k}" if prefix else k
    kwargs[k] = _coerce(v, hints[k], full)
  return cls(**kwargs)


def to_dict(cfg: Any) -> Any:
  """The config as plain YAML-able Python data (tuples become lists)."""
  if dataclasses.is_dataclass(cfg):
    return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
  if isinstance(cfg, tuple):
    return [to_dict(v) for v in cfg]
  return cfg


def _apply_override(tree: dict, item: str) -> None:
  if "=" not in item:
    raise ConfigError(f"override {item!r}: expected key=value")
  key, raw = item.split("=", 1)
  key = key.strip()
  value = yaml.safe_load(raw) if raw.strip() else ""
  parts = key.split(".")
  node = tree
  for p in parts[:-1]:
    node = node.setdefault(p, {})
    if not isinstance(node, dict):
      raise ConfigError(f"override {key!r}: {p!r} is not a section")
  node[parts[-1]] = value


def _merge(base: dict, over: dict) -> dict:
  out = dict(base)
  for k, v in over.items():
    if isinstance(v, dict) and isinstance(out.get(k), dict):
      out[k] = _merge(out[k], v)
    else:
      out[k] = v
  return out


def from_dict(data: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  tree = _merge({}, data or {})
  for item in overrides:
    _apply_override(tree, item)
  cfg = _build(Config, tree)
  validate(cfg)
  return cfg


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
  """Loads a YAML config, applies ``key=value`` overrides and validates the result."""
  from k3jax import storage
  given, path = path, storage.path(path)
  if not path.is_file():
    raise ConfigError(f"config file {str(given)!r} does not exist")
  with path.open() as f:
    data = yaml.safe_load(f) or {}
  if not isinstance(data, dict):
    raise ConfigError(f"{path}: top level must be a mapping")
  return from_dict(data, overrides)


def replace(cfg: Config, overrides: list[str]) -> Config:
  """A copy of ``cfg`` with ``key=value`` overrides applied and validated."""
  return from_dict(to_dict(cfg), overrides)


def replace_model(model: ModelConfig, overrides: list[str] | tuple[str, ...]) -> ModelConfig:
  """``model`` with ``model.*`` overrides applied and validated (ConfigError for other keys)."""
  other = [o for o in overrides if not o.partition("=")[0].startswith("model.")]
  if other:
    raise ConfigError(f"{other[0]}: only model.* overrides apply here")
  return replace(Config(model=model), list(overrides)).model if overrides else model


# ---------------------------------------------------------------------------------------------


def _check(cond: bool, key: str, msg: str) -> None:
  if not cond:
    raise ConfigError(f"{key}: {msg}")


def _one_of(value: Any, options: tuple, key: str) -> None:
  _check(value in options, key, f"must be one of {options}, got {value!r}")


def validate(cfg: Config) -> None:
  m = cfg.model
  _one_of(m.arch, ("kimi_k3", "kimi_linear"), "model.arch")
  _one_of(m.activation, ("situ", "silu"), "model.activation")
  _one_of(m.param_dtype, ("float32", "bfloat16", "float64"), "model.param_dtype")
  _one_of(m.compute_dtype, ("float32", "bfloat16", "float64"), "model.compute_dtype")
  _one_of(m.remat, ("none", "full", "dots", "dots_kernels"), "model.remat")
  _check(0 <= m.remat_skip <= m.num_layers, "model.remat_skip",
         f"must be in [0, num_layers={m.num_layers}], got {m.remat_skip}")
  for name in ("vocab_size", "hidden_size", "num_layers", "dense_intermediate"):
    _check(getattr(m, name) > 0, f"model.{name}", "must be positive")
  for name in ("mla_layers", "dense_layers"):
    for i in getattr(m, name):
      _check(0 <= i < m.num_layers, f"model.{name}",
             f"layer index {i} out of range for num_layers={m.num_layers}")
  for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
    _check(0 <= getattr(m, name) < m.vocab_size, f"model.{name}", "must be a token id < vocab_size")

  for part, names in IMPLEMENTATIONS.items():
    _one_of(getattr(m, part).implementation, (None, *names), f"model.{part}.implementation")

  k = m.kda
  _one_of(k.gate, ("bounded", "softplus"), "model.kda.gate")
  _one_of(k.output_gate, ("full", "low_rank"), "model.kda.output_gate")
  _one_of(k.conv_implementation, (None, "xla", "pallas", "pallas_gpu"),
          "model.kda.conv_implementation")
  _one_of(m.attn_res.implementation, (None, "xla", "pallas", "pallas_gpu"),
          "model.attn_res.implementation")
  _one_of(m.glu_implementation, (None, "xla", "pallas", "pallas_gpu", "pallas_tpu"),
          "model.glu_implementation")
  _check(k.head_dim in KERNEL_HEAD_DIMS, "model.kda.head_dim",
         f"the KDA kernels take head dims {KERNEL_HEAD_DIMS}, got {k.head_dim}")
  _check(k.v_head_dim in KERNEL_HEAD_DIMS, "model.kda.v_head_dim",
         f"the KDA kernels take head dims {KERNEL_HEAD_DIMS}, got {k.v_head_dim}")
  _check(k.num_heads > 0, "model.kda.num_heads", "must be positive")
  _check(k.value_heads % k.num_heads == 0, "model.kda.num_v_heads",
         f"must be a multiple of num_heads={k.num_heads}, got {k.num_v_heads}")
  _check(k.gate_lower_bound < 0, "model.kda.gate_lower_bound", "must be negative")
  _check(k.conv_size >= 1, "model.kda.conv_size", "must be >= 1")
  _check(k.chunk_size in (16, 32, 64, 128), "model.kda.chunk_size", "must be 16, 32, 64 or 128")

  a = m.mla
  _check(a.num_heads > 0, "model.mla.num_heads", "must be positive")
  _check(a.kv_lora_rank > 0, "model.mla.kv_lora_rank", "must be positive")
  _check(a.q_lora_rank >= 0, "model.mla.q_lora_rank", "must be >= 0")
  for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    _check(getattr(a, name) > 0, f"model.mla.{name}", "must be positive")

  e = m.moe
  _one_of(e.balancing, ("quantile", "quantile_hist", "sign", "none"), "model.moe.balancing")
  _check(e.num_experts > 0, "model.moe.num_experts", "must be positive")
  _check(1 <= e.top_k <= e.num_experts, "model.moe.top_k",
         f"top_k={e.top_k} must be between 1 and num_experts={e.num_experts}")
  _check(e.top_k < e.num_experts or e.balancing == "none", "model.moe.balancing",
         "quantile balancing needs top_k < num_experts")
  _check(e.balancing_iters >= 1, "model.moe.balancing_iters", "must be >= 1")
  _check(e.latent_dim >= 0, "model.moe.latent_dim", "must be >= 0")
  _check(e.num_shared_experts >= 0, "model.moe.num_shared_experts", "must be >= 0")

  _check(m.attn_res.block_size > 0, "model.attn_res.block_size", "must be positive")
  if m.vision is not None:
    _validate_vision(m)

  _check(cfg.data.seq_len > 0, "data.seq_len", "must be positive")
  _check(bool(cfg.data.image_marker), "data.image_marker", "must not be empty")
  _check(cfg.data.max_patches >= 0, "data.max_patches", "must be >= 0 (0: model.vision.max_patches)")
  _check(0.0 <= cfg.data.eval_fraction < 1.0, "data.eval_fraction", "must be in [0, 1)")
  _check(cfg.data.prefetch >= 0, "data.prefetch", "must be >= 0")
  t = cfg.train
  _check(t.steps >= 0, "train.steps", "must be >= 0")
  _check(t.batch_size > 0, "train.batch_size", "must be positive")
  _check(t.grad_accum > 0, "train.grad_accum", "must be positive")
  _check(t.loss_chunk > 0, "train.loss_chunk", "must be positive")
  _check(t.log_every > 0, "train.log_every", "must be positive")
  _check(t.eval_every >= 0, "train.eval_every", "must be >= 0 (0: no eval)")
  _check(t.eval_batches > 0, "train.eval_batches", "must be positive")
  _check(t.max_nonfinite > 0, "train.max_nonfinite", "must be positive")
  _check(t.batch_size % t.grad_accum == 0, "train.grad_accum",
         f"must divide train.batch_size={t.batch_size}")
  _one_of(t.mode, ("pretrain", "sft", "rl", "opd"), "train.mode")
  for i, s in enumerate(t.stages):
    _check(s.seq_len > 0 and s.steps > 0, f"train.stages[{i}]", "seq_len and steps must be positive")
  o = cfg.optimizer
  _one_of(o.name, ("adamw", "muon"), "optimizer.name")
  _one_of(o.schedule, ("wsd", "cosine", "constant"), "optimizer.schedule")
  _one_of(o.muon_ns_precision, ("bf16", "f32"), "optimizer.muon_ns_precision")
  _one_of(o.ns_form, ("sums", "polynomial"), "optimizer.ns_form")
  _check(o.lr > 0, "optimizer.lr", f"must be positive, got {o.lr}")
  _check(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", "must be in [0, 1]")
  _check(o.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
  _check(0 <= o.decay_fraction <= 1, "optimizer.decay_fraction", "must be in [0, 1]")
  for name in ("b1", "b2", "muon_beta"):
    _check(0 <= getattr(o, name) < 1, f"optimizer.{name}", "must be in [0, 1)")
  _check(o.eps > 0, "optimizer.eps", "must be positive")
  for name in ("weight_decay", "grad_clip"):
    _check(getattr(o, name) >= 0, f"optimizer.{name}", "must be >= 0")
  _check(cfg.checkpoint.every > 0, "checkpoint.every", "must be positive")
  _check(cfg.checkpoint.keep > 0, "checkpoint.keep", "must be positive")
  for name in ("data", "fsdp", "expert", "context", "tensor"):
    v = getattr(cfg.mesh, name)
    _check(v == -1 or v > 0, f"mesh.{name}", "must be positive or -1 (the rest of the devices)")
  _check(sum(getattr(cfg.mesh, n) == -1 for n in ("data", "fsdp", "expert", "context", "tensor")) <= 1,
         "mesh", "at most one axis may be -1")
  ea = cfg.mesh.expert_axes
  _check(len(ea) > 0 and len(set(ea)) == len(ea) and set(ea) <= {"data", "fsdp", "expert", "context"},
         "mesh.expert_axes", f"{list(ea)}: must be distinct axes among data, fsdp, expert, context")
  s = cfg.serve
  _check(0 <= s.port < 65536, "serve.port", f"must be in [0, 65535] (0: any free port), got {s.port}")
  for name in ("max_batch", "prefill_rows", "block_size", "page_size", "max_model_len",
               "token_budget", "checkpoint_every", "default_max_tokens"):
    _check(getattr(s, name) > 0, f"serve.{name}", f"must be positive, got {getattr(s, name)}")
  _check(s.block_size % s.page_size == 0, "serve.block_size",
         f"must be a multiple of serve.page_size={s.page_size}, got {s.block_size}")
  _check(s.num_pages >= 0 and s.num_slots >= 0, "serve", "num_pages and num_slots must be >= 0 "
         "(0: sized from max_batch and max_model_len)")
  _check(s.token_budget >= s.block_size, "serve.token_budget",
         f"must be at least serve.block_size={s.block_size}, got {s.token_budget}")
  _validate_posttrain(cfg)


def _validate_vision(m: ModelConfig) -> None:
  v = m.vision
  for name in ("patch_size", "channels", "hidden_size", "num_layers", "num_heads",
               "intermediate_size", "pos_emb_height", "pos_emb_width", "pos_emb_frames",
               "rope_max_grid", "in_patch_limit", "frame_patch_limit", "side_limit", "max_patches",
               "max_pixels"):
    _check(getattr(v, name) > 0, f"model.vision.{name}", f"must be positive, got {getattr(v, name)}")
  _check(v.qkv_size >= 0, "model.vision.qkv_size", "must be >= 0 (0: hidden_size)")
  _check(v.attn_size % v.num_heads == 0, "model.vision.num_heads",
         f"must divide the attention width {v.attn_size}, got {v.num_heads}")
  _check(v.head_dim % 4 == 0, "model.vision.num_heads",
         f"the 2D rotary embedding needs a head dim divisible by 4, got {v.head_dim}")
  _check(len(v.merge_kernel) == 2 and min(v.merge_kernel) > 0, "model.vision.merge_kernel",
         f"must be two positive sizes (rows, cols), got {list(v.merge_kernel)}")
  _check(v.max_patches % v.merge == 0, "model.vision.max_patches",
         f"must be a multiple of the merge kernel's {v.merge} patches, got {v.max_patches}")
  for name in ("image_mean", "image_std"):
    _check(len(getattr(v, name)) == v.channels, f"model.vision.{name}",
           f"needs one value per channel ({v.channels})")
  _check(min(v.image_std) > 0, "model.vision.image_std", "must be positive")
  _check(v.norm_eps > 0 and v.projector_eps > 0, "model.vision.norm_eps",
         "norm_eps and projector_eps must be positive")
  _one_of(v.pos_emb_interpolation, ("bicubic", "bilinear"), "model.vision.pos_emb_interpolation")
  _one_of(v.norm, ("layernorm", "rmsnorm"), "model.vision.norm")
  _one_of(v.video_attention, ("joint", "divided"), "model.vision.video_attention")
  _one_of(v.projector, ("patchmerger", "patchmerger_v2"), "model.vision.projector")
  _one_of(v.alpha, ("chessboard", "drop"), "model.vision.alpha")
  _check(0 <= v.image_token_id < m.vocab_size, "model.vision.image_token_id",
         f"must be a token id < vocab_size={m.vocab_size}, got {v.image_token_id}")
  _check(v.image_token_id not in (m.bos_token_id, m.eos_token_id, m.pad_token_id),
         "model.vision.image_token_id", "must differ from the bos, eos and pad ids")


def _validate_posttrain(cfg: Config) -> None:
  from k3jax.posttrain.tasks import TASKS
  p = cfg.posttrain
  _check(len(p.tasks) > 0, "posttrain.tasks", "must name at least one task")
  for t in p.tasks + p.teacher_tasks:
    _one_of(t, tuple(TASKS), "posttrain.tasks" if t in p.tasks else "posttrain.teacher_tasks")
  for name in ("prompts_per_step", "group_size", "token_budget", "eval_prompts"):
    _check(getattr(p, name) > 0, f"posttrain.{name}", f"must be positive, got {getattr(p, name)}")
  _check(p.temperature > 0, "posttrain.temperature", "must be positive (rollouts sample)")
  _check(0 < p.partial_fraction <= 1, "posttrain.partial_fraction",
         f"must be in (0, 1], got {p.partial_fraction}")
  for name in ("clip_eps", "kl_coef", "stale_kl_coef"):
    _check(getattr(p, name) >= 0, f"posttrain.{name}", "must be >= 0")
  _check(not p.teacher_tasks or len(p.teacher_tasks) == len(p.teachers), "posttrain.teacher_tasks",
         f"must name one task per teacher ({len(p.teachers)} teachers)")
  _check(cfg.train.mode != "opd" or p.teachers, "posttrain.teachers",
         "train.mode=opd needs at least one teacher directory")


def dtype(name: str):
  import jax.numpy as jnp
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}[name]
