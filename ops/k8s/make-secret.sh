#!/usr/bin/env bash
# ops/k8s/make-secret.sh HOSTS [TTL] > secret.yaml: the Secret `spillway-pool` of the
# DaemonSet (ops/k8s/daemonset.yaml, the Helm chart) for a pool of HOSTS hosts.
#
# It makes a new pool CA (`spillway cluster init`) and a one-time join token per host but
# the first (`spillway cluster token create`, valid for TTL, default 30d, the most). Keys:
#   ca.pem, ca.key.pem, pool_id   the CA: host 0's pod copies them, to serve joins (every
#                                 pod mounts the Secret, so the CA key is readable there);
#   join-token-<id>               the token records host 0 checks joins against;
#   token-K                       host K's token (K = 2..HOSTS, host index + 1).
# Every other host makes its own key and joins with its token: no node key is in the
# Secret. Apply it with `kubectl apply -f secret.yaml`; the namespace is $NAMESPACE
# (default spillway), the name $SECRET (default spillway-pool). Needs `spillway` on PATH
# (or $SPILLWAY).
set -euo pipefail
hosts=${1:?usage: make-secret.sh HOSTS [TTL]}
ttl=${2:-30d}
exe=${SPILLWAY:-spillway}
ns=${NAMESPACE:-spillway}
name=${SECRET:-spillway-pool}
case "$hosts" in '' | *[!0-9]* | 0) echo "HOSTS must be a number of hosts, 1 or more" >&2; exit 2 ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$exe" cluster init --dir "$work/pool" --nodes 1 > /dev/null
ca="$work/pool/pool"
keys=(ca.pem="$ca/ca.pem" ca.key.pem="$ca/ca.key.pem" pool_id="$ca/pool_id")
for k in $(seq 2 "$hosts"); do
    "$exe" cluster token create --dir "$work/pool" --ttl "$ttl" > "$work/token-$k" 2> /dev/null
    keys+=(token-$k="$work/token-$k")
done
for f in "$ca"/join-tokens/*; do
    [ -e "$f" ] && keys+=(join-token-"$(basename "$f")"="$f")
done
cat <<YAML
# Made by ops/k8s/make-secret.sh $hosts $ttl: the pool CA and $((hosts - 1)) join tokens.
apiVersion: v1
kind: Secret
metadata:
  name: $name
  namespace: $ns
  labels:
    app.kubernetes.io/name: spillway
type: Opaque
data:
YAML
for kv in "${keys[@]}"; do
    echo "  ${kv%%=*}: $(base64 -w0 < "${kv#*=}")"
done
