"""A job with LoRA adapters as a flow run (against the real Prefect server) and as a CLI
run with the same options: the same answers, the same adapter per row, the same ledger
split."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from flow_helpers import ENGINE, job_parameters, prompt_rows
from peft_adapters import ALL_TARGETS, save_adapter

from tokenmill.cli import main
from tokenmill.flows import batch_inference
from tokenmill.pipelines.output import read_ledger, read_results

pytestmark = pytest.mark.integration


def test_flow_and_cli_give_the_same_answers(prefect_api, tiny_model, tmp_path):
    adapters = {
        "fr": save_adapter(
            tiny_model, tmp_path / "fr", r=4, targets=ALL_TARGETS, seed=1, b_std=1.0
        ),
        "de": save_adapter(tiny_model, tmp_path / "de", r=8, seed=2, b_std=1.0, merge=False),
    }
    names = ["fr", "de", None, "missing"]
    rows = [{**row, "adapter_name": names[i % 4]} for i, row in enumerate(prompt_rows())]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lora = {name: str(a.path) for name, a in adapters.items()}

    flow_out = tmp_path / "flow-out"
    params = job_parameters(
        str(src), str(flow_out), tiny_model, lora=lora, lora_column="adapter_name"
    )
    state = batch_inference(**params, return_state=True)
    assert state.is_completed(), state.message

    cli_out = tmp_path / "cli-out"
    args = ["run", str(src), str(cli_out), "--model", tiny_model, "--id-column", "id"]
    args += ["--passthrough", "topic", "--max-tokens", "6", "--shard-tokens", "48"]
    args += ["--price-input", "0.5", "--price-cached", "0.25", "--price-output", "1.5"]
    args += ["--dtype", ENGINE["dtype"], "--lora-column", "adapter_name"]
    args += ["--engine-option", f"kv_cache_memory={ENGINE['engine_options']['kv_cache_memory']}"]
    for name, path in lora.items():
        args += ["--lora", f"{name}={path}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

    by_flow = read_results(str(flow_out)).sort_by("id").to_pylist()
    by_cli = read_results(str(cli_out)).sort_by("id").to_pylist()
    columns = ("id", "output", "finish_reason", "adapter", "prompt_tokens", "completion_tokens")
    assert [[r[c] for c in columns] for r in by_flow] == [[r[c] for c in columns] for r in by_cli]
    assert {r["adapter"] for r in by_flow} == {"fr", "de", None}
    missing = [r["id"] for r in by_flow if r["error"] and "'missing'" in r["error"]]
    assert missing == ["q003", "q011", "q015"]  # q007 names it too, and has no prompt

    flow_ledger, cli_ledger = read_ledger(str(flow_out)), read_ledger(str(cli_out))
    tokens = ("adapter", "rows_ok", "rows_failed", "prompt_tokens", "completion_tokens")
    assert [[e[k] for k in tokens] for e in flow_ledger.adapters] == [
        [e[k] for k in tokens] for e in cli_ledger.adapters
    ]
    for name in ("rows_ok", "rows_failed", "prompt_tokens", "cached_tokens", "completion_tokens"):
        assert sum(e[name] for e in flow_ledger.adapters) == getattr(flow_ledger, name)
