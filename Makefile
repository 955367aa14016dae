# hyper-parallel developer entry points.
#
#   make test        create .venv if missing, install, run every test
#   make test-quick  same, without the slow and the distributed tests
#   make demo        same install, then run the mode-comparison bench
#   make test-mindspore  create .venv-ms (mindspore==2.10.0, numpy<2), run tests_mindspore/
#
# Installing is idempotent: a stamp file inside .venv, named after a hash of
# pyproject.toml and of the torch pin, records a finished install, so a second
# `make test` goes straight to pytest.  Torch is always installed pinned first
# (an unpinned `pip install torch` can pull a multi-GB CUDA build).

PYTHON3     ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
TORCH_PIN   ?= torch==2.13.0
# Extra pip arguments for the torch install, e.g.
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

PIP_ENV := PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
INSTALL_KEY := $(shell { cat pyproject.toml; echo '$(TORCH_PIN) $(TORCH_PIP_ARGS)'; } | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.hyper-parallel-installed-$(INSTALL_KEY)

.PHONY: test test-quick demo install venv clean

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -m "not slow and not distributed" $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m hyper_parallel.bench

install: $(STAMP)

venv: $(PY)

$(PY):
	$(PYTHON3) -m venv $(VENV)

$(STAMP): | $(PY)
	$(PIP_ENV) $(PY) -m pip install --quiet "$(TORCH_PIN)" $(TORCH_PIP_ARGS)
	$(PIP_ENV) $(PY) -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.hyper-parallel-installed-*
	touch $@

clean:
	rm -rf build dist *.egg-info .pytest_cache results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print -exec rm -rf {} +

include mk/mindspore.mk
