#!/usr/bin/env bash
# One task per trainer node (started through srun by slurm/common.sh or the NeMo-Run launcher):
# runs this node's trainer processes, given as arguments (a torchrun command, or with
# LAUNCHER=direct one python process), and asks them to checkpoint and exit when the job must stop.
# With MRL_ENGINE_ARGS set (`megatron-rl engines` arguments; slurm/common.sh sets them when the run
# uses vLLM servers) it first starts this node's rollout engines, in their own session, and stops
# them after the trainer exits (colocated placement). `node_launch.sh --engines` runs only the
# engines, until TERM: a dedicated engine node's task.
#
# A stop is requested by any of:
#   - USR1 or TERM to this script;
#   - the file $MRL_STOP_FILE appearing (the batch script creates it from its USR1 trap; a file on
#     the shared run directory reaches every node, and, unlike srun's signal forwarding, which
#     signals every process of the step, it does not kill the trainer's helper processes: vLLM,
#     the checkpoint writer, the reward pool);
#   - less than $MRL_STOP_BEFORE_END_S seconds left before the job's time limit (read from squeue;
#     the NeMo-Run launcher uses this instead of Slurm's --signal).
# It then sends USR1 to each trainer process once that process has its USR1 handler installed
# (checked every RESEND_SECONDS, default 1, so workers still starting get it too). Not to torchrun:
# torchrun would die on USR1, and on TERM give its workers only 30 s before killing them. The
# command starts with USR1 ignored (torchrun keeps that; the trainer installs its own handler).
#
# Exit code: the command's. The trainer exits 99 after checkpointing on a stop ("requeue me");
# torchrun reports any worker failure as 1, so with torchrun a non-zero exit after a stop request
# is reported as 99 (the batch script requeues only if a new checkpoint was really written).
set -uo pipefail
# shellcheck source=slurm/env_checks.sh
source "$(dirname "${BASH_SOURCE[0]}")/env_checks.sh" || exit 2
[ "$#" -gt 0 ] || { echo "megatron-rl: node_launch.sh: usage: node_launch.sh COMMAND... | node_launch.sh --engines" >&2; exit 2; }
# Every variable this script reads, checked before any is used (one line, exit 2).
mrl_need_venv
mrl_need_dir MEGATRON_RL_HOME "checkout directory"
mrl_need_choice LAUNCHER torchrun direct
mrl_need_int MRL_STOP_BEFORE_END_S 0
mrl_need_number RESEND_SECONDS
mrl_need_int SLURM_JOB_ID 0
mrl_need_words MRL_NODE_NAME
if [ -n "${MRL_STOP_FILE:-}" ] && [ ! -d "$(dirname "$MRL_STOP_FILE")" ]; then
  _mrl_refuse "MRL_STOP_FILE: its directory does not exist: $MRL_STOP_FILE"
fi
if [ -n "${MRL_ENGINE_ARGS:-}" ] && ! (eval "_words=($MRL_ENGINE_ARGS)") 2>/dev/null; then
  _mrl_refuse "MRL_ENGINE_ARGS is not a list of shell words: $MRL_ENGINE_ARGS"
fi
mrl_env_ok || exit 2
if [ -n "${VENV:-}" ]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate" || { echo "megatron-rl: VENV: $VENV/bin/activate failed" >&2; exit 2; }
fi
if [ -n "${MEGATRON_RL_HOME:-}" ]; then cd "$MEGATRON_RL_HOME" || exit 2; fi

log() { echo "[node_launch ${MRL_NODE_NAME:-$(hostname -s)} $(date +%H:%M:%S)] $*" >&2; }

# Engines and trainer agree on the node's name: Slurm's, when there is one.
if [ -z "${MRL_NODE_NAME:-}" ] && [ -n "${SLURMD_NODENAME:-}" ]; then export MRL_NODE_NAME="$SLURMD_NODENAME"; fi
engine_cmd=()
if [ -n "${MRL_ENGINE_ARGS:-}" ]; then
  eval "engine_cmd=(python -m megatron_rl.cli $MRL_ENGINE_ARGS)"
fi
if [ "$1" = "--engines" ]; then  # a dedicated engine node: only this node's vLLM servers, until TERM
  [ "${#engine_cmd[@]}" -gt 0 ] || { echo "megatron-rl: node_launch.sh: --engines needs MRL_ENGINE_ARGS" >&2; exit 2; }
  log "starting this node's rollout engines"
  exec "${engine_cmd[@]}"
fi

child=""
requested=0
interrupted=0
helpers=()

trainer_pids() {  # torchrun's children, or the one direct process
  if [ "${LAUNCHER:-torchrun}" = torchrun ]; then
    ps -o pid= --ppid "$child" | tr '\n' ' '
  else
    echo "$child"
  fi
}

catches_usr1() {  # catches_usr1 PID: the process has a USR1 handler installed (SigCgt bit 10)
  local mask
  mask="$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null)"
  [ -n "$mask" ] && (( (16#$mask >> 9) & 1 ))
}

request_stop() {
  interrupted=1
  [ "$requested" = 0 ] || return 0
  requested=1
  log "$1: asking the trainer processes to checkpoint and exit"
  (
    # Each trainer process gets exactly one USR1, once it has its handler installed: one that is
    # still starting (not spawned yet, or USR1 still ignored) gets it later; a second USR1 could
    # land while Python shuts down, after its handlers are reset, and kill it.
    declare -A sent=()
    while kill -0 "$child" 2>/dev/null; do
      for pid in $(trainer_pids); do
        if [ -z "${sent[$pid]:-}" ] && catches_usr1 "$pid"; then
          kill -USR1 "$pid" 2>/dev/null && sent[$pid]=1
        fi
      done
      sleep "${RESEND_SECONDS:-1}"
    done
  ) &
  helpers+=($!)
}
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM

seconds_left() {  # of the job's time limit, from squeue's %L ([D-]HH:MM:SS, MM:SS, UNLIMITED)
  local left d=0 h=0 m=0 s=0
  left="$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n 1)"
  [[ "$left" =~ ^[0-9:-]+$ ]] || return 1
  if [[ "$left" == *-* ]]; then d="${left%%-*}"; left="${left#*-}"; fi
  IFS=: read -r -a parts <<<"$left"
  case "${#parts[@]}" in
    3) h="${parts[0]}"; m="${parts[1]}"; s="${parts[2]}" ;;
    2) m="${parts[0]}"; s="${parts[1]}" ;;
    1) s="${parts[0]}" ;;
  esac
  echo $(( 10#$d * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$s ))
}

watch_for_stop() {  # in the background: turn the stop file / the time limit into USR1 to this script
  local me="$1" next_time_check=0 left
  while kill -0 "$me" 2>/dev/null; do
    if [ -n "${MRL_STOP_FILE:-}" ] && [ -e "$MRL_STOP_FILE" ]; then
      kill -USR1 "$me"; return
    fi
    if [ -n "${MRL_STOP_BEFORE_END_S:-}" ] && [ -n "${SLURM_JOB_ID:-}" ] && [ "$SECONDS" -ge "$next_time_check" ]; then
      next_time_check=$((SECONDS + 30))
      if left="$(seconds_left)" && [ "$left" -le "$MRL_STOP_BEFORE_END_S" ]; then
        kill -USR1 "$me"; return
      fi
    fi
    sleep 1
  done
}

# Colocated engines (the config's rollout.engine is vllm_server): this node's vLLM servers start first,
# in their own session, and stop when the trainer has exited; the trainer finds them registered.
engines=""
if [ "${#engine_cmd[@]}" -gt 0 ]; then
  setsid "${engine_cmd[@]}" &
  engines=$!
  export MRL_ENGINES_LAUNCHED=1
  log "started this node's rollout engines (pid $engines)"
fi
stop_engines() {
  [ -n "$engines" ] || return 0
  kill -TERM -- "-$engines" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$engines" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$engines" 2>/dev/null
  wait "$engines" 2>/dev/null
  engines=""
}

(trap '' USR1; exec "$@") &
child=$!
watch_for_stop $$ &
helpers+=($!)
while :; do
  interrupted=0
  wait "$child"; rc=$?
  [ "$interrupted" = 1 ] || break   # a trapped signal interrupted the wait: wait again
done
for pid in "${helpers[@]}"; do kill "$pid" 2>/dev/null; done
stop_engines
if [ "$requested" = 1 ] && [ "$rc" != 0 ] && [ "${LAUNCHER:-torchrun}" = torchrun ]; then
  rc=99
fi
log "trainer exited with $rc"
exit "$rc"
