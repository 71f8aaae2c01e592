#!/usr/bin/env bash
# One task per trainer node (started by slurm/common.sh through srun): runs this node's trainer
# processes, given as arguments (a torchrun command, or one python process with LAUNCHER=direct).
#
# On USR1 or TERM it sends USR1 to the trainer processes themselves, not to torchrun: torchrun
# would either die on USR1 or, on TERM, give its workers only 30 s before killing them, too little to
# finish a step and write a checkpoint. The trainer then exits 99 ("checkpointed, requeue me");
# torchrun turns any worker failure into exit 1, so after a forwarded signal a non-zero exit is
# reported as 99. The command starts with USR1 ignored, so that a step-wide USR1 (Slurm's
# `--signal=USR1@N` without `B:`, as the NeMo-Run launcher uses) cannot kill torchrun; the trainer
# installs its own handler, which replaces the inherited "ignore".
set -uo pipefail
if [ -n "${VENV:-}" ]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi
[ "$#" -gt 0 ] || { echo "usage: node_launch.sh COMMAND..." >&2; exit 2; }
if [ -n "${MEGATRON_RL_HOME:-}" ]; then cd "$MEGATRON_RL_HOME" || exit 2; fi

child=""
forwarded=0
interrupted=0
resender=""
send_usr1() {  # USR1 to the trainer processes: torchrun's children, or the one direct process
  local targets="$child"
  if [ "${LAUNCHER:-torchrun}" = torchrun ]; then
    targets="$(ps -o pid= --ppid "$child" | tr '\n' ' ')"
  fi
  # shellcheck disable=SC2086
  [ -n "${targets// /}" ] && kill -USR1 $targets 2>/dev/null
  return 0
}
forward() {
  interrupted=1
  [ "$forwarded" = 0 ] || return 0
  forwarded=1
  echo "[node_launch $(hostname -s)] $1: asking the trainer processes to checkpoint and exit" >&2
  # Repeat until the command ends: workers that are still starting (not spawned yet, or USR1 still
  # ignored before the trainer installs its handler) get it too. A repeat is harmless.
  ( while kill -0 "$child" 2>/dev/null; do send_usr1; sleep "${RESEND_SECONDS:-5}"; done ) &
  resender=$!
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

(trap '' USR1; exec "$@") &
child=$!
while :; do
  interrupted=0
  wait "$child"; rc=$?
  [ "$interrupted" = 1 ] || break
done
[ -n "$resender" ] && kill "$resender" 2>/dev/null
if [ "$forwarded" = 1 ] && [ "$rc" != 0 ]; then
  rc=99
fi
exit "$rc"
