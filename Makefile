# Two commands do everything on a fresh machine:  make train  and  make test.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test install generate clean

$(STAMP): pyproject.toml
	test -x $(PY) || "$$(scripts/python312)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## The main job: pre-train the tiny preset on the embedded default data (a few minutes on CPU).
train: $(STAMP)
	$(PY) train.py

## The test suite (CPU; a persistent JAX compilation cache makes reruns fast).
test: $(STAMP)
	JAX_COMPILATION_CACHE_DIR=$${JAX_COMPILATION_CACHE_DIR:-$$HOME/.cache/k3jax-jax} \
	  $(PY) -m pytest -n 2 --dist loadfile tests

generate: $(STAMP)
	$(PY) -m k3jax.generate --config configs/k3_tiny.yaml --prompt "def main(" --max-new-tokens 64

clean:
	rm -rf $(VENV) .pytest_cache
