"""k3jax: Kimi K3 and Kimi Linear in JAX (Flax NNX).

- ``k3jax.config.load(path, overrides)``: frozen, validated configs.
- ``k3jax.K3Model(cfg.model, rngs=nnx.Rngs(0))``: the model; ``model(input_ids)`` -> logits.
- ``k3jax.generate(model, prompts, max_new_tokens=...)``: cached decoding of token lists or text.
- ``k3jax.from_pretrained(path)``: a model from a train.py run, an HF or a converted Orbax directory.
"""

from k3jax import config
from k3jax.generate import generate
from k3jax.model import K3Model
from k3jax.pretrained import from_pretrained

__all__ = ["config", "from_pretrained", "generate", "K3Model"]
