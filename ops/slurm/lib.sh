# A real Slurm started by hand in a scratch folder (sourced, not run): Debian's slurm-wlm
# and munge, no systemd. Used by run-local-slurm.sh (one host) and run-netns-slurm.sh (two
# hosts as network namespaces). Needs root.

# slurm_install: the packages, if missing.
slurm_install() {
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
}

# stop_pidfiles FILE...: SIGTERM to the process of each pid file that exists, then waits
# until it has exited (at most 10 s each), so its files can go.
stop_pidfiles() {
    local f pid
    for f in "$@"; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
}

# munge_start WORK: munged with a key and a socket of its own under WORK/munge.
munge_start() {
    local work=$1
    mkdir -p "$work/munge"
    dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
    chmod 700 "$work/munge"; chmod 400 "$work/munge/munge.key"
    munged --key-file="$work/munge/munge.key" --socket="$work/munge/munge.socket" \
        --pid-file="$work/munged.pid" --log-file="$work/munged.log" \
        --seed-file="$work/munge/seed" --force
}

# slurm_conf WORK NAME CTLD_HOST SPOOL PID_LOG_SUFFIX NODES_LINES: the slurm.conf both
# scripts write; SPOOL and PID_LOG_SUFFIX may name %n (the slurmd's node) so that several
# slurmd share one folder. NODES_LINES: the NodeName and PartitionName lines.
slurm_conf() {
    local work=$1 name=$2 ctld=$3 spool=$4 suffix=$5 nodes=$6
    cat <<CONF
ClusterName=$name
SlurmctldHost=$ctld
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=$work/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/$spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd$suffix.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd$suffix.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
$nodes
CONF
}

# slurm_wait_idle WANT [RUN...]: polls (every 0.5 s, at most 60 s) until WANT nodes are
# idle, asking sinfo through RUN (for example a namespace's nsenter); prints the count and
# fails with the logs' tails if they never are. Needs $work.
slurm_wait_idle() {
    local want=$1 idle=0
    shift
    for _ in $(seq 1 120); do
        idle=$("$@" sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle$' || true)
        [ "$idle" = "$want" ] && break
        sleep 0.5
    done
    echo "slurm: $idle of $want nodes idle; $(sinfo --version)"
    [ "$idle" = "$want" ] || { tail -n 20 "$work"/slurm*.log; return 1; }
}
