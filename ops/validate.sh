#!/usr/bin/env bash
# Validates ops/: the Kubernetes manifests and the Helm chart's rendered templates against
# the Kubernetes JSON schemas (PyPI `kubernetes-validate`, strict: unknown fields fail),
# the Prometheus config as YAML, and the Grafana dashboard's metric names against those the
# node exports (crates/spillway-node/src/http.rs). Installs what it needs into a venv.
#
# The chart is rendered by a small renderer of its `{{ .Values.x }}`, `{{ .Release.Name }}`
# and `{{ .Release.Namespace }}` placeholders (no helm binary is packaged in the registries
# this project uses); any other template action fails the check rather than pass unrendered.
# The PodMonitor is a CRD (Prometheus Operator) the schemas do not hold: checked for its
# required fields only.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${OPS_VENV:-/tmp/spillway-ops-venv}
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet kubernetes-validate==1.37.0 pyyaml
fi
rendered=$(mktemp -d)
trap 'rm -rf "$rendered"' EXIT
"$venv/bin/python" - "$rendered" <<'PY'
import re, sys, yaml, pathlib
out = pathlib.Path(sys.argv[1])
chart = pathlib.Path("ops/helm/spillway")
yaml.safe_load(open(chart / "Chart.yaml"))
values = yaml.safe_load(open(chart / "values.yaml"))
release = {"Name": "spillway", "Namespace": "spillway"}
def lookup(path):
    root, *rest = path.split(".")
    v = {"Values": values, "Release": release}[root]
    for k in rest:
        v = v[k]
    return str(v)
for t in sorted((chart / "templates").glob("*.yaml")):
    text = t.read_text()
    def sub(m):
        return lookup(m.group(1))
    done = re.sub(r"\{\{\s*\.((?:Values|Release)(?:\.[A-Za-z0-9_]+)+)\s*\}\}", sub, text)
    if "{{" in done:
        sys.exit(f"{t}: a template action this renderer does not know: {done[done.index('{{'):][:60]!r}")
    (out / t.name).write_text(done)
    print(f"rendered {t}")
PY
manifests=(ops/k8s/namespace.yaml ops/k8s/configmap.yaml ops/k8s/secret.yaml ops/k8s/daemonset.yaml
           "$rendered/configmap.yaml" "$rendered/daemonset.yaml")
# The Secret ops/k8s/make-secret.sh makes, when a spillway binary is at hand.
exe=${SPILLWAY:-target/release/spillway}
if [ -x "$exe" ]; then
    SPILLWAY="$exe" ops/k8s/make-secret.sh 4 > "$rendered/secret-made.yaml"
    manifests+=("$rendered/secret-made.yaml")
else
    echo "make-secret.sh not checked: no spillway binary at $exe (set SPILLWAY)"
fi
"$venv/bin/kubernetes-validate" --strict "${manifests[@]}"
"$venv/bin/python" - ops/k8s/podmonitor.yaml "$rendered/podmonitor.yaml" <<'PY'
import sys, yaml
for f in sys.argv[1:]:
    d = yaml.safe_load(open(f))
    assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["kind"] == "PodMonitor", f
    assert d["spec"]["selector"]["matchLabels"], f
    ep = d["spec"]["podMetricsEndpoints"]
    assert ep and all(e["port"] == "metrics" and e["path"] == "/metrics" for e in ep), f
    print(f"{f}: PodMonitor fields ok")
PY
"$venv/bin/python" - <<'PY'
import json, re, yaml
yaml.safe_load(open("ops/prometheus/prometheus.yml"))["scrape_configs"][0]["static_configs"]
src = open("crates/spillway-node/src/http.rs").read()
exported = set(re.findall(r'"([a-z_]+)"', src))
dash = json.load(open("ops/grafana/spillway-nodes.json"))
names = set()
for p in dash["panels"]:
    for t in p["targets"]:
        names |= set(re.findall(r"spillway_([a-z_]+)", t["expr"]))
missing = sorted(n for n in names if n not in exported and n.removesuffix("_total") not in exported)
assert not missing, f"dashboard metrics the node does not export: {missing}"
print(f"grafana: {len(dash['panels'])} panels, {len(names)} metrics, all exported by the node")
PY
echo "ops/ validated"
