#!/usr/bin/env bash
# GPU acceptance: on a machine with GPUs, the GPU tests, `paratrain doctor`, a bench over cpu / gpu:1 /
# gpu:N / tower-gpu:N / fsdp-gpu:N, the fastest CIFAR-10 recipe there is (time-capped), and the gpt (tokens/s,
# MFU): on one GPU in bf16, float32 and tf32; on N GPUs with NCCL's waits blocking (the default) and not; split
# by tensor parallelism; and cut into a 2-stage pipeline (its measured bubble beside the theory), into one report.
#
#   benchmarks/gpu_acceptance.sh [OUT]          (default OUT: gpu-acceptance; the report is OUT/report.md)
#   DATA=../shared/data RECIPE=cifar10-tutorial MAX_TIME=600 benchmarks/gpu_acceptance.sh
#
# DATA is a folder holding cifar-10-batches-bin/ (without it the bench uses synthetic data and the recipe is
# left out, said in the report). On a host without a CUDA GPU it refuses in one line (exit 2).
set -uo pipefail
OUT=${1:-gpu-acceptance}
PY=${PYTHON:-python}
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
if ! [[ "$GPUS" =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu_acceptance: no CUDA GPU is visible here (torch.cuda.is_available() is False); run it on a machine with GPUs" >&2
    exit 2
fi
mkdir -p "$OUT"
REPORT="$OUT/report.md"
RECIPE=${RECIPE:-cifar10-tutorial}
MAX_TIME=${MAX_TIME:-600}
status=0
section() { printf '\n## %s\n\n```\n' "$1" >>"$REPORT"; }
run() {  # the command, its output into the report, its exit status remembered
    echo "\$ $*" >>"$REPORT"
    "$@" >>"$REPORT" 2>&1 || { echo "(exit status $?)" >>"$REPORT"; status=1; }
    printf '```\n' >>"$REPORT"
}
echo "# GPU acceptance, $(date -u +%Y-%m-%dT%H:%MZ), $(hostname), $GPUS GPU(s)" >"$REPORT"
section "GPU tests"
run $PY -m pytest -q -m gpu tests -p no:cacheprovider -n 0  # one at a time: they share the GPUs
section "paratrain doctor"
run $PY -m paratrain doctor --out "$OUT/doctor"
CONFIGS="cpu:1t,gpu:1"
[ "$GPUS" -gt 1 ] && CONFIGS="$CONFIGS,gpu:$GPUS,tower-gpu:$GPUS,fsdp-gpu:$GPUS"
if [ -n "${DATA:-}" ] && [ -d "$DATA/cifar-10-batches-bin" ]; then
    BENCH_DATA=(--model cifar10-net --dataset cifar10 --data-dir "$DATA/cifar-10-batches-bin")
else
    BENCH_DATA=(--dataset synthetic)
fi
section "paratrain bench ($CONFIGS)"
run $PY -m paratrain bench "${BENCH_DATA[@]}" --configs "$CONFIGS" --steps 300 --repeats 3 --out "$OUT/bench"
section "recipe $RECIPE for at most $MAX_TIME s"
if [ -n "${DATA:-}" ] && [ -d "$DATA/cifar-10-batches-bin" ]; then
    run $PY -m paratrain train --recipe "$RECIPE" --data-dir "$DATA/cifar-10-batches-bin" --max-time "$MAX_TIME" \
        --no-tensorboard --overwrite --out "$OUT/recipe"
else
    echo "left out: give DATA=FOLDER holding cifar-10-batches-bin/" >>"$REPORT"
    printf '```\n' >>"$REPORT"
fi
section "the gpt on 1 GPU in bf16: tokens/s and MFU"
# text: the repository's documentation; a 6-layer, 384-wide gpt, bf16 autocast, 300 steps
cat docs/*.md docs/*/*.md README.md >"$OUT/text.txt" 2>/dev/null
run $PY -m paratrain train --dataset text --data-dir "$OUT/text.txt" --model gpt --width 384 --depth 6 --heads 6 \
    --context 256 --batch-size 64 --optimizer adamw --lr 1e-3 --precision bf16 --devices 1 --steps 300 \
    --log-every 100 --no-tensorboard --overwrite --out "$OUT/gpt"
run $PY -c "import json; s = json.load(open('$OUT/gpt/summary.json')); print({k: s.get(k) for k in ('tokens_per_sec', 'flops_per_token', 'achieved_flops_per_sec', 'peak_of', 'mfu', 'val_loss', 'val_perplexity')})"
GPT=($PY -m paratrain train --dataset text --data-dir "$OUT/text.txt" --model gpt --width 384 --depth 6 --heads 6
     --context 256 --batch-size 64 --optimizer adamw --lr 1e-3 --steps 200 --log-every 100 --no-tensorboard --overwrite)
FIGURES="import json, sys; s = json.load(open(sys.argv[1])); print({k: s.get(k) for k in ('precision', 'tokens_per_sec', 'peak_of', 'mfu', 'val_loss', 'pipeline')})"
for precision in 32 tf32; do
    section "the gpt on 1 GPU, --precision $precision: tokens/s and MFU"
    run "${GPT[@]}" --precision "$precision" --devices 1 --out "$OUT/gpt-$precision"
    run $PY -c "$FIGURES" "$OUT/gpt-$precision/summary.json"
done
if [ "$GPUS" -gt 1 ]; then
    # TORCH_NCCL_BLOCKING_WAIT=1 (runtime/dist.py) makes a timed-out collective the run's one line; its cost is the
    # host waiting for each collective a step waits on: the two rows say what that costs here
    # (fsdp and tp wait on a collective a layer, ddp on its buckets once a step: the cost differs by layout)
    for strategy in ddp fsdp tp; do
        for blocking in 1 0; do
            section "the gpt on $GPUS GPUs (--strategy $strategy), bf16, TORCH_NCCL_BLOCKING_WAIT=$blocking"
            run env TORCH_NCCL_BLOCKING_WAIT=$blocking "${GPT[@]}" --precision bf16 --strategy "$strategy" \
                --devices "$GPUS" --out "$OUT/gpt-$strategy-wait$blocking"
            run $PY -c "$FIGURES" "$OUT/gpt-$strategy-wait$blocking/summary.json"
        done
    done
    section "the gpt cut into a 2-stage pipeline (--mesh pp=2, 8 micro-batches), bf16: the measured bubble"
    run "${GPT[@]}" --precision bf16 --mesh pp=2 --microbatches 8 --out "$OUT/gpt-pp"
    run $PY -c "$FIGURES" "$OUT/gpt-pp/summary.json"
    section "the gpt split over $GPUS GPUs by tensor parallelism (--strategy tp), bf16"
    run $PY -m paratrain train --dataset text --data-dir "$OUT/text.txt" --model gpt --width 384 --depth 6 --heads 6 \
        --context 256 --batch-size 64 --optimizer adamw --lr 1e-3 --precision bf16 --strategy tp --devices "$GPUS" \
        --steps 300 --log-every 100 --no-tensorboard --overwrite --out "$OUT/gpt-tp"
    run $PY -c "import json; s = json.load(open('$OUT/gpt-tp/summary.json')); print({k: s.get(k) for k in ('mesh', 'weight_bytes_per_worker', 'tokens_per_sec', 'mfu', 'val_loss')})"
fi
echo "gpu_acceptance: report in $REPORT (exit status $status)"
exit $status
