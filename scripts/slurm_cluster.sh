#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for the tests and the CPU demo of the recipe.
#
#   scripts/slurm_cluster.sh [start]   install (once), configure, start, wait until the node is idle
#   scripts/slurm_cluster.sh stop      cancel jobs, stop the daemons this script started
#   scripts/slurm_cluster.sh status    print sinfo/squeue, exit 0 iff the node is up
#
# Idempotent: a second `start` with an unchanged config only checks the node. Needs root (it runs
# apt-get and writes /etc/slurm). Debian's slurm 22.05 + munge, set up the way that works without
# systemd or cgroup v2 delegation: munged via runuser, proctrack/linuxproc,
# task/none, select/cons_tres + CR_Core_Memory with DefMemPerCPU (else one job takes the whole node),
# no accounting, and fake GPUs (character devices aliasing /dev/null) so that --gpus-per-node works.
#
# Exit codes: 0 ready, 1 failed (the message names the log to read), 3 apt cannot install packages.
#
# Environment:
#   SLURM_FAKE_GPUS       GPUs the node advertises (default 8)
#   SLURM_START_TIMEOUT   seconds to wait for the node to become idle (default 120)
#   SLURM_DEF_MEM_PER_CPU MiB given to a job per CPU when it does not ask (default 1024)
set -euo pipefail

action="${1:-start}"
fake_gpus="${SLURM_FAKE_GPUS:-8}"
start_timeout="${SLURM_START_TIMEOUT:-120}"
def_mem_per_cpu="${SLURM_DEF_MEM_PER_CPU:-1024}"
conf_dir=/etc/slurm
state_dir=/var/lib/megatron-rl-slurm     # pid files, logs, the "we started it" markers
spool_ctld=/var/spool/slurmctld
spool_d=/var/spool/slurmd
ctld_pid=/run/slurmctld.pid
slurmd_pid=/run/slurmd.pid
munge_pid=/run/munge/munged.pid

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

alive() {  # alive PIDFILE: the process named in PIDFILE is running
  local pid
  [ -s "$1" ] || return 1
  pid="$(cat "$1" 2>/dev/null)" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

wait_until() {  # wait_until SECONDS WHAT CMD...: poll CMD every 0.5 s, fail after SECONDS
  local limit="$1" what="$2"; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.5
  done
  log "$what"
}

install_packages() {
  local missing=0 cmd
  for cmd in slurmctld slurmd sbatch munged; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing=1
  done
  [ "$missing" = 0 ] && return 0
  log "installing slurmctld slurmd slurm-client munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  # Exit code 3: packages cannot be installed here (the tests skip on it, naming the reason).
  apt-get -o DPkg::Lock::Timeout=300 update -qq || { log "ERROR: apt-get update failed (is a Debian mirror reachable?)"; exit 3; }
  apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || { log "ERROR: apt-get install of slurm/munge failed"; exit 3; }
}

# Start a daemon without the caller's open file descriptors: a daemon that inherits, say, a held
# flock(1) lock or a test runner's pipe keeps it open for as long as it lives.
daemon() {
  (
    for fd in /proc/self/fd/*; do
      fd="${fd##*/}"
      [ "$fd" -gt 2 ] 2>/dev/null && eval "exec $fd>&-"
    done
    exec "$@"
  )
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_works; then return 0; fi
  install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
  install -d -o munge -g munge -m 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  daemon runuser -u munge -- /usr/sbin/munged
  touch "$state_dir/started-munge"
  wait_until 20 "munged is up" munge_works || die "munged did not start (see /var/log/munge/munged.log)"
}

node_line() {
  # The hardware line slurmd itself detects (CPUs, sockets, cores, threads), memory kept at 90 %
  # so that a busy machine never makes slurmd report less than the config claims.
  local hw mem
  hw="$(slurmd -C | head -n 1)"
  mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
  hw="$(sed 's/ RealMemory=[0-9]*//; s/^NodeName=[^ ]* //' <<<"$hw")"
  echo "NodeName=$(hostname -s) NodeAddr=127.0.0.1 $hw RealMemory=$((mem * 9 / 10)) Gres=gpu:$fake_gpus State=UNKNOWN"
}

render_slurm_conf() {
  local host; host="$(hostname -s)"
  cat <<EOF
# Written by scripts/slurm_cluster.sh: a one-node test cluster. Do not edit by hand.
ClusterName=megatronrl
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued batch job may start again only after the credential lifetime (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$spool_ctld
SlurmdSpoolDir=$spool_d
SlurmctldPidFile=$ctld_pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$state_dir/slurmctld.log
SlurmdLogFile=$state_dir/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
# Start queued / requeued jobs within a second or two (tests wait on them).
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$def_mem_per_cpu
GresTypes=gpu
ReturnToService=2
JobRequeue=1
# sbatch --wait polls every 2 s only when MinJobAge/2 <= 2 (else 8 s, then 32 s).
MinJobAge=5
KillWait=10
SlurmdTimeout=60
InactiveLimit=0
$(node_line)
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

render_gres_conf() {
  echo "# Written by scripts/slurm_cluster.sh: fake GPUs (aliases of /dev/null) for --gpus-per-node."
  echo "NodeName=$(hostname -s) Name=gpu File=/dev/fakegpu[0-$((fake_gpus - 1))]"
}

render_cgroup_conf() {
  echo "# Written by scripts/slurm_cluster.sh: no cgroup plugins (proctrack/linuxproc, task/none)."
  echo "CgroupPlugin=autodetect"
  echo "IgnoreSystemd=yes"
  echo "ConstrainCores=no"
  echo "ConstrainRAMSpace=no"
  echo "ConstrainDevices=no"
}

write_if_changed() {  # write_if_changed FILE CONTENT: 0 if the file changed
  if [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; then return 1; fi
  printf '%s\n' "$2" > "$1"
  log "wrote $1"
}

make_fake_gpus() {
  local i
  for ((i = 0; i < fake_gpus; i++)); do
    [ -e "/dev/fakegpu$i" ] || mknod -m 0666 "/dev/fakegpu$i" c 1 3
  done
}

configure() {  # 0 if any config file changed
  install -d -m 0755 "$conf_dir" "$state_dir" "$spool_ctld" "$spool_d"
  make_fake_gpus
  local changed=1
  write_if_changed "$conf_dir/slurm.conf" "$(render_slurm_conf)" && changed=0
  write_if_changed "$conf_dir/gres.conf" "$(render_gres_conf)" && changed=0
  write_if_changed "$conf_dir/cgroup.conf" "$(render_cgroup_conf)" && changed=0
  return $changed
}

stop_daemon() {  # stop_daemon NAME PIDFILE
  alive "$2" || return 0
  local pid; pid="$(cat "$2")"
  log "stopping $1 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  wait_until 30 "$1 stopped" bash -c "! kill -0 $pid" || { kill -KILL "$pid" 2>/dev/null || true; }
}

node_state() { sinfo -h -N -n "$(hostname -s)" -o '%t' 2>/dev/null | head -n 1; }
node_idle() { [[ "$(node_state)" =~ ^(idle|mix|alloc)$ ]]; }

start_slurm() {
  local changed="$1"
  if [ "$changed" = 0 ] && { alive "$ctld_pid" || alive "$slurmd_pid"; }; then
    log "config changed: restarting the daemons"
    stop_daemon slurmd "$slurmd_pid"
    stop_daemon slurmctld "$ctld_pid"
  fi
  if ! alive "$ctld_pid"; then
    daemon /usr/sbin/slurmctld || die "slurmctld failed to start (see $state_dir/slurmctld.log)"
    touch "$state_dir/started-slurm"
  fi
  wait_until 30 "slurmctld answers" scontrol ping \
    || die "slurmctld does not answer (see $state_dir/slurmctld.log)"
  if ! alive "$slurmd_pid"; then
    daemon /usr/sbin/slurmd || die "slurmd failed to start (see $state_dir/slurmd.log)"
  fi
  local deadline=$((SECONDS + start_timeout)) state
  until node_idle; do
    state="$(node_state)"
    if [[ "$state" =~ ^(down|drain|drng|fail) ]]; then
      scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 20 "$state_dir/slurmctld.log" "$state_dir/slurmd.log" >&2 || true
      die "node not idle after ${start_timeout}s (state: ${state:-unknown})"
    fi
    sleep 0.5
  done
  log "node $(hostname -s) is $(node_state): $(nproc) CPUs, $fake_gpus fake GPUs"
}

start() {
  [ "$(id -u)" = 0 ] || die "must run as root (installs packages, writes /etc/slurm)"
  install_packages
  install -d -m 0755 "$state_dir"
  start_munge
  local changed=1
  configure && changed=0
  start_slurm "$changed"
}

stop() {
  if alive "$ctld_pid"; then
    scancel --full --quiet --user=root >/dev/null 2>&1 || true
    wait_until 30 "jobs cancelled" bash -c '[ -z "$(squeue -h -o %i)" ]' || log "jobs still listed"
  fi
  stop_daemon slurmd "$slurmd_pid"
  stop_daemon slurmctld "$ctld_pid"
  rm -f "$state_dir/started-slurm"
  if [ -f "$state_dir/started-munge" ]; then
    stop_daemon munged "$munge_pid"
    rm -f "$state_dir/started-munge"
  fi
}

status() {
  sinfo -N -o '%N %t %c %m %G' && squeue && node_idle
}

case "$action" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: $0 [start|stop|status]" ;;
esac
