"""Pre-trains a K3 model: ``python train.py [--config CONFIG] [--run-dir DIR] [key=value ...]``.

With no arguments it trains ``configs/k3_tiny.yaml`` on the embedded default data into
``runs/k3_tiny``; running again with the same run directory resumes. The loop is
:mod:`k3jax.train`.
"""

import sys

from k3jax.train import main

if __name__ == "__main__":
  sys.exit(main())
