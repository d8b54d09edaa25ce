"""Checkpoint conversion between released HF safetensors and Orbax (``python convert.py -h``);
the command line is :mod:`k3jax.convert.cli`."""

import sys

from k3jax.convert.cli import main

if __name__ == "__main__":
  sys.exit(main())
