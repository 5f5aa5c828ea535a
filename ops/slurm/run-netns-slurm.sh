#!/usr/bin/env bash
# A real Slurm of 2 hosts on this machine: each host a network namespace on a bridge
# (10.77.0.1-2/24 only; removed on every way out), slurmctld and slurmd node1 in the
# first, slurmd node2 in the second (Debian's slurm-wlm and munge, started by hand). Then
#   srun -N2 -n4 spillway launch -- spillway demo ...
# 2 ranks per host: local rank 0 starts the host's node, rank 1 waits for it; each rank's
# demo client verifies every page, its pages spilled to the other host's node. Slurm's
# node names are not DNS names: launch asks `scontrol` for their NodeAddr. Needs root.
#   ops/slurm/run-netns-slurm.sh [path/to/spillway]   (default target/release/spillway)
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(realpath "${1:-target/release/spillway}")
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
tag="spws$$"
work=$(mktemp -d /tmp/spillway-slurm2.XXXXXX)
chmod 755 "$work"
conf=$work/slurm.conf
cleanup() {
    for f in "$work"/*.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f"); kill "$pid" 2>/dev/null || continue
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    done
    for ns in "$tag-h1" "$tag-h2" "$tag-br"; do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
    if [ "${KEEP_TMP:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

ip netns add "$tag-br"
ip -n "$tag-br" link add br0 type bridge
ip -n "$tag-br" link set br0 up
for i in 1 2; do
    ns="$tag-h$i"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$ns" link add eth0 type veth peer name "p$i" netns "$tag-br"
    ip -n "$ns" addr add "10.77.0.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$tag-br" link set "p$i" master br0
    ip -n "$tag-br" link set "p$i" up
done
# nsenter, not `ip netns exec`: the latter mounts a fresh /sys without the cgroup mounts
# slurmd needs; entering only the network namespace keeps this machine's.
in1() { nsenter --net="/run/netns/$tag-h1" "$@"; }
in2() { nsenter --net="/run/netns/$tag-h2" "$@"; }

mkdir -p "$work/munge"
dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
chmod 700 "$work/munge"; chmod 400 "$work/munge/munge.key"
munged --key-file="$work/munge/munge.key" --socket="$work/munge/munge.socket" \
    --pid-file="$work/munged.pid" --log-file="$work/munged.log" \
    --seed-file="$work/munge/seed" --force

cpus=$(nproc)
cat > "$conf" <<CONF
ClusterName=spillway-netns
SlurmctldHost=$(hostname -s)(10.77.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket=$work/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool-%n
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd-%n.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=node[1-2] NodeAddr=10.77.0.[1-2] CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
mkdir -p "$work/state" "$work/spool-node1" "$work/spool-node2"
export SLURM_CONF=$conf
in1 slurmctld -f "$conf"
in1 slurmd -f "$conf" -N node1
in2 slurmd -f "$conf" -N node2
for _ in $(seq 1 120); do
    idle=$(in1 sinfo -h -N -o '%T' 2>/dev/null | grep -c '^idle$' || true)
    [ "$idle" = 2 ] && break
    sleep 0.5
done
echo "slurm: $idle of 2 nodes idle; $(sinfo --version)"
[ "$idle" = 2 ] || { tail -n 20 "$work"/slurm*.log; exit 1; }

out=$work/out
mkdir -p "$out"
in1 srun -N2 -n4 --ntasks-per-node=2 --chdir "$work" --export=ALL \
    "$exe" launch --dir "$work/pool" --run-base "$work/run" --host-budget 256MiB \
    --timeout-s 90 -- \
    sh -c '"$0" demo --layers 8 --weight-mib 2 --act-mib 1 --steps 2 --host-budget 8MiB \
        --json --out "$1/demo-$SLURM_PROCID.d" > "$1/demo-$SLURM_PROCID.json" \
        && echo "rank $SLURM_PROCID (local $SLURM_LOCALID) on $SLURMD_NODENAME: demo done, node $SPILLWAY_NODE_ID at $SPILLWAY_STATUS_ADDR"' \
        "$exe" "$out" 2>&1 | grep -v '^demo: steps\|^wrote ' | tee "$work/srun.log"
OUT="$out" python3 - <<'PY'
import json, os
for r in range(4):
    d = json.load(open(f"{os.environ['OUT']}/demo-{r}.json"))
    assert d["corrupt_pages"] == 0, d
    assert d["verified_bytes"] >= d["working_set_bytes"] * len(d["steps"]), d
    out = sum(s["remote_bytes_out"] for s in d["steps"])
    assert out > 0, "no page left the host"
    print(f"rank {r}: verified {d['verified_bytes']} B of a {d['working_set_bytes']} B working set "
          f"over {len(d['steps'])} steps, 0 corrupt, {out} B to the other host, total {d['total_s']:.2f} s")
PY
echo "srun -N2 -n4 spillway launch (2 network namespaces): passed"
