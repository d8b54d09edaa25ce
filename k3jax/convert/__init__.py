"""Hugging Face safetensors <-> k3jax parameters, for Kimi Linear and Kimi K3 (SPEC section 9).

- :mod:`~k3jax.convert.hf_config`: ``config.json`` <-> :class:`~k3jax.config.ModelConfig`.
- :mod:`~k3jax.convert.names`: for every parameter of :class:`~k3jax.model.K3Model`, the HF
  tensors it is made of and how (transpose a torch ``Linear [out, in]``, reshape a conv
  ``[C, 1, W]``, stack per-expert ``w1/w3/w2`` into ``[E, L, 2F]`` / ``[E, F, L]``, ...).
- :mod:`~k3jax.convert.mxfp4`: the MXFP4 packing of K3's routed experts.
- :mod:`~k3jax.convert.safetensors_io` and :mod:`~k3jax.convert.orbax_io`: the two formats.
- :mod:`~k3jax.convert.to_orbax` and :mod:`~k3jax.convert.to_hf`: the two directions, streaming
  one tensor (one expert) at a time into a directory renamed into place only when complete.

Converted directory layout (``OUT_DIR``): ``params/`` (Orbax PyTree checkpoint: nested dicts
following the NNX attribute paths, layers keyed "0", "1", ...), ``config.json`` (the HF config as
found), ``k3jax.yaml`` (our :class:`ModelConfig`), ``hf_manifest.json`` (HF names, dtypes and
shapes, used by ``orbax-to-hf`` to reproduce the checkpoint exactly) and ``hf_extra/`` (the
source's other small files: tokenizer, generation config).
"""

from k3jax.convert.errors import ConversionError
from k3jax.convert.hf_config import ARCHS, config_from_hf, config_to_hf, read_hf_config
from k3jax.convert.mxfp4 import MXFP4_GROUP, mxfp4_dequantize, mxfp4_quantize
from k3jax.convert.names import Param, detect_prefix, plan, validate
from k3jax.convert.orbax_io import OrbaxReader, load_orbax_config, load_orbax_params
from k3jax.convert.safetensors_io import SafetensorsReader, SafetensorsWriter, TensorInfo
from k3jax.convert.to_hf import orbax_to_hf
from k3jax.convert.to_orbax import block_shape, hf_to_orbax, load_hf_params, mesh_shard_shape

__all__ = [
    "ARCHS", "ConversionError", "MXFP4_GROUP", "OrbaxReader", "Param", "SafetensorsReader",
    "SafetensorsWriter", "TensorInfo", "block_shape", "config_from_hf", "config_to_hf",
    "detect_prefix", "hf_to_orbax", "load_hf_params", "load_orbax_config", "load_orbax_params",
    "mesh_shard_shape", "mxfp4_dequantize", "mxfp4_quantize", "orbax_to_hf", "plan",
    "read_hf_config", "validate",
]
