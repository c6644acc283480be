# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODELS := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct smollm2-135m-instruct

.PHONY: setup kernels models chromium test lint demo bench clean

setup: $(VENV)/.installed kernels

# torch is pinned and installed first: 2.13.0 comes from a local CPU wheel; a looser spec pulls a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench,replicas]'
	touch $@

# The int4/int8 CPU kernels (C++: AVX-512 BF16, or AVX2 for 8-bit activations) compile once into
# $VERISPEC_HOME/kernels; this prints what the quantized layers will use. A failed build only means
# PyTorch's stock kernels.
kernels: $(VENV)/.installed
	-$(PY) -m verispec.kernels

models: setup
	$(VENV)/bin/verispec models install $(MODELS)

# ruff, then the layering contract of pyproject.toml's [tool.importlinter].
lint: setup
	$(VENV)/bin/ruff check verispec tests bench
	$(VENV)/bin/lint-imports

# The server's dashboard test drives Debian's Chromium (Playwright never downloads a browser here).
chromium:
	@test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

test: models lint chromium
	$(PY) -m pytest -q -p no:cacheprovider tests

demo: models
	$(VENV)/bin/verispec demo --out demo_out

# Every benchmark behind the published figures (an hour or more on a CPU); STEPS picks some of them.
bench: models
	STEPS="$(STEPS)" ./bench/run_all.sh $(BENCH_OUT)

clean:
	rm -rf $(VENV) demo_out bench_out
