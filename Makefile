# Two commands do everything on a fresh machine:  make train  and  make test.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# compile-only TPU and GPU targets (k3jax/aot.py): their plugins live outside the venv
AOT := .aot
AOT_TPU := $(AOT)/tpu/.installed
AOT_CUDA := $(AOT)/cuda/.installed

.PHONY: train test test-fast install generate clean aot

$(STAMP): pyproject.toml
	test -x $(PY) || "$$(scripts/python312)" -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(AOT_TPU): | $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(AOT)/tpu 'libtpu==0.0.48.*'
	touch $@

$(AOT_CUDA): | $(STAMP)
	$(PY) -m pip install -q --target $(AOT)/cuda 'jax-cuda13-plugin[with-cuda]==0.11.2'
	touch $@

## Compile for an H200 or a TPU on this host: python -m k3jax.plan CONFIG --mesh ... --compile h200
aot: $(AOT_TPU) $(AOT_CUDA)

## The main job: pre-train the tiny preset on the embedded default data (a few minutes on CPU).
train: $(STAMP)
	$(PY) train.py

## The test suite (CPU; a persistent JAX compilation cache makes reruns fast).
test: $(STAMP) $(AOT_TPU)
	JAX_COMPILATION_CACHE_DIR=$${JAX_COMPILATION_CACHE_DIR:-$$HOME/.cache/k3jax-jax} \
	  $(PY) -m pytest -n 2 --dist loadfile --durations=30 tests

## The quick loop while working: the suite without the tests marked slow (docs/testing.md).
test-fast: $(STAMP)
	JAX_COMPILATION_CACHE_DIR=$${JAX_COMPILATION_CACHE_DIR:-$$HOME/.cache/k3jax-jax} \
	  $(PY) -m pytest -n 2 --dist loadfile -m "not slow" tests

generate: $(STAMP)
	$(PY) -m k3jax.generate --config k3_tiny --prompt "def main(" --max-new-tokens 64

clean:
	rm -rf $(VENV) $(AOT) .pytest_cache
