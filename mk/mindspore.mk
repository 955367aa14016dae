# MindSpore backend: `make test-mindspore` builds its own virtualenv and runs tests_mindspore/.
#
#   make test-mindspore         create .venv-ms if missing, install MindSpore, run its tests
#   make test-mindspore-quick   the same without the per-mode subprocess runs (marked slow)
#
# Included from the top-level Makefile (`include mk/mindspore.mk`). The MindSpore wheel is big
# (about 0.9 GB download, 2.8 GB installed) and wants numpy<2, so it never shares .venv with torch;
# the library itself is not pip-installed there (that would pull torch): pytest runs from the
# repository root, which puts `hyper_parallel` on sys.path.

PYTHON3         ?= python3
MS_VENV         ?= .venv-ms
MS_PY           := $(MS_VENV)/bin/python
MS_PIN          ?= mindspore==2.10.0
MS_NUMPY_PIN    ?= numpy<2
MS_PIP_ARGS     ?=
PYTEST_ARGS     ?=
MS_PIP_ENV      := PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
MS_INSTALL_KEY  := $(shell echo '$(MS_PIN) $(MS_NUMPY_PIN) $(MS_PIP_ARGS)' | cksum | cut -d' ' -f1)
MS_STAMP        := $(MS_VENV)/.hyper-parallel-ms-installed-$(MS_INSTALL_KEY)
# GLOG_v=3: MindSpore logs errors only (its CPU build warns about absent Ascend plugins otherwise)
MS_TEST_ENV     := HYPER_PARALLEL_PLATFORM=mindspore GLOG_v=3

.PHONY: test-mindspore test-mindspore-quick install-mindspore

test-mindspore: $(MS_STAMP)
	@echo "==> pytest tests_mindspore (HYPER_PARALLEL_PLATFORM=mindspore)"
	$(MS_TEST_ENV) $(MS_PY) -m pytest tests_mindspore $(PYTEST_ARGS)

test-mindspore-quick: $(MS_STAMP)
	$(MS_TEST_ENV) $(MS_PY) -m pytest tests_mindspore -m "not slow" $(PYTEST_ARGS)

install-mindspore: $(MS_STAMP)

$(MS_PY):
	@echo "==> [1/2] creating the virtualenv $(MS_VENV)"
	$(PYTHON3) -m venv $(MS_VENV)

$(MS_STAMP): | $(MS_PY)
	@echo "==> [2/2] installing $(MS_PIN) ($(MS_NUMPY_PIN), pytest) into $(MS_VENV): about 0.9 GB to download"
	$(MS_PIP_ENV) $(MS_PY) -m pip install "$(MS_PIN)" "$(MS_NUMPY_PIN)" pytest $(MS_PIP_ARGS)
	rm -f $(MS_VENV)/.hyper-parallel-ms-installed-*
	touch $@
	@echo "==> installed; the next make test-mindspore skips this"
