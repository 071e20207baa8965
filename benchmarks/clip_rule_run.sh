#!/usr/bin/env bash
# The clip level's rounds across seeds in one call on a lent machine (docs/results.md, "A clip level for both
# regimes"): the trained quickstart CNN's 20-step round at B = 32 on the CPU, one thread per job, every seed and
# clip setting at once on the machine's cores; beside them, on the GPU when there is one, the GroupNorm ResNets'
# rounds (ResNet-18-GN at B = 8, ResNet-20-GN at B = 32, 10 steps), each setting REPEATS times. Every job prints its
# `bench_guard_models.py` row into $OUT/<job>.log (their shared CSV would be overwritten by the others).
# Set up like gpu_run.sh (.whl/ and .devdata/ carried with the tree); locally: PY=../.venv/bin/python.
set -u
OUT=${OUT:-/tmp/clip-out}
SEEDS=${SEEDS:-"0 1 2 3 4"}
SETTINGS=${SETTINGS:-"auto median"}
REPEATS=${REPEATS:-2}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT" /tmp/fc
if [ -z "${PY:-}" ]; then
    PY=python3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    for f in .devdata/*.npz.xz; do xz -dc "$f" > "/tmp/fc/$(basename "$f" .xz)"; done
    export PYTHONPATH=/tmp/site:$PWD FLGUARD_CACHE=/tmp/fc
    cd benchmarks
fi
export PYTHONUNBUFFERED=1
for seed in $SEEDS; do
    for setting in $SETTINGS; do
        OMP_NUM_THREADS=1 timeout "$LIMIT" $PY bench_guard_models.py --models cnn --batch 32 --steps 20 --seed "$seed" \
            --guard clip_per_sample="$setting" > "$OUT/cnn_${setting}_s${seed}.log" 2>&1 &
    done
done
if $PY -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    for setting in $SETTINGS; do
        (for r in $(seq "$REPEATS"); do
            OMP_NUM_THREADS=2 timeout "$LIMIT" $PY bench_guard_models.py --device cuda --models resnet18_gn --batch 8 \
                --steps 10 --guard clip_per_sample="$setting" > "$OUT/r18_${setting}_r${r}.log" 2>&1
            OMP_NUM_THREADS=2 timeout "$LIMIT" $PY bench_guard_models.py --device cuda --models resnet20_gn --batch 32 \
                --steps 10 --guard clip_per_sample="$setting" > "$OUT/r20_${setting}_r${r}.log" 2>&1
        done) &
    done
fi
wait
grep -h "^| \(cnn\|resnet\)" "$OUT"/*.log | sort > "$OUT/rows.md"
cat "$OUT/rows.md"
