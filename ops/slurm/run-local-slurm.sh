#!/usr/bin/env bash
# A real Slurm on this machine (Debian's slurm-wlm and munge; controller and one slurmd,
# started by hand, no systemd), then
#   srun -N1 -n2 spillway launch -- spillway demo --connect "$SPILLWAY_SOCKET" ...
# Both ranks of the one host run launch: local rank 0 starts the node, rank 1 waits for
# it; each runs the demo client, which verifies every page. Needs root.
#   ops/slurm/run-local-slurm.sh [path/to/spillway]   (default target/release/spillway)
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(realpath "${1:-target/release/spillway}")
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
work=$(mktemp -d /tmp/spillway-slurm.XXXXXX)
chmod 755 "$work"
conf=$work/slurm.conf
cleanup() {
    for d in slurmd slurmctld munged; do
        [ -f "$work/$d.pid" ] || continue
        pid=$(cat "$work/$d.pid")
        kill "$pid" 2>/dev/null || continue
        # Until it has exited (at most 10 s), so its files can go.
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
    if [ "${KEEP_TMP:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

# munge: a key of our own, a socket of our own.
mkdir -p "$work/munge"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 700 "$work/munge"; chmod 400 "$work/munge/munge.key"
munged --key-file="$work/munge/munge.key" --socket="$work/munge/munge.socket" \
    --pid-file="$work/munged.pid" --log-file="$work/munged.log" \
    --seed-file="$work/munge/seed" --force

cpus=$(nproc)
cat > "$conf" <<CONF
ClusterName=spillway-ci
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=$work/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=node1 NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP
CONF
mkdir -p "$work/state" "$work/spool"
export SLURM_CONF=$conf
slurmctld -f "$conf"
slurmd -f "$conf" -N node1
# Wait until the node is idle (a condition, polled; at most 60 s).
for _ in $(seq 1 120); do
    state=$(sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
    [ "$state" = idle ] && break
    sleep 0.5
done
echo "slurm: node1 $state; $(sinfo --version)"
[ "$state" = idle ] || { tail -n 20 "$work"/slurm*.log; exit 1; }

out=$work/out
mkdir -p "$out"
# The job of each rank: the pool's status through the node launch started for this host
# (SPILLWAY_STATUS_ADDR), and the client socket it was given. A pool of one host has no
# peers to lend a remote tier, so `demo --connect` (which needs one) runs in the 4-host
# test, scripts/launch-netns-test.sh.
srun -N1 -n2 --chdir "$work" --export=ALL \
    "$exe" launch --dir "$work/pool" --run-base "$work/run" --host-budget 256MiB \
    --port 17950 --timeout-s 60 -- \
    sh -c '"$0" status --node "$SPILLWAY_STATUS_ADDR" --json > "$1/status-$SLURM_LOCALID.json" \
        && test -S "$SPILLWAY_SOCKET" \
        && echo "rank $SLURM_PROCID (local $SLURM_LOCALID) on $SLURMD_NODENAME: node $SPILLWAY_NODE_ID at $SPILLWAY_STATUS_ADDR, socket $SPILLWAY_SOCKET"' \
        "$exe" "$out" 2>&1 | tee "$work/srun.log"
OUT="$out" python3 - <<'PY'
import json, os
for r in (0, 1):
    d = json.load(open(f"{os.environ['OUT']}/status-{r}.json"))
    assert d["answering"] == 1 and d["leader"] == 1 and d["leader_agreed"], d
    print(f"rank {r}: status answering {d['answering']}, leader {d['leader']}, term {d['term']}")
PY
grep -c "node 1 stopped" "$work/srun.log" | grep -qx 1 || { echo "the node was not stopped once"; exit 1; }
echo "srun -N1 -n2 spillway launch: passed"
