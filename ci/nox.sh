#!/usr/bin/env bash
# Entry point for every set-up and test command: makes a small tools venv with a pinned nox, then
# runs nox with the given arguments (e.g. `bash ci/nox.sh -s tests`).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in python3.11 python3; do command -v "$c" >/dev/null && py=$c && break; done
fi
venv=build/tools-venv
if [ ! -x "$venv/bin/nox" ]; then
  mkdir -p build
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "nox==2026.10.20"
fi
exec "$venv/bin/nox" "$@"
