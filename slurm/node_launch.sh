#!/usr/bin/env bash
# One task per trainer node (started by slurm/common.sh through srun): runs this node's trainer
# processes, given as arguments (a torchrun command, or one python process with LAUNCHER=direct).
#
# On USR1 or TERM it sends USR1 to the trainer processes themselves, not to torchrun: torchrun
# would either die on USR1 or, on TERM, give its workers only 30 s before killing them, too little to
# finish a step and write a checkpoint. The trainer then exits 99 ("checkpointed, requeue me");
# torchrun turns any worker failure into exit 1, so after a forwarded signal a non-zero exit is
# reported as 99.
set -uo pipefail
if [ -n "${VENV:-}" ]; then
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi
[ "$#" -gt 0 ] || { echo "usage: node_launch.sh COMMAND..." >&2; exit 2; }

child=""
forwarded=0
interrupted=0
forward() {
  interrupted=1; forwarded=1
  [ -n "$child" ] || return 0
  local targets="$child"
  if [ "${LAUNCHER:-torchrun}" = torchrun ]; then
    targets="$(ps -o pid= --ppid "$child" | tr '\n' ' ')"
  fi
  echo "[node_launch $(hostname -s)] $1: USR1 -> ${targets:-nothing yet}" >&2
  # shellcheck disable=SC2086
  [ -n "${targets// /}" ] && kill -USR1 $targets 2>/dev/null || true
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

"$@" &
child=$!
while :; do
  interrupted=0
  wait "$child"; rc=$?
  [ "$interrupted" = 1 ] || break
done
if [ "$forwarded" = 1 ] && [ "$rc" != 0 ]; then
  rc=99
fi
exit "$rc"
