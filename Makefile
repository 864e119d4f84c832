# Set-up from nothing: `make demo` and `make test` create .venv and install into it.
# A torch that is already importable is kept (pinned by a constraint); otherwise torch==2.13.0 is installed,
# never an unpinned torch, which could pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.memtrace-installed
EXTRAS ?= test,examples,report

.PHONY: setup demo test test-gpu benchmark screenshot clean compat

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(VPY) ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "torch found in $(PYTHON): keeping it (venv with system site-packages)"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@if ! $(VPY) -c "import torch" >/dev/null 2>&1; then \
	  echo "installing torch==2.13.0"; \
	  $(VPY) -m pip install -q "torch==2.13.0"; \
	fi
	@# the installed distribution's version: PyPI's CUDA wheels say 2.13.0 there, and 2.13.0+cu130 in torch.__version__
	@$(VPY) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(VENV)/torch-constraint.txt
	@echo "using $$(cat $(VENV)/torch-constraint.txt)"
	$(VPY) -m pip install -q -c $(VENV)/torch-constraint.txt -e ".[$(EXTRAS)]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VPY) examples/train_tiny_lm.py

test: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider tests

test-gpu: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider tests/gpu

benchmark: $(STAMP)
	$(VPY) benchmarks/overhead.py
	$(VPY) benchmarks/overhead_breakdown.py
	$(VPY) benchmarks/overhead_floor.py

clean:
	rm -rf $(VENV) memtrace_demo build dist

# Headless Chromium screenshot of a report with the network off (may apt-get install chromium; not part of `make test`).
screenshot: $(STAMP)
	bash benchmarks/screenshot.sh

# One venv per torch / Lightning / transformers combination under $(COMPAT_DIR) (reused on reruns), the smoke subset
# (compat/test_smoke.py) in each against this checkout's src; table in $(COMPAT_DIR)/results.md. Not part of `make test`:
# it downloads several GB of CUDA torch wheels and takes as long as it takes. COMPAT_ARGS="--only 2.13" for a subset.
COMPAT_DIR ?= .compat
COMPAT_ARGS ?=
compat:
	COMPAT_DIR=$(COMPAT_DIR) $(PYTHON) compat/run.py $(COMPAT_ARGS)
