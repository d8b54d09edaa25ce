"""The model's configuration: :class:`ModelConfig` and its parts (KDA, MLA, MoE, Block AttnRes,
the vision tower), and :class:`ConfigError`, which every configuration error raises."""

from __future__ import annotations

import dataclasses
import functools

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
  # Decoding on one device: up to this many tokens run all experts densely
  # (k3jax.latent_moe.all_experts): a few matmuls in place of the sort, the grouped matmuls and
  # the scatter, where their pairs (tokens x top_k) leave at most dense_decode_unpicked_mb of
  # expert weights per layer unpicked (read for nothing: about the time of the routed path's
  # extra launches at 64 MB; k3_1b's two-row step reads 50 MB more, K3's any step tens of GB).
  # dense_decode_tokens=0: never; dense_decode_unpicked_mb=0: only where pairs >= experts.
  dense_decode_tokens: int = 128
  dense_decode_unpicked_mb: float = 64.0


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
    """(first layer, period, groups) of the scanned decoder layers: at least two back-to-back
    groups of ``period`` layers whose layers agree in mixer, MLP kind and remat, chosen so that
    the fewest layers are compiled: one per run of like layers in a group (:meth:`group_runs`)
    and outside the groups (:meth:`layer_runs`); the smallest period, then the first start,
    among equals. K3: layers 3-90 as 22 groups of an MLA layer and three KDA layers, with layer
    0 and the runs 1-2 and 91-92 outside (five layers compiled). (1, 1, 0) when nothing
    repeats."""
    return _layer_groups(self._layer_keys(), *self._alone())

  def group_runs(self) -> list[tuple[int, int]]:
    """The positions of a scanned group in runs of back-to-back like layers (as
    :meth:`layer_groups` compares them) under full remat: ``(first position, length)`` each (K3:
    ``[(0, 1), (1, 3)]``, an MLA layer then three KDA layers). The scan runs a run as an inner
    ``lax.scan``: one of its layers is compiled (k3jax/scan.py)."""
    start, p, _ = self.layer_groups()
    return _runs(_free_keys(self._layer_keys(), self._alone()[0])[start:start + p])

  def layer_runs(self) -> list[tuple[int, int]]:
    """The layers outside the scanned groups in runs as :meth:`group_runs`'s, none of whose
    layers commits an AttnRes block: ``(first layer, length)`` each, in order (K3: ``[(0, 1),
    (1, 2), (91, 2)]``). A scanned decoder runs a run of two or more as one ``lax.scan``."""
    start, p, g = self.layer_groups()
    free = _free_keys(self._layer_keys(), self._alone()[1])
    end = start + p * g
    return [*_runs(free[:start]), *[(end + j, r) for j, r in _runs(free[end:])]]

  def _layer_keys(self) -> tuple:
    return tuple((self.layer_kind(i), self.is_moe(i), self.is_remat(i))
                 for i in range(self.num_layers))

  def _alone(self) -> tuple[tuple, tuple]:
    """Which layers join no run, inside the groups and outside them. Only layers under full
    remat join one: with saved activations, a run's inner scan copies them out of its loop
    (k3_1b scanned without remat: 18 GiB more, benchmarks/RESULTS.md). Outside the groups
    neither does a layer that commits an AttnRes block: the blocks are a tuple there, of a known
    length."""
    inside = tuple(not (self.remat == "full" and self.is_remat(i)) for i in range(self.num_layers))
    a = self.attn_res
    return inside, tuple(x or (a.enabled and i % a.block_size == 0) for i, x in enumerate(inside))

  def scan_positions(self) -> list[list[int]]:
    """The scanned layers' indices by position in the group, then by group: ``[p][g]`` of
    :meth:`layer_groups` (K3: 4 lists of 22 layers); the scan and the stacked optimizer share
    this order."""
    return group_positions(*self.layer_groups())


def group_positions(start: int, p: int, g: int) -> list[list[int]]:
  """The layer indices ``[p][g]`` of ``g`` groups of ``p`` layers from layer ``start``, by
  position in the group, then by group."""
  return [[start + k * p + j for k in range(g)] for j in range(p)]


def _runs(keys: tuple) -> list[tuple[int, int]]:
  """(first index, length) of each run of equal back-to-back ``keys``."""
  runs = []
  for j, key in enumerate(keys):
    if runs and keys[runs[-1][0]] == key:
      runs[-1] = (runs[-1][0], runs[-1][1] + 1)
    else:
      runs.append((j, 1))
  return runs


def _free_keys(keys: tuple, alone: tuple) -> tuple:
  """``keys`` with the key of each layer marked ``alone`` made unique, so that it joins no run."""
  return tuple((key, i) if solo else key for i, (key, solo) in enumerate(zip(keys, alone)))


@functools.lru_cache(maxsize=64)
def _layer_groups(keys: tuple, inside: tuple, outside: tuple) -> tuple[int, int, int]:
  """See :meth:`ModelConfig.layer_groups` (``keys``: one hashable per layer; ``inside``,
  ``outside``: :meth:`ModelConfig._alone`)."""
  n, best, cost = len(keys), (1, 1, 0), len(keys) + 1
  free_in, free_out = _free_keys(keys, inside), _free_keys(keys, outside)
  for p in range(1, n // 2 + 1):
    for s in range(1, n - 2 * p + 1):
      g = 1
      while s + (g + 1) * p <= n and keys[s + g * p:s + (g + 1) * p] == keys[s:s + p]:
        g += 1
      compiled = (len(_runs(free_out[:s])) + len(_runs(free_in[s:s + p]))
                  + len(_runs(free_out[s + g * p:])))
      if g >= 2 and compiled < cost:
        best, cost = (s, p, g), compiled
  return best


def dtype(name: str):
  import jax.numpy as jnp
  return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}[name]
