#!/bin/bash
# Probe 2 of issue 13 as written: cluster up --nodes 3 (defaults), demo --connect node 1 (default shape),
# SIGSTOP node 2 for 10 s while it holds the client's pages, then SIGCONT; afterwards node 2 must hold nothing.
# Run from the repository root after `cargo build --release`.
set -u
B=${SPILLWAY_BIN:-target/release/spillway}
D=${TMPDIR:-/tmp}/spillway-probe-pause
rm -rf $D
$B cluster up --dir $D --nodes 3 --base-port 28700 >/dev/null || exit 1
SOCK=$(python3 -c "import json;print(json.load(open('$D/cluster.json'))['nodes'][0]['client_socket'])")
PID2=$(python3 -c "import json;print(open(json.load(open('$D/cluster.json'))['nodes'][1]['pid_file']).read().strip())")
( $B demo --connect $SOCK --steps 12 --json > $D/demo.json 2> $D/demo.err; echo "rc=$?" > $D/demo.rc ) &
until [ "$($B status --dir $D --json --timeout-ms 500 | python3 -c "import json,sys;s=json.load(sys.stdin);print(int(s['nodes'][1]['status']['host_tier']['used_bytes']>0))")" = 1 ]; do sleep 0.5; done
t0=$(date +%s.%N); kill -STOP $PID2; sleep 10; kill -CONT $PID2; echo "paused node 2 for $(echo "$(date +%s.%N) - $t0" | bc) s; demo running: $([ -f $D/demo.rc ] && echo no || echo yes)"
while [ ! -f $D/demo.rc ]; do sleep 1; done
cat $D/demo.rc; grep -c . $D/demo.err | sed 's/^/stderr lines: /'
python3 -c "
import json; d=json.load(open('$D/demo.json')); st=d['steps']
print('steps', len(st), 'corrupt', d['corrupt_pages'], 'step wall s', [round(s['wall_s'],2) for s in st], 'stall s', [round(s['stall_s'],2) for s in st])" 2>&1 | head -3
for i in $(seq 1 30); do
  out=$($B status --dir $D --json --timeout-ms 500 | python3 -c "
import json,sys
s=json.load(sys.stdin)
n2=s['nodes'][1]['status']
ld=[n for n in s['nodes'] if n['status'].get('role')=='leader'][0]['status']['members']
print(n2['host_tier']['used_bytes'], sum(m['used_bytes'] for m in ld), sum(n['status']['remote']['deletes_pending'] for n in s['nodes']))")
  set -- $out
  if [ "$1" = 0 ] && [ "$2" = 0 ] && [ "$3" = 0 ]; then echo "released after the client left: node 2 holds 0 B, directory lists 0 B, 0 deletes pending (${i} s)"; break; fi
  sleep 1
done
echo "final: node2 used $1 B, listed $2 B, pending $3"
$B cluster down --dir $D >/dev/null
