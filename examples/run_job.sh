#!/usr/bin/env bash
# The example batch job: 40 short questions answered by the default model
# (SmolLM2-135M-Instruct, converted from its GGUF on first use), with a shared system
# prompt so that the prefix cache serves most prompt tokens after the first few rows.
#
#   bash examples/run_job.sh [OUTPUT]        (default OUTPUT: out/example-job)
#
# Results: OUTPUT/results/*.parquet; ledger: OUTPUT/ledger.json and OUTPUT/ledger/.
# Run it again to see a resumed job skip every shard; `tokenmill ledger show
# OUTPUT/ledger` prints the ledger dataset. Prices are illustrative (USD per 1M tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTPUT="${1:-out/example-job}"

tokenmill run examples/prompts.jsonl "$OUTPUT" \
  --prompt-column question \
  --id-column id \
  --passthrough topic \
  --system "You are a friendly, knowledgeable assistant for a general audience. Answer the user's question correctly in one or two short sentences. Do not repeat the question, do not add disclaimers, and keep the wording simple and clear." \
  --max-tokens 48 \
  --price-input 0.15 --price-cached 0.075 --price-output 0.60

tokenmill ledger show "$OUTPUT/ledger"
