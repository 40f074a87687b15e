#!/usr/bin/env bash
# Issue 34's GPU run in one command, each part on its own time limit, a failure in one not stopping the
# others: benchmarks/scale.py (one rank's share of a W-rank step at Llama 3 8B's shapes, W = 2, 4, 8,
# sequence 2048 and 8192), the GPU tier (tests/gpu), and compare.py --device cuda (default and small
# preset). Everything goes to $OUT (8 files at most): env.txt, scale.log, scale.json, gpu_tests.log,
# compare_cuda{,_small}.{log,json}.
#
#   PYTHON=python3 bash tests/gpu/run_scale.sh
#
# SCALE_ARGS adds flags to scale.py (a dry run here: SCALE_ARGS="--preset tiny --device cpu").
#
# Needs CUDA torch; not torchtitan, hypothesis or matplotlib. einops (tests/models.py and the rtp
# benchmarks import it) is taken from a wheel in $WHEELS (default ./wheels, e.g.
# einops-0.8.2-py3-none-any.whl) when it is not installed: a pure-Python wheel imports from PYTHONPATH.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/rsdp-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for wheel in "${WHEELS:-wheels}"/*.whl; do
    [ -e "$wheel" ] && PYTHONPATH="$PYTHONPATH:$(realpath "$wheel")"
done

stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
part() {  # part NAME SECONDS LOG COMMAND...: run one part on a time limit; log its exit status
    local name=$1 limit=$2 log=$3; shift 3
    stamp "start $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    local status=$?
    stamp "end $name: exit $status$([ $status -eq 124 ] && echo ' (time limit)')"
    tail -n 4 "$log"
}

{
    stamp "environment"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    "$PY" -c "import einops; print('einops', einops.__version__)" || echo "einops missing: tests/gpu and compare.py will fail"
    echo "loadavg $(cat /proc/loadavg)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

part scale 120 "$OUT/scale.log" "$PY" benchmarks/scale.py ${SCALE_ARGS:-} --json "$OUT/scale.json"
part gpu_tests 60 "$OUT/gpu_tests.log" "$PY" -m pytest -q -s --noconftest -p no:cacheprovider tests/gpu
part compare_cuda 240 "$OUT/compare_cuda.log" \
    "$PY" benchmarks/rtp/compare.py --device cuda --strategies dp fsdp rtp --no-chart --json "$OUT/compare_cuda.json"
part compare_cuda_small 240 "$OUT/compare_cuda_small.log" \
    "$PY" benchmarks/rtp/compare.py --device cuda --preset small --strategies dp fsdp rtp --no-chart --json "$OUT/compare_cuda_small.json"
echo "loadavg $(cat /proc/loadavg)" >>"$OUT/env.txt"
stamp "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
