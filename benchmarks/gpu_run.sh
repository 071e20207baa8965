#!/usr/bin/env bash
# The GPU measurements recorded in docs/results.md ("The guard on a GPU"), in one call on a lent CUDA
# machine, from the repository root. The machine's python3 holds CUDA torch; the pure dependencies
# travel as wheels in .whl/ and the offline datasets' decoded cache as .devdata/*.npz.xz (both ignored
# by git; docs/results.md says how to make them). Each part has its own time limit, so one that
# overruns leaves the others their time; what comes back: $OUT/log.txt and each part's CSV.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/fc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
for f in .devdata/*.npz.xz; do xz -dc "$f" > "/tmp/fc/$(basename "$f" .xz)"; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FLGUARD_CACHE=/tmp/fc
LOG=$OUT/log.txt

part() {  # part NAME SECONDS CSV-OR-- COMMAND...: run COMMAND under a limit, log it, keep its CSV
    local name=$1 limit=$2 csv=$3; shift 3
    case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped (SKIP)" | tee -a "$LOG"; return;; esac
    echo "== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout "$limit" "$@" >> "$LOG" 2>&1
    echo "== $name: rc=$? in $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$csv" != - ] && [ -f "$csv" ] && cp "$csv" "$OUT/$name.csv"
}

nvidia-smi -L >> "$LOG" 2>&1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" >> "$LOG" 2>&1
part cuda_tests "${LIMIT_TESTS:-90}" - python3 -m pytest -q -p no:cacheprovider -s tests/test_guard_model.py tests/test_risk_precision.py \
    tests/test_risk_assess.py tests/test_risk_shrinking.py tests/test_guard_layers.py \
    -k "cuda or chunk or cached or dense_float64 or float32"
part cuda_ghost_tests "${LIMIT_GHOST_TESTS:-60}" - python3 -m pytest -q -p no:cacheprovider -s \
    tests/test_ghost_products.py -k cuda
cd benchmarks
# guard_resnet18_ghost and guard_small_ghost: the guard's operator on the batched ghost products (GUARD_GHOST_ON_CUDA,
# off by default until these figures say which is faster on a card) beside the defaults' cached pullbacks.
part guard_resnet18_ghost "${LIMIT_R18:-240}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch "${R18_BATCH:-8,32}" \
    --steps "${R18_STEPS:-6}" --products ghost
part guard_small_ghost "${LIMIT_SMALL:-100}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models cnn,resnet20_gn --batch 32 --steps 10 --products ghost
part guard_resnet18 "${LIMIT_R18:-240}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch "${R18_BATCH:-8,32}" --steps "${R18_STEPS:-6}"
part guard_resnet18_eigen "${LIMIT_R18E:-120}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch 32 --steps "${R18_STEPS:-6}" --guard fallback=eigen
part guard_resnet18_median "${LIMIT_R18:-240}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch "${R18_BATCH:-8,32}" --steps "${R18_STEPS:-6}" \
    --guard clip_per_sample=median
part guard_small "${LIMIT_SMALL:-100}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models cnn,resnet20_gn --batch 32 --steps 10
part products_tf32 "${LIMIT_TF32:-90}" results/bench_operator_products_clip_tf32.csv \
    python3 bench_operator_products.py --device cuda --models resnet18_gn,cnn --batch 32 --paths cached --clip \
    --precision ieee,tf32 --repeats 5
# products_tf32: the clipped operator's products in the guard's IEEE float32 and with TF32 allowed (which the
# certificate does not allow), to say what IEEE float32 costs on the card.
# guard_resnet18_eigen and guard_resnet18_median: auto's former fallback (eigen, 64 Lanczos steps; resolvent since
# 2026-11-26) and the former clip level (the median; "retention" since 2026-11-26) beside the defaults, on the same
# card in the same call. PARTS=all adds: the operator's products alone; the cached pullbacks on the guard's path (1.9x cheaper per K product on an H200, but rebuilt
# on each shrinking subset); ResNet-18-GN at B = 32 with the Gaussian alone and with eigen's 32 Lanczos steps
# (what each of auto's two kinds costs there); and the quickstart CNN's launch-bound round with its K products
# eager and through CUDA graphs (torch.compile's reduce-overhead; compiled products' outputs are copied since
# 04cc31f). SKIP="name …" leaves parts out.
# PARTS=transposed: the cached Jᵀ pullback built with convolutions' input gradients as transposed convolutions
# (CACHED_TRANSPOSED_INPUT_GRADS) against PyTorch's own nodes: the clipped products, then ResNet-18-GN's round.
if [ "${PARTS:-}" = transposed ]; then
part products_transposed "${LIMIT_OPS:-120}" results/bench_operator_products_clip.csv \
    python3 bench_operator_products.py --device cuda --models resnet18_gn,resnet20_gn,cnn --batch 32 \
    --paths cached,cached-transposed --clip --repeats 5
for t in off on; do
part "guard_resnet18_transposed_$t" "${LIMIT_R18T:-80}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch 32 --steps "${R18_STEPS:-6}" --transposed "$t"
done
fi
# PARTS=overhead: where a ResNet-18-GN step's time goes beyond its products (a profile of two steps, printed to the
# log), then the solves' products on their still-iterating samples (SHRINK_TO_ACTIVE) against the whole batch on the
# cached path, where each shrink rebuilds both pullbacks (docs/results.md, "Shrinking products"), the noise seeded.
if [ "${PARTS:-}" = overhead ]; then
part profile_resnet18 "${LIMIT_PROFILE:-90}" - \
    python3 profile_guard_step.py --device cuda --model resnet18_gn --batch 32
for m in on off; do
part "guard_resnet18_shrink_$m" "${LIMIT_R18S:-80}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch 32 --steps "${R18_STEPS:-6}" --shrink "$m" \
    --guard seed=1
part "guard_cnn_shrink_$m" "${LIMIT_CNNS:-60}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models cnn --batch 32 --steps 20 --shrink "$m" --guard seed=1
done
fi
if [ "${PARTS:-}" = all ]; then
part products_resnet18 "${LIMIT_OPS:-80}" results/bench_operator_products.csv \
    python3 bench_operator_products.py --device cuda --models resnet18_gn --batch 32 --paths cached,direct,direct-cpu-chunks
part guard_resnet18_cached "${LIMIT_R18:-240}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch 32 --steps "${R18_STEPS:-6}" --products cached
part guard_resnet18_gaussian "${LIMIT_R18G:-90}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch 32 --steps "${R18_STEPS:-6}" --guard defense=gaussian
part guard_resnet18_eigen32 "${LIMIT_R18:-240}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models resnet18_gn --batch 32 --steps "${R18_STEPS:-6}" --guard defense=eigen krylov_steps=32
part guard_cnn "${LIMIT_CNN:-90}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models cnn --batch 32 --steps 20
part guard_cnn_graphs "${LIMIT_GRAPHS:-150}" results/bench_guard_models.csv \
    python3 bench_guard_models.py --device cuda --models cnn --batch 32 --steps 20 --compile-mode reduce-overhead
fi
