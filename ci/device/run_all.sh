#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine with python3 holding torch (+ JAX for part 3):
#   1. build tpusync-core there (CUDA images rarely have libxxhash-dev: build/device-carry/ from
#      ci/device/prepare_offline.sh supplies headers and wheels when there is no registry);
#   2. ci/device/gpu_check.sh - torch CUDA correctness and `tpusync bench device`;
#   3. ci/device/jax_gpu_check.py - JAX on the GPU: staged path correctness, `bench device-jax`.
# Logs go to $OUT when set (the workplace's device tool), else to build/device-logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
logs=${OUT:-build/device-logs}
mkdir -p "$logs"
carry=build/device-carry
py=${PYTHON:-python3}
# Installed with --target, not into a venv: the CUDA image's python3 is itself a venv, and a venv
# made from it with --system-site-packages would see the base interpreter, not its torch / jax.
site=/tmp/tpusync-gpu-site
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
step() { echo "=== $* (t=$(( $(date +%s) - t0 ))s)"; }

step setup
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda)"
"$py" -c "import sysconfig; print('Python.h in', sysconfig.get_paths()['include'])"
pip=("$py" -m pip install -q --no-index --no-deps --no-compile --target)
# One pip call installs everything into $site: a second --target call would replace the shared
# namespace folder tpusync/ and lose what the first installed.
wheels=() tools=/tmp/tpusync-build-tools
if [ -d "$carry/wheels" ]; then
  "${pip[@]}" "$tools" "$carry"/wheels/nanobind-*.whl
  for w in "$carry"/wheels/*.whl; do [[ $w == */nanobind-* ]] || wheels+=("$w"); done
fi
nb_dir=$(PYTHONPATH=$tools "$py" -m nanobind --cmake_dir)
defs=("-Ccmake.define.nanobind_DIR=$nb_dir")
if [ ! -e /usr/include/xxhash.h ] && [ -d "$carry/include" ]; then
  inc=$(realpath "$carry/include")
  defs+=("-Ccmake.define.TPUSYNC_XXHASH_INCLUDE_DIR=$inc")
  if ! ls /usr/lib/x86_64-linux-gnu/libcrypto.so.3 >/dev/null 2>&1; then
    export LD_LIBRARY_PATH=$(realpath "$carry/lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    crypto=$(realpath "$carry/lib/libcrypto.so.3")
  else
    crypto=/usr/lib/x86_64-linux-gnu/libcrypto.so.3
  fi
  defs+=("-Ccmake.define.OPENSSL_INCLUDE_DIR=$inc" "-Ccmake.define.OPENSSL_CRYPTO_LIBRARY=$crypto")
fi
[ ${#wheels[@]} -gt 0 ] || wheels=(packages/tpusync-torch packages/tpusync-jax)
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "${pip[@]}" "$site" --no-build-isolation \
  -Cbuild-dir=/tmp/tpusync-gpu-skbuild "${defs[@]}" packages/tpusync-core "${wheels[@]}" 2>&1 | tail -30
"$py" -c "import tpusync.core, tpusync.torch; print('tpusync', tpusync.core.__version__)" \
  || { echo "setup failed"; exit 1; }

rc=0
step "torch: ci/device/gpu_check.sh"
PYTHON=$py bash ci/device/gpu_check.sh 2>&1 | tee "$logs/torch_gpu_check.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
step "jax: ci/device/jax_gpu_check.py"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 "$py" ci/device/jax_gpu_check.py \
  2>&1 | tee "$logs/jax_gpu_check.log"
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
step "done rc=$rc"
exit $rc
