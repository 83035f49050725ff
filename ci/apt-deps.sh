#!/usr/bin/env bash
# Installs the Debian packages that builds and tests need, only those missing. Idempotent; CI and
# fresh machines run it through the nox sessions. Usage: ci/apt-deps.sh [package ...]
set -euo pipefail
want=("$@")
if [ ${#want[@]} -eq 0 ]; then
  want=(libgtest-dev libxxhash-dev libssl-dev liburing-dev clang-format fio iperf3 iproute2)
fi
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "ci/apt-deps.sh: missing Debian packages: ${missing[*]}; run as root or install them" >&2
  exit 1
fi
echo "ci/apt-deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
