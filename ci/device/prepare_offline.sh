#!/usr/bin/env bash
# Gather what ci/device/run_all.sh needs on a GPU machine that cannot reach any registry.
#
# Writes build/device-carry/ (ignored by git):
#   wheels/   tpusync-torch and tpusync-jax (pure Python, built here), and the build / runtime
#             wheels a CUDA image may lack (nanobind, pyzmq) for CPython 3.12 manylinux;
#   include/  xxhash.h and xxh3.h (Debian libxxhash-dev) and the OpenSSL headers;
#   lib/      libcrypto.so.3, used only where the GPU machine has none.
# Then copy or carry that folder to the GPU machine and run `bash ci/device/run_all.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=build/device-carry
py=${PY_TARGET:-3.12}
rm -rf "$out" && mkdir -p "$out/wheels" "$out/include" "$out/lib"
bash ci/apt-deps.sh libxxhash-dev libssl-dev >/dev/null
cp /usr/include/xxhash.h /usr/include/xxh3.h "$out/include/"
cp -r /usr/include/openssl "$out/include/"
cp /usr/include/x86_64-linux-gnu/openssl/*.h "$out/include/openssl/"
cp -L /usr/lib/x86_64-linux-gnu/libcrypto.so.3 "$out/lib/"
python3 -m pip wheel -q --no-deps -w "$out/wheels" packages/tpusync-torch packages/tpusync-jax
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$out/wheels" nanobind==3.1.0 pyzmq
du -sh "$out"
