#!/usr/bin/env bash
# A real Slurm on this machine (Debian's slurm-wlm and munge; controller and one slurmd,
# started by hand, no systemd), then
#   srun -N1 -n2 spillway launch -- spillway demo --connect "$SPILLWAY_SOCKET" ...
# Both ranks of the one host run launch: local rank 0 starts the node, rank 1 waits for
# it; each runs the demo client on the node, which verifies every page. Needs root.
#   ops/slurm/run-local-slurm.sh [path/to/spillway]   (default target/release/spillway)
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(realpath "${1:-target/release/spillway}")
. ops/slurm/lib.sh
slurm_install
work=$(mktemp -d /tmp/spillway-slurm.XXXXXX)
chmod 755 "$work"
conf=$work/slurm.conf
cleanup() {
    stop_pidfiles "$work/slurmd.pid" "$work/slurmctld.pid" "$work/munged.pid"
    if [ "${KEEP_TMP:-0}" != 1 ]; then rm -rf "$work"; fi
}
trap cleanup EXIT

munge_start "$work"
slurm_conf "$work" spillway-ci "localhost(127.0.0.1)" spool "" \
    "NodeName=node1 NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP" > "$conf"
mkdir -p "$work/state" "$work/spool"
export SLURM_CONF=$conf
slurmctld -f "$conf"
slurmd -f "$conf" -N node1
slurm_wait_idle 1

out=$work/out
mkdir -p "$out"
# The job of each rank: the pool's status through the node launch started for this host
# (SPILLWAY_STATUS_ADDR), then the demo client on the node's socket. A pool of one host
# has no peers to lend a remote tier: the client's pages live in the host memory the node
# gives it (--host-budget holds the 24 MiB working set); the 2-host run with pages
# crossing hosts is ops/slurm/run-netns-slurm.sh.
srun -N1 -n2 --chdir "$work" --export=ALL \
    "$exe" launch --dir "$work/pool" --run-base "$work/run" --host-budget 256MiB \
    --port 17950 --timeout-s 60 -- \
    sh -c '"$0" status --node "$SPILLWAY_STATUS_ADDR" --json > "$1/status-$SLURM_LOCALID.json" \
        && "$0" demo --connect "$SPILLWAY_SOCKET" --layers 8 --weight-mib 2 --act-mib 1 \
            --steps 3 --host-budget 32MiB --json --out "$1/demo-$SLURM_LOCALID.d" \
            > "$1/demo-$SLURM_LOCALID.json" \
        && echo "rank $SLURM_PROCID (local $SLURM_LOCALID) on $SLURMD_NODENAME: demo done, node $SPILLWAY_NODE_ID at $SPILLWAY_STATUS_ADDR, socket $SPILLWAY_SOCKET"' \
        "$exe" "$out" 2>&1 | grep -v '^demo: steps\|^wrote ' | tee "$work/srun.log"
OUT="$out" python3 - <<'PY'
import json, os
for r in (0, 1):
    d = json.load(open(f"{os.environ['OUT']}/status-{r}.json"))
    assert d["answering"] == 1 and d["leader"] == 1 and d["leader_agreed"], d
    demo = json.load(open(f"{os.environ['OUT']}/demo-{r}.json"))
    assert demo["corrupt_pages"] == 0, demo["corrupt_pages"]
    need = demo["working_set_bytes"] * len(demo["steps"])
    assert demo["verified_bytes"] >= need, (demo["verified_bytes"], need)
    print(f"rank {r}: status answering {d['answering']}, leader {d['leader']}, term {d['term']}; "
          f"demo verified {demo['verified_bytes']} B of a {demo['working_set_bytes']} B working set "
          f"over {len(demo['steps'])} steps, 0 corrupt, total {demo['total_s']:.2f} s")
PY
grep -c "node 1 stopped" "$work/srun.log" | grep -qx 1 || { echo "the node was not stopped once"; exit 1; }
echo "srun -N1 -n2 spillway launch: passed"
