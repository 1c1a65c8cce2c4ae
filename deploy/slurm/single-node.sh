#!/usr/bin/env bash
# A single-node Slurm with four fake GPUs, for benchmarks and tests on one machine (root, no systemd).
#   deploy/slurm/single-node.sh start DIR   install if needed, configure under DIR, start munge, slurmdbd
#                                           (when MariaDB answers on 127.0.0.1:3306), slurmctld, slurmd
#   deploy/slurm/single-node.sh start DIR tuned
#                                           the same node tuned for throughput: 64 CPUs declared (each runs
#                                           one job), little memory per CPU, the scheduler run at every
#                                           submission and end, finished jobs purged after 5 s, accounting off
#   deploy/slurm/single-node.sh stop DIR
# Prints the slurm.conf path on start; use it as SLURM_CONF for sbatch, squeue, sacct, scontrol.
# With slurmdbd, `sacct` reports exit codes and allocated GPUs; without it, accounting is off.
set -euo pipefail
action=${1:?start or stop}
dir=$(realpath -m "${2:?a folder for the state of Slurm}")
conf="$dir/slurm.conf"
profile=${3:-default}
case "$profile" in default|tuned) ;; *) echo "unknown profile $profile: default or tuned" >&2; exit 2 ;; esac

if [ "$action" = stop ]; then
  pids=""
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/slurmdbd.pid"; do
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then pids="$pids $pid"; fi
  done
  for pid in $pids; do  # wait until they are gone, so that a new start finds the ports free
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v qsub >/dev/null; then
  apt-get update -qq >/dev/null
  # slurm-wlm-torque adds the PBS-style qsub/qstat/qdel on top of Slurm.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm slurmdbd slurm-wlm-torque >/dev/null
fi
mkdir -p "$dir/dev" "$dir/state" "$dir/spool" "$dir/log"
for n in 0 1 2 3; do [ -e "$dir/dev/nvidia$n" ] || mknod "$dir/dev/nvidia$n" c 1 3; done

mkdir -p /run/munge /etc/munge
chown munge:munge /run/munge 2>/dev/null || true
if [ ! -f /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
fi
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

accounting="AccountingStorageType=accounting_storage/none"
if [ "$profile" = default ] && command -v mysql >/dev/null && mysql -uroot -h127.0.0.1 -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db" 2>/dev/null; then
  cat > "$dir/slurmdbd.conf" <<DBD
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$dir/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=root
StorageLoc=slurm_acct_db
DBD
  chmod 600 "$dir/slurmdbd.conf"
  if [ ! -f "$dir/slurmdbd.pid" ] || ! kill -0 "$(cat "$dir/slurmdbd.pid")" 2>/dev/null; then
    SLURM_CONF=$conf slurmdbd  # reads the slurmdbd.conf beside SLURM_CONF
    for _ in $(seq 1 50); do (echo > /dev/tcp/127.0.0.1/6819) 2>/dev/null && break; sleep 0.2; done
  fi
  accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
JobAcctGatherType=jobacct_gather/linux
AccountingStorageTRES=gres/gpu"
fi

cpus=$(nproc) memory_per_cpu=500 tuning=""
if [ "$profile" = tuned ]; then
  # Declared CPUs beyond the real ones need config_overrides; the rest lets slurmctld start a job the
  # moment one is submitted or ends, instead of on its periodic pass.
  cpus=64 memory_per_cpu=20
  tuning="SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,default_queue_depth=1000
MinJobAge=5"
fi
cat > "$dir/gres.conf" <<GRES
AutoDetect=off
NodeName=localhost Name=gpu File=$dir/dev/nvidia[0-3]
GRES
cat > "$conf" <<CONF
ClusterName=klique
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
DefMemPerCPU=$memory_per_cpu
GresTypes=gpu
ReturnToService=2
MaxJobCount=100000
$accounting
JobCompType=jobcomp/none
$tuning
NodeName=localhost NodeHostname=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=2000 Gres=gpu:4
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF

export SLURM_CONF=$conf
if [ -f "$dir/slurmdbd.conf" ]; then
  timeout 20 sacctmgr -i add cluster klique >/dev/null 2>&1 || true
fi
if ! timeout 5 scontrol ping 2>/dev/null | grep -q UP; then
  slurmctld -f "$conf" -i
  for _ in $(seq 1 50); do timeout 5 scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
fi
if [ ! -f "$dir/slurmd.pid" ] || ! kill -0 "$(cat "$dir/slurmd.pid")" 2>/dev/null; then
  timeout 60 slurmd -f "$conf" -N localhost
fi
for _ in $(seq 1 100); do
  state=$(timeout 5 sinfo -h -o %T 2>/dev/null || true)
  case "$state" in idle*|mix*|alloc*) echo "$conf"; exit 0 ;; esac
  sleep 0.2
done
echo "Slurm did not become ready; see $dir/log" >&2
exit 1
