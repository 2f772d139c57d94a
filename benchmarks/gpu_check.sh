#!/usr/bin/env bash
# The GPU check, in one call of a lent single-GPU machine (docs/benchmarks/overhead.md, "On a
# GPU"): the overhead benchmark's step times (in-graph, hinted, dispatched) under vmap and through
# dp.jit, at two sizes; the hint tests (hinted == in-graph to rounding, one program's bits the
# same on every call, no loop or conditional in a hinted program) and the unit tests (the float64
# reference, compression); compile time at 100 leaves. Each stage has its own time limit and runs
# even if one before it failed; everything lands in $OUT/gpu.tar.gz, the log in $OUT/gpu.log.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh   # from the repository root, on the GPU machine
#   STAGES="tests small" OV_ARGS=--skip-steps ...  # some stages; extra benchmark arguments
#
# It runs under the machine's own python3 and JAX (not the project's pins); optax is installed
# from .whl/ when one is carried there.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT/r"
exec > >(tee "$OUT/gpu.log") 2>&1
export JAX_PLATFORMS=${PLATFORM:-cuda} PYTHONUNBUFFERED=1 PYTHONPATH=.
small="--params 4e6" large="--params 6.4e7 --dp-width 4096"
if [ -n "${QUICK:-}" ]; then  # a dry run of the script's flow (e.g. PLATFORM=cpu QUICK=1)
  small="--params 2e5 --dp-width 128" large="--params 4e5 --dp-width 256 --dp-steps 40"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:.
fi
stage() {  # stage NAME SECONDS CMD...; STAGES="small tests" runs only those
  local name=$1 limit=$2
  shift 2
  case " ${STAGES:-small large tests unit compile} " in *" $name "*) ;; *) return ;; esac
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  timeout "$limit" "$@"
  echo "=== $name: rc=$? in $((SECONDS - t0))s"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
python3 -c 'import jax, optax, sys; print(sys.version.split()[0], "jax", jax.__version__,
  "optax", optax.__version__, jax.devices())'
ov="python3 -m benchmarks.overhead --skip-compile --dp-here --dp-devices 1 --repeats 5 ${OV_ARGS:-}"
stage small 210 $ov $small --leaves 100 --out "$OUT/r/gpu_small.json"
stage large 120 $ov $large --leaves 10 --out "$OUT/r/gpu_large.json"
stage tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_step_kinds.py \
  tests/test_step_kind_traffic.py \
  -k "(hinted or wrong_hint or dispatch_follows or larger_size or precompile) and not unhinted"
stage unit 120 python3 -m pytest -q -p no:cacheprovider tests/test_compression.py \
  tests/test_reference.py
stage compile 240 python3 -m benchmarks.overhead --skip-steps --skip-data-parallel \
  --compile-leaves 100 --compile-repeats 1 --out "$OUT/r/gpu_compile.json"
tar czf "$OUT/gpu.tar.gz" -C "$OUT" r
for f in "$OUT"/r/*.md; do echo "--- $f"; grep -v "^- \|^B/param" "$f" | head -60; done
