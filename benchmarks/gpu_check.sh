#!/usr/bin/env bash
# tokenmill on one NVIDIA GPU, as one script a lent device runs: the GPU tests, greedy
# correctness of the real default model against the CPU path, throughput against HF
# transformers (and vLLM where it is installed) and where the GPU's time goes.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # default OUT_DIR: $OUT or /tmp/tokenmill-gpu
#
# Environment knobs:
#   PYTHON=python3      interpreter with a CUDA torch and Triton (tokenmill is installed
#                       from this checkout if it is not importable)
#   MODEL=...           model: alias, HF-layout dir or .gguf (default: the default model)
#   WHEELS=.devcarry    a folder of wheels to install first (offline machines)
#   STEPS="..."         the steps, in order: tests, correctness, bench:PRESET[:ROUNDS],
#                       profile[:no-graphs|no-overlap] (default: all of them)
#   REPEAT=2            benchmark rounds where a bench step names none
#   VLLM_PYTHON=...     an interpreter with vLLM, to add it as a baseline
#
# Every step may fail without stopping the others; summary.txt says what ran. The exit
# status is non-zero when a step failed.

set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/tokenmill-gpu}}
mkdir -p "$OUT_DIR"
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-tests correctness bench:mixed64 bench:prefix-heavy bench:mixed1k profile profile:no-graphs profile:no-overlap}
REPEAT=${REPEAT:-2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1 TOKENMILL_CACHE_DIR=${TOKENMILL_CACHE_DIR:-/tmp/tokenmill-cache}
START=$SECONDS
STATUS=0
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$OUT_DIR/summary.txt"; }

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT_DIR/summary.txt"
if [[ -n "${WHEELS:-}" && -d "$WHEELS" ]] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target /tmp/tokenmill-site "$WHEELS"/*.whl \
        2>&1 | tail -2
    export PYTHONPATH=/tmp/tokenmill-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PYTHON" -c "import tokenmill.engine.api.llm" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
fi
"$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import torch, triton, tokenmill
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"tokenmill {tokenmill.__version__}, device {torch.cuda.get_device_name(0)}")
PY

run_tests() {
    log "tests: pytest -m gpu tests/gpu"
    if timeout 600 "$PYTHON" -m pytest -m gpu tests/gpu -q -rA -p no:cacheprovider \
            >"$OUT_DIR/tests.log" 2>&1; then
        log "tests: ok - $(tail -1 "$OUT_DIR/tests.log")"
    else
        log "tests: FAILED - $(tail -1 "$OUT_DIR/tests.log")"; STATUS=1
    fi
    grep -E "bf16 == fp32|PASSED|FAILED|Error" "$OUT_DIR/tests.log" | head -40 >>"$OUT_DIR/summary.txt"
}

resolve_model() {
    [[ -n "${MODEL_DIR:-}" ]] && return 0
    if ! MODEL_DIR=$("$PYTHON" -c "
import sys
from tokenmill.engine.loader.model_files import resolve_model
print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))" ${MODEL:+"$MODEL"} 2>"$OUT_DIR/model.err"); then
        log "no model: $(tail -1 "$OUT_DIR/model.err")"; exit 2
    fi
    log "model: $MODEL_DIR"
}

run_correctness() {
    resolve_model
    log "correctness: CUDA greedy vs CPU fp32 on the real model"
    if timeout 300 "$PYTHON" benchmarks/gpu_correctness.py --model "$MODEL_DIR" \
            --json "$OUT_DIR/correctness.json" >>"$OUT_DIR/summary.txt" 2>"$OUT_DIR/correctness.err"; then
        log "correctness: ok"
    else
        log "correctness: FAILED - $(tail -1 "$OUT_DIR/correctness.err")"; STATUS=1
    fi
}

run_bench() {  # PRESET ROUNDS
    resolve_model
    local preset=$1 rounds=$2 baselines=hf-bf16 vllm_args=()
    if [[ -n "${VLLM_PYTHON:-}" ]] && "$VLLM_PYTHON" -c "import vllm" 2>/dev/null; then
        baselines=vllm,hf-bf16; vllm_args=(--vllm-python "$VLLM_PYTHON")
    fi
    log "bench: $preset, bf16, baselines $baselines, $rounds round(s)"
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 200 \
        >"$OUT_DIR/gpu_util_$preset.csv" 2>/dev/null &
    local smi=$!
    if timeout 420 "$PYTHON" -c "from tokenmill.cli import main; main()" bench --device cuda \
            --preset "$preset" --dtype bfloat16 --baseline "$baselines" --hf-batch-size 64 \
            --repeat "$rounds" --timeout 300 --model "$MODEL_DIR" ${vllm_args[@]+"${vllm_args[@]}"} \
            --json "$OUT_DIR/bench_$preset.json" >>"$OUT_DIR/summary.txt" 2>"$OUT_DIR/bench_$preset.err"; then
        log "bench $preset: ok"
    else
        log "bench $preset: FAILED - $(tail -1 "$OUT_DIR/bench_$preset.err")"; STATUS=1
    fi
    kill "$smi" 2>/dev/null
}

run_profile() {  # [FLAG]: --no-graphs or --no-overlap
    resolve_model
    local name=profile${1:-}
    log "profile: mixed1k bf16 ${1:-}"
    if timeout 240 "$PYTHON" benchmarks/gpu_profile.py --model "$MODEL_DIR" --preset mixed1k \
            ${1:-} --json "$OUT_DIR/$name.json" >/dev/null 2>"$OUT_DIR/$name.err"; then
        "$PYTHON" -c "
import json, sys
r = json.load(open(sys.argv[1]))
print(f\"  {r['tokens_per_s']:,.0f} tok/s, wall {r['wall_s']:.2f} s, GPU busy {r['gpu_busy_share']:.0%}, \"
      + ', '.join(f'{k} {v:.3f} s' for k, v in r['kernel_s_by_kind'].items()))" "$OUT_DIR/$name.json" \
            | tee -a "$OUT_DIR/summary.txt"
    else
        log "profile ${1:-}: FAILED - $(tail -1 "$OUT_DIR/$name.err")"; STATUS=1
    fi
}

# Steps run in the order given: tests, correctness, bench:PRESET[:ROUNDS], profile[:FLAG].
for item in $STEPS; do
    IFS=: read -r name arg1 arg2 <<<"$item"
    case $name in
        tests) run_tests ;;
        correctness) run_correctness ;;
        bench) run_bench "${arg1:-mixed1k}" "${arg2:-$REPEAT}" ;;
        profile) run_profile ${arg1:+--$arg1} ;;
        *) log "unknown step $item"; STATUS=1 ;;
    esac
done

log "done in $((SECONDS - START)) s"
exit $STATUS
