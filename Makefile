# Everything the project needs, installed by its own files.
#   make test     create .venv, install the package with test + serve extras (+ perf where it resolves, + gpu on a
#                 host with an NVIDIA GPU), fetch the default model, run the tests
#   make serve    create .venv, install, fetch SmolLM2, start tritonserver on the model repository
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# A CPU build of torch from local disk on these machines; a bare `torch` pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv install test serve model bench-cpu clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q "$(TORCH_SPEC)" "numpy<2"
	$(PIP) install -q -e ".[test,serve]"
	@# the perf extra resolves only where perf-analyzer's wheel runs (glibc >= 2.38, see pyproject.toml)
	@$(PIP) install -q -e ".[perf]" > $(VENV)/perf-extra.log 2>&1 || echo "note: perf_analyzer and genai-perf not \
	installed ($$(grep ERROR $(VENV)/perf-extra.log | tail -1)): perf-analyzer's wheel needs glibc >= 2.38, \
	this host has $$(getconf GNU_LIBC_VERSION); client_examples/perf_analyzer.sh says what to use instead"
	@# a host with an NVIDIA GPU gets the gpu extra (fla-core's chunked GDN prefill); never a CPU host, where an
	@# installed fla-core breaks transformers' GDN models that the tests compare against
	@if nvidia-smi -L > /dev/null 2>&1; then echo "NVIDIA GPU found: installing the gpu extra"; \
	$(PIP) install -q -e ".[gpu]"; fi
	touch $@

install: $(VENV)/.installed

model: install
	$(VENV)/bin/freetoken-core fetch-model

test: install
	$(VENV)/bin/freetoken-core fetch-model
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 $(PYTEST_ARGS)

serve: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/freetoken-core serve $(SERVE_ARGS)

bench-cpu: install
	$(PY) benchmarks/bench_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
