"""The shipped examples: the prompt dataset is well formed, and the example job runs."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from tokenmill.pipelines.job import run_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_prompt_dataset_is_well_formed():
    rows = [json.loads(line) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 40
    assert len({r["id"] for r in rows}) == 40
    assert all(set(r) == {"id", "topic", "question"} and r["question"].strip() for r in rows)


def test_example_job_on_tiny_model(tmp_path, tiny_model_dir):
    script = (EXAMPLES / "run_job.sh").read_text()
    system = shlex.split(script[script.index("--system") :])[1]
    ledger = run_job(
        str(EXAMPLES / "prompts.jsonl"),
        str(tmp_path / "out"),
        model=str(tiny_model_dir),
        prompt_column="question",
        id_column="id",
        passthrough=["topic"],
        system=system,
        max_tokens=4,
        dtype="float32",
        engine_options={"kv_cache_memory": 8 << 20},
    )
    assert ledger.rows_ok == 40 and ledger.prefix_cache_hit_rate > 0.3


@pytest.mark.slow
def test_example_job_script_on_default_model(tmp_path):
    """The README's command: the real SmolLM2-135M-Instruct, converted on first use."""
    out = tmp_path / "example-job"
    subprocess.run(["bash", str(EXAMPLES / "run_job.sh"), str(out)], check=True, timeout=1800)
    ledger = json.loads((out / "ledger.json").read_text())
    assert ledger["rows_ok"] == 40 and ledger["rows_failed"] == 0
    assert ledger["cached_tokens"] > 0 and ledger["cost_total"] > 0
