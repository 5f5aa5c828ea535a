#!/usr/bin/env bash
# Installs what spillway-net's `ucx` feature needs on Debian (12 and later):
#   libucx-dev    UCX headers and ucx.pc (pulls in libucx0, the library itself)
#   pkg-config    how crates/spillway-ucx-sys finds UCX's headers
#   libclang-dev  libclang for bindgen, which generates the bindings at build time
# The default build needs none of these. A binary built with `ucx` does not link UCX: it
# loads libucp.so.0 when asked for UCX (or the path in SPILLWAY_UCX_LIB), so a machine
# that only runs it needs just libucx0, and one without it runs everything but UCX.
# Safe to run again: installed packages are skipped, and apt-get runs only when
# something is missing.
set -euo pipefail

packages=(libucx-dev pkg-config libclang-dev)

missing=()
for p in "${packages[@]}"; do
    if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        echo "install-ucx: $p already installed"
    else
        missing+=("$p")
    fi
done

if ((${#missing[@]} > 0)); then
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    echo "install-ucx: installing ${missing[*]}"
    $sudo apt-get update -q
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

echo "install-ucx: UCX $(pkg-config --modversion ucx) found through pkg-config"
echo "install-ucx: build and test with"
echo "  UCX_NET_DEVICES=lo UCX_TLS=tcp,self cargo test -p spillway-net --features ucx --release"
