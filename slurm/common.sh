# shellcheck shell=bash
# Shared body of slurm/stage{1_8k,2_16k,3_32k}.sh: one stage of the recipe in one Slurm job.
#
# What a job does
#   1. resolves the checkout, the config, the run directory and which stage to run, the config
#      validated with the trainer's overrides (megatron_rl/tools/job_config.py: a bad key or value is
#      one line, `megatron-rl: ...`, exit 2, before any srun);
#   2. splits the allocation: trainer nodes (all, or all but ROLLOUT_NODES when the rollout engines
#      get dedicated nodes); MASTER_ADDR = first trainer host of `scontrol show hostnames`;
#   3. `srun` one task per trainer node (optionally inside a pyxis container); each task runs
#      slurm/node_launch.sh, which starts `torchrun -m megatron_rl.cli train` (c10d rendezvous on
#      MASTER_ADDR:MASTER_PORT, so no per-node rank is needed) or, with LAUNCHER=direct, one
#      `python -m megatron_rl.cli train` process (world size 1: the CPU miniature);
#   4. traps USR1 (sent by Slurm `--signal=B:USR1@N` before the time limit, or by
#      `scancel --signal=USR1 --batch JOB`) and TERM (preemption) and has node_launch.sh send USR1
#      to the trainer processes, which finish the current step, checkpoint and exit 99; if a new
#      checkpoint of the stage was written, the job runs `scontrol requeue $SLURM_JOB_ID`, and the
#      requeued job resumes from that checkpoint.
#
# Settings (environment; all optional; each checked for its type before any is used: mrl_check_env,
# slurm/env_checks.sh; one that cannot work is one line, `megatron-rl: NAME ...`, exit 2):
#   CONFIG            recipe config (default: the stage script's; relative paths: to the checkout)
#   STAGE             stage name to run (default: the STAGE_INDEX-th entry of the config's stages)
#   RUN_DIR           run directory shared by the stages (default: the config's trainer.run_dir,
#                     relative to the checkout; a relative RUN_DIR is relative to where sbatch ran)
#   MODEL_PATH        Hugging Face checkpoint of the base model (sets model.path)
#   INIT_FROM         start the first stage from this checkpoint (sets trainer.init_from)
#   OVERRIDES         more `key.sub=value` config overrides, space separated
#   LAUNCHER          torchrun (default) | direct (one process per node, no torchrun)
#   NPROC_PER_NODE    trainer processes per node (default: GPUs per node of the job, else 1)
#   MASTER_PORT       rendezvous port (default: 20000 + job id mod 20000)
#   VENV              virtualenv to activate on every node (default: none; the caller's PATH)
#   CONTAINER         pyxis/enroot image for `srun --container-image` (default: none)
#   CONTAINER_MOUNTS  `--container-mounts` (default: the checkout and the run dir's parent)
#   ROLLOUT_PLACEMENT colocated (default: each trainer node runs the engines for its own GPUs, started
#                     by node_launch.sh when the config uses rollout.engine=vllm_server) | dedicated
#                     (vLLM servers on the engine hosts, as their own srun step; the trainer finds them
#                     in RUN_DIR/engines and sends weights through vLLM's RL routes)
#   ROLLOUT_NODES     engine hosts when dedicated: the last N nodes of the job (default 1)
#   ROLLOUT_HOSTS     engine hosts when dedicated, by name (instead of ROLLOUT_NODES)
#   MAX_REQUEUES      stop requeueing after this many restarts (default 50)
#   MEGATRON_RL_HOME  the checkout (default: the one this file is in)
#   DRY_RUN=1         print the srun command instead of running it (no Slurm needed)

mrl_log() { echo "[megatron-rl $(date +%H:%M:%S)] $*" >&2; }

# shellcheck source=slurm/env_checks.sh
source "$(dirname "${BASH_SOURCE[0]}")/env_checks.sh"

mrl_check_env() {  # every variable this file reads, checked for its type before any is used
  mrl_need_int STAGE_INDEX 1 3
  mrl_need_dir MEGATRON_RL_HOME "checkout directory"
  mrl_need_int NPROC_PER_NODE 1
  mrl_need_int MASTER_PORT 1 65535
  mrl_need_venv
  mrl_need_choice LAUNCHER torchrun direct
  mrl_need_choice ROLLOUT_PLACEMENT colocated dedicated
  mrl_need_int ROLLOUT_NODES 1
  mrl_need_words ROLLOUT_HOSTS
  mrl_need_int MAX_REQUEUES 0
  mrl_need_choice DRY_RUN 0 1
  mrl_need_int SLURM_JOB_ID 0
  mrl_need_int SLURM_RESTART_COUNT 0
  mrl_need_int SLURM_GPUS_ON_NODE 0
  mrl_need_int SLURM_CPUS_ON_NODE 1
  mrl_need_words MASTER_ADDR
  mrl_need_dir_path RUN_DIR
  local name
  for name in MODEL_PATH INIT_FROM; do  # (a relative path is the trainer's to find, from the checkout)
    case "${!name:-}" in /*) mrl_need_dir "$name" "directory" ;; esac
  done
  if [ -n "${CONTAINER_MOUNTS:-}" ] && ! [[ ",$CONTAINER_MOUNTS" =~ ^(,[^,:]+:[^,]+)+$ ]]; then
    _mrl_refuse "CONTAINER_MOUNTS must be src:dst[,src:dst...], got '$CONTAINER_MOUNTS'"
  fi
  mrl_env_ok
}

mrl_home() {  # the checkout this file belongs to (the stage scripts source it from there)
  if [ -n "${MEGATRON_RL_HOME:-}" ]; then echo "$MEGATRON_RL_HOME"; return; fi
  (cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
}

mrl_abs() {  # mrl_abs PATH BASE: PATH made absolute against BASE
  case "$1" in /*) echo "$1" ;; *) echo "$2/$1" ;; esac
}

mrl_python() {  # a Python that can import megatron_rl (the venv's when VENV is set)
  if [ -n "${VENV:-}" ]; then echo "$VENV/bin/python"; else command -v python || command -v python3; fi
}

mrl_fail() {  # an input the job cannot use: one line, as every megatron-rl entry point (exit 2)
  echo "megatron-rl: $*" >&2; return 2
}

mrl_job_config() {  # mrl_job_config CONFIG [--world-size N --world-from TEXT] [OVERRIDE ...]:
  # "<stage>\n<trainer.run_dir>\n<rollout.engine>", the config validated with the overrides the trainer
  # gets and against its number of processes (a bad key or layout: one line, exit 2)
  local config="$1"; shift
  local which=(--index "$STAGE_INDEX")
  [ -n "${STAGE:-}" ] && which=(--stage "$STAGE")
  local dedicated=()
  [ "${ROLLOUT_PLACEMENT:-colocated}" = dedicated ] && dedicated=(--dedicated)
  local py errors out rc=0
  py="$(mrl_python)"
  [ -n "$py" ] || { mrl_fail "no python on PATH: set VENV to megatron-rl's virtualenv"; return 2; }
  errors="$(mktemp)"
  out="$(PYTHONPATH="$(mrl_home)${PYTHONPATH:+:$PYTHONPATH}" \
    "$py" -m megatron_rl.tools.job_config --config "$config" "${which[@]}" "${dedicated[@]}" "$@" 2>"$errors")" || rc=$?
  if [ "$rc" = 0 ]; then
    echo "$out"
  elif [ "$rc" = 2 ]; then  # its one line
    cat "$errors" >&2
  else  # not a python that can run megatron-rl (a missing dependency): one line, not its traceback
    mrl_fail "$py cannot run megatron_rl.tools.job_config (set VENV to megatron-rl's virtualenv): $(tail -n 1 "$errors")"
  fi
  rm -f "$errors"
  [ "$rc" = 0 ] || return 2
}

mrl_stage_finished() {  # mrl_stage_finished RUN_DIR STAGE: RUN_DIR/run_state.json lists STAGE as finished
  python3 - "$1/run_state.json" "$2" <<'EOF_PY' 2>/dev/null
import json, sys
try:
    finished = json.load(open(sys.argv[1])).get("finished_stages", [])
except OSError:
    sys.exit(1)
sys.exit(0 if sys.argv[2] in finished else 1)
EOF_PY
}

mrl_main() {
  : "${STAGE_INDEX:?the stage script sets STAGE_INDEX}" "${DEFAULT_CONFIG:?the stage script sets DEFAULT_CONFIG}"
  mrl_check_env || return 2
  local home submit config run_dir stage
  home="$(mrl_home)"
  submit="${SLURM_SUBMIT_DIR:-$PWD}"
  config="$(mrl_abs "${CONFIG:-$DEFAULT_CONFIG}" "$home")"
  [ -f "$config" ] || { mrl_fail "CONFIG not found: $config"; return 2; }
  local user_overrides=()
  [ -n "${MODEL_PATH:-}" ] && user_overrides+=("model.path=$MODEL_PATH")
  [ -n "${INIT_FROM:-}" ] && user_overrides+=("trainer.init_from=$INIT_FROM")
  # shellcheck disable=SC2206  # OVERRIDES is a space-separated list by design
  [ -n "${OVERRIDES:-}" ] && user_overrides+=(${OVERRIDES})

  # --- nodes: trainer hosts and (optionally) dedicated rollout hosts -----------------------------
  local hosts=() train_hosts rollout_hosts=() n_rollout=0 split_error=""
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  else
    hosts=("$(hostname -s)")
  fi
  # Engine hosts: ROLLOUT_HOSTS (explicit; when they are all the job's nodes they are shared with the
  # trainer, which is how the one-node test cluster emulates dedicated engine nodes), or the last
  # ROLLOUT_NODES hosts of the allocation.
  case "${ROLLOUT_PLACEMENT:-colocated}" in
    colocated) ;;
    dedicated)
      if [ -n "${ROLLOUT_HOSTS:-}" ]; then
        IFS=', ' read -r -a rollout_hosts <<<"$ROLLOUT_HOSTS"
        n_rollout="${#rollout_hosts[@]}"
      else
        n_rollout="${ROLLOUT_NODES:-1}"
        if [ "$n_rollout" -ge "${#hosts[@]}" ]; then  # (said after the config's own check)
          split_error="ROLLOUT_NODES=$n_rollout leaves no trainer node out of ${#hosts[@]}"; n_rollout=0
        else
          rollout_hosts=("${hosts[@]:$(( ${#hosts[@]} - n_rollout ))}")
        fi
      fi ;;
    *) mrl_fail "ROLLOUT_PLACEMENT must be colocated or dedicated, got '$ROLLOUT_PLACEMENT'"; return 2 ;;
  esac
  local h r keep
  train_hosts=()
  for h in "${hosts[@]}"; do
    keep=1
    for r in "${rollout_hosts[@]}"; do [ "$h" = "$r" ] && keep=0; done
    [ "$keep" = 1 ] && train_hosts+=("$h")
  done
  if [ "${#train_hosts[@]}" -eq 0 ]; then
    train_hosts=("${hosts[@]}")
    mrl_log "the engine hosts (${rollout_hosts[*]}) are all the job's nodes: the trainer shares them"
  fi
  local n_train="${#train_hosts[@]}"
  export MASTER_ADDR="${MASTER_ADDR:-${train_hosts[0]}}"
  export MASTER_PORT="${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-0} % 20000 ))}"
  local nproc="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}"
  [ "${LAUNCHER:-torchrun}" = direct ] && nproc=1
  [ "$nproc" -ge 1 ] || nproc=1

  # --- the config, validated with the trainer's overrides and its number of processes ---------------
  local from_config config_run_dir engine world=()
  # (the number of trainer processes is known in a job, or when NPROC_PER_NODE says it; a dry run
  # outside Slurm guesses one node)
  if [ -z "$split_error" ] && { [ -n "${SLURM_JOB_NODELIST:-}" ] || [ -n "${NPROC_PER_NODE:-}" ] ||
                                 [ "${LAUNCHER:-torchrun}" = direct ]; }; then
    world=(--world-size "$(( n_train * nproc ))" --world-from "$n_train trainer node(s) x $nproc process(es) per node")
  fi
  from_config="$(mrl_job_config "$config" "${world[@]}" "${user_overrides[@]}")" || return 2
  { read -r stage; read -r config_run_dir; read -r engine; } <<<"$from_config"
  [ -z "$split_error" ] || { mrl_fail "$split_error"; return 2; }
  if [ -n "${RUN_DIR:-}" ]; then run_dir="$(mrl_abs "$RUN_DIR" "$submit")"
  else run_dir="$(mrl_abs "$config_run_dir" "$home")"; fi
  if [ "${DRY_RUN:-0}" != 1 ] && ! mkdir -p "$run_dir" 2>/dev/null; then
    mrl_fail "cannot create the run directory $run_dir (RUN_DIR, else the config's trainer.run_dir)"; return 2
  fi

  # --- the trainer command ------------------------------------------------------------------------
  local common_args=(--config "$config" --run-dir "$run_dir")
  [ -n "${MODEL_PATH:-}" ] && common_args+=("model.path=$MODEL_PATH")
  [ -n "${INIT_FROM:-}" ] && common_args+=("trainer.init_from=$INIT_FROM")
  # Rollout engines: vLLM servers started per node (colocated: by slurm/node_launch.sh before the
  # trainer; dedicated: as their own srun step on the engine hosts), found by the trainer in the
  # run directory's engine registry; weights through vLLM's RL routes from MASTER_ADDR.
  if [ "$n_rollout" -gt 0 ]; then
    engine=vllm_server
    common_args+=("rollout.engine=vllm_server" "rollout.placement=dedicated" "rollout.num_engines=0"
                  "rollout.hosts=[$(IFS=,; echo "${rollout_hosts[*]}")]" "sync.master_addr=$MASTER_ADDR")
  elif [ "$engine" = vllm_server ]; then
    common_args+=("rollout.placement=colocated" "sync.master_addr=$MASTER_ADDR")
  fi
  # shellcheck disable=SC2206  # OVERRIDES is a space-separated list by design
  [ -n "${OVERRIDES:-}" ] && common_args+=(${OVERRIDES})
  local train_args=(train --stage "$stage" "${common_args[@]}")
  if [ "$engine" = vllm_server ]; then
    # what node_launch.sh runs as `python -m megatron_rl.cli engines ...` on an engine node
    MRL_ENGINE_ARGS="$(printf '%q ' engines "${common_args[@]}")"
    export MRL_ENGINE_ARGS
  fi
  local node_cmd
  case "${LAUNCHER:-torchrun}" in
    torchrun)
      node_cmd=(torchrun --nnodes="$n_train" --nproc-per-node="$nproc"
                --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
                --rdzv-id="mrl-${SLURM_JOB_ID:-local}-${SLURM_RESTART_COUNT:-0}"
                --max-restarts=0 -m megatron_rl.cli "${train_args[@]}") ;;
    direct)
      if [ "$n_train" -ne 1 ]; then mrl_fail "LAUNCHER=direct runs one process: use one node"; return 2; fi
      node_cmd=(python -m megatron_rl.cli "${train_args[@]}") ;;
    *) mrl_fail "LAUNCHER must be torchrun or direct, got '$LAUNCHER'"; return 2 ;;
  esac

  # One task per node that gets all the CPUs the job holds there (torchrun and its workers share them).
  local srun_cmd=(srun --nodes="$n_train" --ntasks="$n_train" --ntasks-per-node=1 --kill-on-bad-exit=1)
  [ -n "${SLURM_CPUS_ON_NODE:-}" ] && srun_cmd+=(--cpus-per-task="$SLURM_CPUS_ON_NODE")
  [ -n "${SLURM_JOB_ID:-}" ] && srun_cmd+=(--nodelist="$(IFS=,; echo "${train_hosts[*]}")")
  local container=()
  if [ -n "${CONTAINER:-}" ]; then
    container=(--container-image="$CONTAINER"
               --container-mounts="${CONTAINER_MOUNTS:-$home:$home,$(dirname "$run_dir"):$(dirname "$run_dir")}"
               --container-workdir="$home")
  fi
  srun_cmd+=("${container[@]}")
  local full=("${srun_cmd[@]}" bash "$home/slurm/node_launch.sh" "${node_cmd[@]}")
  # Dedicated engines: one task per engine host, sharing the CPUs of a node the trainer also uses.
  local engine_cmd=()
  if [ "$n_rollout" -gt 0 ]; then
    engine_cmd=(srun --nodes="$n_rollout" --ntasks="$n_rollout" --ntasks-per-node=1 --overlap)
    [ -n "${SLURM_JOB_ID:-}" ] && engine_cmd+=(--nodelist="$(IFS=,; echo "${rollout_hosts[*]}")")
    engine_cmd+=("${container[@]}")
    engine_cmd+=(bash "$home/slurm/node_launch.sh" --engines)
  fi

  mrl_log "job ${SLURM_JOB_ID:-none} (restart ${SLURM_RESTART_COUNT:-0}): stage '$stage' of $config"
  mrl_log "run dir $run_dir; trainer nodes ${train_hosts[*]} x $nproc; rollout: ${ROLLOUT_PLACEMENT:-colocated} ${rollout_hosts[*]}"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    [ "${#engine_cmd[@]}" -gt 0 ] && { printf '%q ' "${engine_cmd[@]}"; echo; }
    printf '%q ' "${full[@]}"; echo; return 0
  fi
  export VENV="${VENV:-}" LAUNCHER="${LAUNCHER:-torchrun}"
  cd "$home" || return 2

  # --- run; on USR1/TERM ask the trainer to checkpoint; requeue once it has --------------------------
  # The request travels as a file in the run directory (shared by the nodes), which every
  # node_launch.sh watches: forwarding the signal through srun would signal every process of the
  # step, killing the trainer's helpers (vLLM, checkpoint writer, reward workers) mid-checkpoint.
  export MRL_STOP_FILE="$run_dir/.stop-${SLURM_JOB_ID:-$$}"
  local started="$run_dir/.started-${SLURM_JOB_ID:-$$}"
  rm -f "$MRL_STOP_FILE"; touch "$started"
  local child rc interrupted=0
  _mrl_stop() {
    interrupted=1
    mrl_log "got $1: asking the trainer to checkpoint and exit"
    touch "$MRL_STOP_FILE"
  }
  trap '_mrl_stop USR1' USR1
  trap '_mrl_stop TERM' TERM
  local engines=""
  if [ "${#engine_cmd[@]}" -gt 0 ]; then
    "${engine_cmd[@]}" &
    engines=$!
    mrl_log "engine step on ${rollout_hosts[*]} (srun pid $engines)"
  fi
  "${full[@]}" &
  child=$!
  while :; do
    interrupted=0
    wait "$child"; rc=$?
    [ "$interrupted" = 1 ] || break   # a trapped signal interrupted the wait: wait again
  done
  trap - USR1 TERM
  mrl_log "trainer exited with $rc"
  if [ -n "$engines" ]; then  # srun forwards TERM to the engine launchers, which stop their servers
    kill -TERM "$engines" 2>/dev/null
    wait "$engines" 2>/dev/null
    mrl_log "engine step stopped"
  fi
  local new_ckpt
  new_ckpt="$(find "$run_dir/$stage/checkpoints" -name trainer_state.json -newer "$started" 2>/dev/null | head -n 1)"
  rm -f "$MRL_STOP_FILE" "$started"
  [ "$rc" = 99 ] || return "$rc"
  if mrl_stage_finished "$run_dir" "$stage"; then
    mrl_log "stage '$stage' finished (the stop came during its last step)"; return 0
  fi
  if [ -z "$new_ckpt" ]; then
    mrl_log "exit 99 but no new checkpoint of stage '$stage' was written: not requeueing"; return 1
  fi
  if [ -z "${SLURM_JOB_ID:-}" ]; then return 99; fi
  if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MAX_REQUEUES:-50}" ]; then
    mrl_log "checkpointed, but already requeued ${SLURM_RESTART_COUNT} times (MAX_REQUEUES): not requeueing"
    return 99
  fi
  mrl_log "checkpointed ($(dirname "$new_ckpt")): requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  sleep 60 & wait $!   # Slurm ends this incarnation of the job now
  return 99
}
