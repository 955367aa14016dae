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
# (an unpinned `pip install torch` can pull a multi-GB CUDA build).  Every step
# prints a "==>" line and pip shows what it downloads and installs (a first
# install takes a few minutes); pytest shows its progress per test file.

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

# Two passes: every test but the timing ones on two worker processes (pytest-xdist), then the timing
# ones alone (they assert on times they measure, which another worker's load would move).
test: $(STAMP)
	@echo "==> pytest, pass 1 of 2: every test but the timing ones, on 2 worker processes, the slow and multi-process ones included"
	$(PY) -m pytest -n 2 -m "not timing" $(PYTEST_ARGS)
	@echo "==> pytest, pass 2 of 2: the timing tests, one process, nothing else running"
	$(PY) -m pytest -m timing $(PYTEST_ARGS) || [ $$? -eq 5 ]  # (5: the arguments selected no timing test)

test-quick: $(STAMP)
	@echo "==> pytest: without the slow and the multi-process tests"
	$(PY) -m pytest -m "not slow and not distributed" $(PYTEST_ARGS)

demo: $(STAMP)
	@echo "==> the mode comparison: every mode trains the small GPT in its own process (7 processes, forked from one that has imported torch: 28 s measured on 2 idle cores, more while other jobs share them)"
	$(PY) -m hyper_parallel.bench

install: $(STAMP)

venv: $(PY)

$(PY):
	@echo "==> [1/3] creating the virtualenv $(VENV)"
	$(PYTHON3) -m venv $(VENV)

$(STAMP): | $(PY)
	@echo "==> [2/3] installing $(TORCH_PIN) $(TORCH_PIP_ARGS) into $(VENV) (the biggest download)"
	$(PIP_ENV) $(PY) -m pip install "$(TORCH_PIN)" $(TORCH_PIP_ARGS)
	@echo "==> [3/3] installing hyper-parallel (editable) with its test dependencies"
	$(PIP_ENV) $(PY) -m pip install -e '.[test]'
	rm -f $(VENV)/.hyper-parallel-installed-*
	touch $@
	@echo "==> installed; the next make test / make demo skips this"

clean:
	rm -rf build dist *.egg-info .pytest_cache results
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print -exec rm -rf {} +

include mk/mindspore.mk
