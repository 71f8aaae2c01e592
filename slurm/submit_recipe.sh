#!/usr/bin/env bash
# Submit the whole Skywork-OR1 recipe: stage 1 (8k), stage 2 (16k), stage 3 (32k), each a job that
# starts only after the previous one completed successfully (--dependency=afterok). All stages
# share one run directory; each finds the previous stage's final checkpoint there.
#
#   slurm/submit_recipe.sh                       # 7B, 4 nodes x 8 GPUs
#   SIZE=32b NODES=8 slurm/submit_recipe.sh      # 32B
#   SIZE=30b_a3b NODES=4 slurm/submit_recipe.sh  # Qwen3-30B-A3B (Mixture-of-Experts, EP 8)
#   FIRST_STAGE=2 slurm/submit_recipe.sh         # stage 1 already done
#   AFTER=12345 slurm/submit_recipe.sh           # the first job waits for job 12345 too
#
# Settings (environment): SIZE (7b|32b|30b_a3b, default 7b), CONFIG_DIR (default configs/skywork_or1/$SIZE),
# RUN_DIR (default runs/skywork_or1_$SIZE), NODES, GPUS_PER_NODE, TIME, PARTITION, ACCOUNT,
# EXCLUSIVE (1: --exclusive, default 1), SBATCH_EXTRA (more sbatch flags), FIRST_STAGE, LAST_STAGE,
# AFTER; everything slurm/common.sh reads (CONTAINER, VENV, ROLLOUT_PLACEMENT, ...) passes through.
# Prints one job id per line.
set -euo pipefail
home="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=slurm/env_checks.sh
source "$home/slurm/env_checks.sh"
# Every variable this script reads, checked before any is used (one line, exit 2); the jobs check theirs.
mrl_need_choice SIZE 7b 32b 30b_a3b || true
mrl_need_dir CONFIG_DIR "config directory" || true
mrl_need_int NODES 1 || true
mrl_need_int GPUS_PER_NODE 1 || true
mrl_need_choice EXCLUSIVE 0 1 || true
mrl_need_int FIRST_STAGE 1 3 || true
mrl_need_int LAST_STAGE 1 3 || true
mrl_need_venv || true
mrl_need_choice ROLLOUT_PLACEMENT colocated dedicated || true
for name in MODEL_PATH INIT_FROM; do  # (a relative path is the trainer's to find, from the checkout)
  case "${!name:-}" in /*) mrl_need_dir "$name" "directory" || true ;; esac
done
mrl_need_dir_path RUN_DIR || true
if [ -n "${TIME:-}" ] && ! [[ "$TIME" =~ ^([0-9]+(-[0-9]+)?(:[0-9]+){0,2}|UNLIMITED|unlimited|INFINITE|infinite)$ ]]; then
  _mrl_refuse "TIME must be a Slurm time limit (minutes, [D-]HH:MM:SS, ...), got '$TIME'"
fi
if [ -n "${AFTER:-}" ] && ! [[ "$AFTER" =~ ^[0-9]+(:[0-9]+)*$ ]]; then
  _mrl_refuse "AFTER must be Slurm job ids (123 or 123:456), got '$AFTER'"
fi
if [ "${FIRST_STAGE:-1}" -gt "${LAST_STAGE:-3}" ] 2>/dev/null; then
  _mrl_refuse "FIRST_STAGE (${FIRST_STAGE:-1}) is after LAST_STAGE (${LAST_STAGE:-3}): nothing to submit"
fi
mrl_env_ok || exit 2
size="${SIZE:-7b}"
config_dir="${CONFIG_DIR:-configs/skywork_or1/$size}"
case "$config_dir" in /*) ;; *) config_dir="$home/$config_dir" ;; esac
run_dir="${RUN_DIR:-runs/skywork_or1_$size}"
case "$run_dir" in /*) ;; *) run_dir="$PWD/$run_dir" ;; esac
scripts=("" stage1_8k.sh stage2_16k.sh stage3_32k.sh)

flags=()
[ -n "${NODES:-}" ] && flags+=(--nodes="$NODES")
[ -n "${GPUS_PER_NODE:-}" ] && flags+=(--gpus-per-node="$GPUS_PER_NODE")
[ -n "${TIME:-}" ] && flags+=(--time="$TIME")
[ -n "${PARTITION:-}" ] && flags+=(--partition="$PARTITION")
[ -n "${ACCOUNT:-}" ] && flags+=(--account="$ACCOUNT")
[ "${EXCLUSIVE:-1}" = 1 ] && flags+=(--exclusive)
# shellcheck disable=SC2206  # SBATCH_EXTRA is a space-separated flag list by design
[ -n "${SBATCH_EXTRA:-}" ] && flags+=(${SBATCH_EXTRA})

# Every stage's config is validated with the overrides its job will get before the first sbatch: a bad
# key or value is one line, `megatron-rl: ...`, exit 2, and nothing is submitted.
py="${VENV:+$VENV/bin/python}"
py="${py:-$(command -v python || command -v python3)}"
user_overrides=()
[ -n "${MODEL_PATH:-}" ] && user_overrides+=("model.path=$MODEL_PATH")
[ -n "${INIT_FROM:-}" ] && user_overrides+=("trainer.init_from=$INIT_FROM")
# shellcheck disable=SC2206  # OVERRIDES is a space-separated list by design
[ -n "${OVERRIDES:-}" ] && user_overrides+=(${OVERRIDES})
dedicated=()
[ "${ROLLOUT_PLACEMENT:-colocated}" = dedicated ] && dedicated=(--dedicated)
checks=()
for ((i = ${FIRST_STAGE:-1}; i <= ${LAST_STAGE:-3}; i++)); do
  config="$config_dir/stage$i.yaml"
  [ -f "$config" ] || { echo "megatron-rl: submit_recipe: no config $config" >&2; exit 2; }
  checks+=(--config "$config" --index "$i")
done
# Without a Python that has megatron-rl's dependencies here (set VENV) the jobs check their configs
# themselves, each before its srun.
check_rc=0
check_err="$(PYTHONPATH="$home${PYTHONPATH:+:$PYTHONPATH}" "$py" -m megatron_rl.tools.job_config "${checks[@]}" \
  "${dedicated[@]}" "${user_overrides[@]}" 2>&1 >/dev/null)" || check_rc=$?
if [ "$check_rc" = 2 ]; then echo "$check_err" >&2; exit 2; fi
if [ "$check_rc" != 0 ]; then
  echo "[submit_recipe] configs not checked before sbatch ($py cannot run megatron_rl.tools.job_config:" \
       "${check_err##*$'\n'}; set VENV); each job checks its own" >&2
fi

dep="${AFTER:-}"
for ((i = ${FIRST_STAGE:-1}; i <= ${LAST_STAGE:-3}; i++)); do
  config="$config_dir/stage$i.yaml"
  job_flags=("${flags[@]}" --parsable --export="ALL,CONFIG=$config,RUN_DIR=$run_dir,MEGATRON_RL_HOME=$home")
  [ -n "$dep" ] && job_flags+=(--dependency="afterok:$dep" --kill-on-invalid-dep=yes)
  dep="$(sbatch "${job_flags[@]}" "$home/slurm/${scripts[$i]}")"
  dep="${dep%%;*}"
  echo "$dep"
done
