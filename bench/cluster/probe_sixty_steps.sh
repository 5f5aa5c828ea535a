#!/bin/bash
# Probe 1 of issue 13 as written: cluster up --nodes 3 (defaults), demo --connect node 1 --steps 60,
# reservations sampled every 10 s. Run from the repository root after `cargo build --release`;
# HTB=256MiB sets the nodes' host budget, PORT the base port.
set -u
B=${SPILLWAY_BIN:-target/release/spillway}
D=${TMPDIR:-/tmp}/spillway-probe-pool60-${HTB:-default}
rm -rf $D
EXTRA=""
[ -n "${HTB:-}" ] && EXTRA="--host-budget $HTB"
$B cluster up --dir $D --nodes 3 --base-port ${PORT:-27700} $EXTRA >/dev/null || exit 1
SOCK=$(python3 -c "import json;print(json.load(open('$D/cluster.json'))['nodes'][0]['client_socket'])")
start=$(date +%s)
( $B demo --connect $SOCK --steps 60 --json > $D/demo.json 2> $D/demo.err; echo "rc=$?" > $D/demo.rc ) &
while [ ! -f $D/demo.rc ]; do
  $B status --dir $D --json --timeout-ms 500 2>/dev/null | python3 -c "
import json,sys
s=json.load(sys.stdin)
ld=[n for n in s['nodes'] if n.get('status',{}).get('role')=='leader']
if ld:
  m=ld[0]['status']['members']
  print('t=%ds' % ($(date +%s)-$start), 'reserved MiB', [x['reserved_bytes']>>20 for x in m], 'used MiB', [x['used_bytes']>>20 for x in m], 'unspent MiB', sum(n['status']['remote'].get('reserved_unspent_bytes',0) for n in s['nodes'] if 'status' in n)>>20)
"
  sleep 10
done
cat $D/demo.rc; echo "stderr bytes: $(wc -c < $D/demo.err)"
python3 -c "
import json; d=json.load(open('$D/demo.json')); st=d['steps']
print('steps', len(st), 'corrupt', d['corrupt_pages'], 'verified GiB', round(d['verified_bytes']/2**30,1), 'hit rate steps 2+', round(sum(s['hits'] for s in st[1:])/sum(s['acquires'] for s in st[1:]),4))"
sleep 3
$B status --dir $D --json --timeout-ms 500 | python3 -c "
import json,sys
s=json.load(sys.stdin)
ld=[n for n in s['nodes'] if n.get('status',{}).get('role')=='leader'][0]['status']['members']
print('after: reserved', [x['reserved_bytes']>>20 for x in ld], 'used', [x['used_bytes']>>20 for x in ld], 'unspent', sum(n['status']['remote'].get('reserved_unspent_bytes',0) for n in s['nodes'])>>20, 'deletes pending', sum(n['status']['remote'].get('deletes_pending',0) for n in s['nodes']))"
$B cluster down --dir $D >/dev/null
