#!/usr/bin/env bash
# Stage 2 of the Skywork-OR1 recipe: GRPO at 16384-token max response length. It starts from the
# previous stage's final checkpoint in RUN_DIR (or resumes its own newest one), checkpoints and
# requeues itself on USR1 (sent 900 s before the time limit) or preemption.
#
#   sbatch slurm/stage2_16k.sh                              # 7B defaults
#   CONFIG=configs/skywork_or1/32b/stage2.yaml sbatch --nodes=8 slurm/stage2_16k.sh
#
# Every setting can be overridden from the environment (see slurm/common.sh), every #SBATCH line
# from the sbatch command line. sbatch runs a copy of this file, so the checkout is found from
# the job record (or MEGATRON_RL_HOME).
#SBATCH --job-name=mrl-stage2-16k
#SBATCH --nodes=4
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=1
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@900
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -uo pipefail
STAGE_INDEX=2
DEFAULT_CONFIG=configs/skywork_or1/7b/stage2.yaml
here="${MEGATRON_RL_HOME:-}"
if [ -z "$here" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  here="$(scontrol show job "$SLURM_JOB_ID" | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | xargs dirname)/.."
fi
here="${here:-$(dirname "${BASH_SOURCE[0]}")/..}"
if [ ! -f "$here/slurm/common.sh" ]; then
  echo "megatron-rl: MEGATRON_RL_HOME: no megatron-rl checkout at '$here' (no slurm/common.sh in it)" >&2; exit 2
fi
# shellcheck source=slurm/common.sh
source "$here/slurm/common.sh"
mrl_main
