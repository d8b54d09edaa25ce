"""Configuration: frozen dataclasses loaded from YAML with ``key=value`` overrides.

``load(path, overrides=["model.num_layers=8", "train.steps=10"])`` returns a validated
:class:`Config`. Every error names the offending key: an unknown key, a value of the wrong type,
or values that do not fit together (top-k above the expert count, a layer index out of range, a
head dim the kernels cannot take).

The model's part is in :mod:`k3jax.config.model`, the run's (data, optimizer, training, mesh,
serving, ...) in :mod:`k3jax.config.run`, YAML and overrides in :mod:`k3jax.config.loading`, the
consistency checks in :mod:`k3jax.config.checks`.
"""

from k3jax.config.checks import validate
from k3jax.config.loading import from_dict, load, replace, replace_model, to_dict
from k3jax.config.model import (IMPLEMENTATIONS, KERNEL_HEAD_DIMS, AttnResConfig, ConfigError,
                                KDAConfig, MLAConfig, ModelConfig, MoEConfig, VisionConfig, dtype)
from k3jax.config.run import (CheckpointConfig, Config, DataConfig, MeshConfig, OptimizerConfig,
                              PostTrainConfig, ServeConfig, StageConfig, TrainConfig)

__all__ = ["IMPLEMENTATIONS", "KERNEL_HEAD_DIMS", "AttnResConfig", "CheckpointConfig", "Config",
           "ConfigError", "DataConfig", "KDAConfig", "MLAConfig", "MeshConfig", "ModelConfig",
           "MoEConfig", "OptimizerConfig", "PostTrainConfig", "ServeConfig", "StageConfig",
           "TrainConfig", "VisionConfig", "dtype", "from_dict", "load", "replace", "replace_model",
           "to_dict", "validate"]
