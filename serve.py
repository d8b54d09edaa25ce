"""Serves a K3 model over an OpenAI-compatible HTTP API:
``python serve.py --config CONFIG [--checkpoint DIR] [--tokenizer PATH] [--host H] [--port P] [key=value ...]``.

The command line is :mod:`k3jax.serve.cli`, the API :mod:`k3jax.serve.api`, the engine
:mod:`k3jax.serve.engine`; docs/serving.md describes them.
"""

import sys

from k3jax.serve.cli import main

if __name__ == "__main__":
  sys.exit(main())
