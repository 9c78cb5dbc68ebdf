#!/usr/bin/env bash
# The GPU checks, in one call of a lent device machine (run from the repository root; its results go to $OUT):
#   1. exact edge patching, stacked against one forward per edge (bench_gpu.py --part edges), the open row;
#   2. pytest tests/gpu;
#   3. the rest of the GPU bench (forward, cache-all, generation) and the Triton FlashAttention rows.
# Each step's output is its own file, so a step that fails or runs out of time leaves the others' results.
#
# The device image has torch, transformers and triton but not TransformerLens and the few packages it and we import
# (no registry is reachable there). Made here, once, in the repository root (git-ignored, 2.5 MB, carried as ".whl"):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformer-lens==4.3.0 datasets==5.2.0 gguf==0.19.0 dill==0.4.1 multiprocess==0.70.19
# SmolLM2's GGUF (94 MB) is more than a call carries: its tests skip there, and the edge patching rows use a random
# model of its shape (same cost).
set -uo pipefail
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
git log -1 --format='commit %H' > "$OUT/device.txt" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$OUT/device.txt" 2>&1
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    >> "$OUT/device.txt" 2>&1
step() {  # step NAME SECONDS COMMAND...: stdout to NAME.md, stderr to NAME.log, stopped after SECONDS
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.md" 2> "$OUT/$name.log"
    echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/device.txt"
}
step edges 150 "$PYTHON" tests/benchmarks/bench_gpu.py --part edges
step tests_gpu 200 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
step bench_gpu 150 "$PYTHON" tests/benchmarks/bench_gpu.py --quick --part models
step triton 60 "$PYTHON" tests/benchmarks/bench_triton_flash.py --dtype bf16 --graphs
cat "$OUT/device.txt"
