"""`tokenmill run` and `tokenmill ledger show`, in-process through click's runner."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tokenmill.cli import main
from tokenmill.cli.options import parse_key_values
from tokenmill.pipelines import job as job_mod
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.output import read_results

ENGINE = ["--engine-option", f"kv_cache_memory={8 << 20}", "--dtype", "float32"]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b", "c", "d"],
                "question": ["What is 2+2?", None, "Name a colour.", "Say hi."],
                "topic": ["math", "none", "art", "chat"],
            }
        ),
        path,
    )
    return path


def test_run_then_ledger_show(tmp_path, data, tiny_model_dir):
    out = tmp_path / "out"
    runner = CliRunner()
    args = [
        "run",
        str(data),
        str(out),
        "--model",
        str(tiny_model_dir),
        "--prompt-column",
        "question",
        "--id-column",
        "id",
        "--passthrough",
        "topic",
        "--system",
        "Be brief.",
        "--max-tokens",
        "5",
        "--price-input",
        "0.5",
        "--price-output",
        "1.5",
        "--price-device-hour",
        "2",
        "--no-progress",
        *ENGINE,
    ]
    result = runner.invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "3 ok, 1 failed" in result.output and "cost (device time)" in result.output
    results = read_results(str(out)).to_pylist()
    assert {r["id"]: r["topic"] for r in results} == {
        "a": "math",
        "b": "none",
        "c": "art",
        "d": "chat",
    }
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["price_input_per_1m"] == 0.5 and ledger["rows_failed"] == 1

    again = runner.invoke(main, [*args, "--json"], catch_exceptions=False)
    assert again.exit_code == 0
    assert json.loads(again.stdout[again.stdout.index("{") :])["num_shards_run"] == 0

    shown = runner.invoke(main, ["ledger", "show", str(out / "ledger")], catch_exceptions=False)
    assert shown.exit_code == 0 and ledger["job_id"] in shown.output and "1 job(s)" in shown.output
    as_json = runner.invoke(main, ["ledger", "show", str(out / "ledger.json"), "--json"])
    assert json.loads(as_json.output)["job_id"] == ledger["job_id"]


def test_bad_column_is_a_clean_error_before_the_model(tmp_path, data, monkeypatch):
    monkeypatch.setattr(llm_cache, "get_llm", lambda *a, **k: pytest.fail("model loaded"))
    result = CliRunner().invoke(
        main, ["run", str(data), str(tmp_path / "out"), "--prompt-column", "nope"]
    )
    assert result.exit_code == 1
    assert (
        "in.parquet: column(s) 'nope' not found; available columns: id, question, topic"
        in result.output
    )
    assert "Traceback" not in result.output


def test_ledger_show_empty(tmp_path):
    result = CliRunner().invoke(main, ["ledger", "show", str(tmp_path / "none")])
    assert result.exit_code == 0 and "no jobs recorded" in result.output


def test_parse_key_values():
    flag = "--storage-option"
    assert parse_key_values(("anon=true", "endpoint_url=http://x:1", "n=3"), flag=flag) == {
        "anon": True,
        "endpoint_url": "http://x:1",
        "n": 3,
    }
    with pytest.raises(ValueError, match="KEY=VALUE") as err:
        parse_key_values(("supersecret",), flag=flag)
    assert "supersecret" not in str(err.value)


def test_a_malformed_pair_is_a_usage_error_that_does_not_echo_it(tmp_path, data):
    args = ["run", str(data), str(tmp_path / "out"), "--storage-option", "supersecret"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "--storage-option must be KEY=VALUE" in result.output
    assert "supersecret" not in result.output


def test_plan_window_rows_reaches_the_job(tmp_path, data, monkeypatch):
    seen = {}

    def fake_run_job(input, output, **options):
        seen.update(options)
        raise ValueError("stop here")

    monkeypatch.setattr(job_mod, "run_job", fake_run_job)
    args = ["run", str(data), str(tmp_path / "out"), "--no-progress"]
    result = CliRunner().invoke(main, [*args, "--plan-window-rows", "1000"])
    assert result.exit_code == 1 and "stop here" in result.output
    assert seen["plan_window_rows"] == 1000
    seen.clear()
    CliRunner().invoke(main, args)
    assert "plan_window_rows" not in seen  # unset: the JobSpec default
    refused = CliRunner().invoke(main, [*args, "--plan-window-rows", "0"])
    assert refused.exit_code == 2 and "--plan-window-rows" in refused.output


def test_a_job_whose_engine_cannot_fit_fails_before_the_load_with_the_numbers(
    tmp_path, tiny_model_dir
):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2+2?"]}), src)
    args = ["run", str(src), str(tmp_path / "out"), "--model", str(tiny_model_dir)]
    args += ["--engine-option", f"kv_cache_memory={1 << 50}"]  # a petabyte of cache
    for extra in ([], ["--dry-run"], ["--dry-run", "--no-calibrate"]):
        refused = CliRunner().invoke(main, [*args, *extra])
        assert refused.exit_code == 1, refused.output
        assert "does not fit in this machine's memory" in refused.output
        assert "KV cache 1048576.00 GiB" in refused.output and "RAM available" in refused.output
    assert not (tmp_path / "out" / "ledger").exists()


def test_dry_run_then_run_then_ledger_show_lists_forecast_and_actual(tmp_path, tiny_model_dir):
    src = tmp_path / "in.parquet"
    prompts = ["What is 2+2?", "Name a colour.", "What is 2+2?", "Say hi."]
    pq.write_table(pa.table({"prompt": prompts}), src)
    out = tmp_path / "out"
    args = ["run", str(src), str(out), "--model", str(tiny_model_dir), *ENGINE]
    args += ["--max-tokens", "4", "--price-input", "1", "--price-output", "2"]
    runner = CliRunner()
    dry = runner.invoke(main, [*args, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    forecast = json.loads(dry.stdout)
    assert forecast["rows_deduplicated"] == 1 and forecast["calibration_rows"] >= 1
    assert sorted(p.name for p in out.iterdir()) == ["_forecast.json"]
    table = runner.invoke(main, [*args, "--dry-run", "--no-calibrate"])
    assert "forecast of job" in table.stdout and "(exact)" in table.stdout
    assert "│ memory " in table.stdout and "KiB (float32) + KV cache 8 MiB" in table.stdout
    assert runner.invoke(main, args).exit_code == 0
    shown = runner.invoke(main, ["ledger", "show", str(out / "ledger")], catch_exceptions=False)
    assert "cost fcst" in shown.output and "dedup" in shown.output
    unpriced = tmp_path / "unpriced"
    run = runner.invoke(
        main, ["run", str(src), str(unpriced), "--model", str(tiny_model_dir), *ENGINE]
    )
    assert run.exit_code == 0 and "no prices set" in run.stdout and "$0.00" not in run.stdout
    shown = runner.invoke(main, ["ledger", "show", str(unpriced / "ledger")])
    assert "no prices set" in shown.output


def test_dry_run_states_how_many_rows_run_at_once_from_the_kv_cache(tmp_path, tiny_model_dir):
    """max_num_seqs unset: the dry run's number is the KV blocks over the blocks of the
    job's longest prompt + max_tokens; set, it is the setting, said as such."""
    import torch

    from tokenmill.engine import load_config
    from tokenmill.engine.worker.kv_cache import kv_cache_format

    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["Name a colour."]}), src)
    block_bytes = kv_cache_format("auto").bytes_per_block(
        load_config(tiny_model_dir), 16, torch.float32
    )
    args = ["run", str(src), str(tmp_path / "out"), "--model", str(tiny_model_dir)]
    args += ["--dtype", "float32", "--max-tokens", "40", "--dry-run", "--no-calibrate"]
    args += ["--engine-option", f"kv_cache_memory={21 * block_bytes}"]
    forecast = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)
    longest = forecast["prompt_tokens"] + 40
    assert forecast["cache_blocks"] == 21 and forecast["longest_row_tokens"] == longest
    assert forecast["max_num_seqs"] is None
    rows = 21 // -(-longest // 16)
    assert 1 < rows < 21
    table = CliRunner().invoke(main, args, env={"COLUMNS": "400"})
    assert table.exit_code == 0, table.output
    assert (
        f"{rows}: 21 KV blocks of 16 tokens hold {rows} rows of {longest} tokens (the "
        "longest prompt + max_tokens); max_num_seqs unset, so none is preempted"
    ) in table.output
    set_ = CliRunner().invoke(
        main, [*args, "--engine-option", "max_num_seqs=3"], env={"COLUMNS": "400"}
    )
    assert set_.exit_code == 0, set_.output
    assert "3 (max_num_seqs as set" in set_.output
