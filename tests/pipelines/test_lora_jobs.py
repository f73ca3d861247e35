"""Jobs with LoRA adapters: `--lora NAME=PATH` and `--lora-column`, OpenAI batch lines
choosing by body.model, the results' adapter column, the ledger's per-adapter split,
resume refused after an adapter changed, and bad adapters failing before any compute."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from peft_adapters import ALL_TARGETS, save_adapter

from tokenmill import LoRARequest, SamplingParams
from tokenmill.cli import main
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.notebook import generate, score
from tokenmill.pipelines.output import read_ledger, read_ledger_dataset, read_results

ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 8 << 20}}
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hi.", "Count to three.", "Who are you?"]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("job-adapters")
    return {
        "fr": save_adapter(tiny_model_dir, out / "fr", r=4, targets=ALL_TARGETS, seed=1, b_std=1.0),
        "de": save_adapter(tiny_model_dir, out / "de", r=8, seed=2, b_std=1.0),
    }


@pytest.fixture
def data(tmp_path):
    names = ["fr", "de", None, "fr", "nope", "de", None, "fr", "de", "fr"]
    rows = {
        "id": [f"r{i}" for i in range(len(names))],
        "question": [QUESTIONS[i % len(QUESTIONS)] for i in range(len(names))],
        "adapter_name": names,
    }
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table(rows), path)
    return path


def lora_args(adapters) -> list[str]:
    return [arg for name, a in adapters.items() for arg in ("--lora", f"{name}={a.path}")]


def job_args(data, out, model, adapters) -> list[str]:
    return [
        "run",
        str(data),
        str(out),
        "--model",
        str(model),
        "--prompt-column",
        "question",
        "--id-column",
        "id",
        *lora_args(adapters),
        "--lora-column",
        "adapter_name",
        "--max-tokens",
        "6",
        "--shard-tokens",
        "60",
        "--price-input",
        "0.5",
        "--price-cached",
        "0.25",
        "--price-output",
        "1.5",
        "--dtype",
        "float32",
        "--engine-option",
        f"kv_cache_memory={8 << 20}",
    ]


def test_cli_job_runs_each_row_with_its_adapter(tmp_path, data, tiny_model_dir, adapters):
    adapters = _copies(adapters, tmp_path)  # one is changed on disk at the end
    out = tmp_path / "out"
    result = CliRunner().invoke(main, job_args(data, out, tiny_model_dir, adapters))
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert [rows[f"r{i}"]["adapter"] for i in range(10)] == [
        "fr", "de", None, "fr", None, "de", None, "fr", "de", "fr"
    ]  # fmt: skip
    assert rows["r4"]["finish_reason"] == "error"
    assert "LoRA adapter 'nope' is not one of the job's adapters (de, fr)" in rows["r4"]["error"]
    # Equal prompts under different adapters (r0 fr / r5 de, ...) are not duplicates: each
    # is computed and billed (dedupe is on by default).
    assert all(r.get("duplicate_of") is None for r in rows.values())
    assert rows["r5"]["prompt_tokens"] > 0 and rows["r0"]["output"] != rows["r5"]["output"]

    # The answers are the engine's for each row's adapter, asked directly.
    llm = llm_cache.get_llm(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20).llm
    requests = [LoRARequest(name, adapters[name].path) for name in ("fr", "de")] + [None]
    direct = llm.chat(
        [[{"role": "user", "content": QUESTIONS[i]}] for i in range(3)],
        SamplingParams(temperature=0, max_tokens=6),
        lora_request=requests,
    )
    assert [rows[i]["output"] for i in ("r0", "r1", "r2")] == [o.text for o in direct]
    base = llm.chat(
        [[{"role": "user", "content": QUESTIONS[i]}] for i in range(2)],
        SamplingParams(temperature=0, max_tokens=6),
    )
    assert [o.text for o in base] != [o.text for o in direct[:2]]  # the adapters matter

    # The ledger splits rows, tokens and costs per adapter; the split sums to the totals.
    ledger = read_ledger(str(out))
    split = {entry["adapter"]: entry for entry in ledger.adapters}
    assert list(split) == [None, "de", "fr"]
    assert split["fr"]["weights_hash"] and split[None]["weights_hash"] is None
    assert (split[None]["rows_ok"], split[None]["rows_failed"]) == (2, 1)
    assert (split["fr"]["rows_ok"], split["de"]["rows_ok"]) == (4, 3)
    fields = ["rows_ok", "rows_failed", "prompt_tokens", "cached_tokens", "completion_tokens"]
    fields += ["cost_input", "cost_cached_input", "cost_output", "cost_total"]
    for name in fields:
        assert sum(e[name] for e in ledger.adapters) == pytest.approx(getattr(ledger, name)), name
    for adapter in ("fr", "de"):
        mine = [r for r in rows.values() if r["adapter"] == adapter]
        assert split[adapter]["prompt_tokens"] == sum(r["prompt_tokens"] for r in mine)
    # The ledger dataset row holds the split as JSON text.
    dataset = read_ledger_dataset(str(out / "ledger"))
    assert json.loads(dataset["adapters"][0].as_py()) == ledger.adapters

    # Rerun: complete, nothing computed. After an adapter changed: refused.
    again = CliRunner().invoke(main, [*job_args(data, out, tiny_model_dir, adapters), "--json"])
    assert again.exit_code == 0, again.output
    assert read_ledger(str(out)).num_shards_run == 0
    _change_weights(adapters["de"].path)
    changed = CliRunner().invoke(main, job_args(data, out, tiny_model_dir, adapters))
    assert changed.exit_code != 0
    assert "not shards of this job" in changed.output


def _copies(adapters, tmp_path):
    """The adapters copied into tmp_path (the module's own stay as they are)."""
    import dataclasses
    import shutil

    return {
        name: dataclasses.replace(a, path=shutil.copytree(a.path, tmp_path / "copies" / name))
        for name, a in adapters.items()
    }


def _change_weights(path) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "adapter_model.safetensors"
    tensors = {k: v + 0.5 for k, v in load_file(file).items()}
    save_file(tensors, file)


def test_an_empty_csv_adapter_cell_runs_the_base_model(tmp_path, tiny_model_dir, adapters):
    # CSV has no null: an empty cell names no adapter, as a null does in Parquet.
    src = tmp_path / "in.csv"
    src.write_text(f"id,question,adapter_name\nr0,{QUESTIONS[0]},fr\nr1,{QUESTIONS[1]},\n")
    out = tmp_path / "out"
    run_job(
        str(src),
        str(out),
        model=str(tiny_model_dir),
        prompt_column="question",
        id_column="id",
        lora={name: str(a.path) for name, a in adapters.items()},
        lora_column="adapter_name",
        max_tokens=6,
        **ENGINE,
    )
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert (rows["r0"]["adapter"], rows["r1"]["adapter"]) == ("fr", None)
    assert rows["r1"]["error"] is None
    llm = llm_cache.get_llm(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20).llm
    greedy = SamplingParams(temperature=0, max_tokens=6)
    base = llm.chat([[{"role": "user", "content": QUESTIONS[1]}]], greedy)
    assert rows["r1"]["output"] == base[0].text


def test_notebook_generate_matches_the_job(tmp_path, data, tiny_model_dir, adapters):
    table = pq.read_table(data)
    # The same job definition through both surfaces.
    options = dict(
        model=str(tiny_model_dir),
        prompt_column="question",
        id_column="id",
        lora={name: str(a.path) for name, a in adapters.items()},
        lora_column="adapter_name",
        max_tokens=6,
        **ENGINE,
    )
    frame = generate(table, **options)
    ledger = run_job(str(data), str(tmp_path / "out"), **options)
    results = read_results(str(tmp_path / "out")).sort_by("id")
    assert frame["output"].to_list() == results["output"].to_pylist()
    assert frame["adapter"].to_list() == results["adapter"].to_pylist()
    assert ledger.rows_failed == 1


def test_openai_batch_lines_choose_an_adapter_by_model(tmp_path, tiny_model_dir, adapters):
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i, body in enumerate(
            [
                {"model": "fr", "messages": [{"role": "user", "content": "Say hi."}]},
                {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}]},
                {"model": "de", "messages": [{"role": "user", "content": "Say hi."}]},
            ]
        )
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    run_job(
        str(src),
        str(out),
        format="openai-batch",
        output_format="openai-batch",
        model=str(tiny_model_dir),
        lora={name: str(a.path) for name, a in adapters.items()},
        max_tokens=5,
        **ENGINE,
    )
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert [rows[f"c{i}"]["adapter"] for i in range(3)] == ["fr", None, "de"]
    answers = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    models = [a["response"]["body"]["model"] for a in answers]
    assert models == ["fr", tiny_model_dir.name, "de"]


def test_bad_adapters_fail_the_job_before_any_compute(tmp_path, data, tiny_model_dir, adapters):
    import shutil

    cases = {
        "missing": tmp_path / "nothing-here",
        "pickled": tmp_path / "pickled",
        "wrong-model": tmp_path / "wrong",
    }
    shutil.copytree(adapters["de"].path, cases["pickled"])
    (cases["pickled"] / "adapter_model.safetensors").rename(cases["pickled"] / "adapter_model.bin")
    _wider_adapter(cases["wrong-model"])
    messages = {
        "missing": "LoRA adapter 'missing': no adapter at",
        "pickled": "stored only as pickle (adapter_model.bin)",
        "wrong-model": "the model's q_proj takes 64 inputs",
    }
    for name, path in cases.items():
        out = tmp_path / f"out-{name}"
        with pytest.raises(ValueError) as error:
            run_job(
                str(data),
                str(out),
                model=str(tiny_model_dir),
                prompt_column="question",
                lora={name: str(path)},
                **ENGINE,
            )
        assert messages[name] in str(error.value), name
        assert not (out / "results").exists()


def _wider_adapter(out) -> None:
    """An adapter whose q_proj lora_A takes 32 inputs: not this hidden size."""
    from safetensors.torch import save_file

    out.mkdir()
    (out / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(2, 32),
            f"{prefix}.lora_B.weight": torch.zeros(64, 2),
        },
        out / "adapter_model.safetensors",
    )


def test_lora_options_are_checked(tmp_path, data, tiny_model_dir):
    with pytest.raises(ValueError, match="lora_column names adapters"):
        run_job(str(data), str(tmp_path / "o"), lora_column="adapter_name")
    with pytest.raises(ValueError, match="give a directory or Hub repo id"):
        run_job(str(data), str(tmp_path / "o"), lora={"x": 3})


def test_pooling_jobs_refuse_adapters(tmp_path, data, tiny_model_dir, adapters):
    with pytest.raises(ValueError, match="LoRA adapters serve generate and score jobs, not embed"):
        run_job(
            str(data),
            str(tmp_path / "o"),
            task="embed",
            model=str(tiny_model_dir),
            prompt_column="question",
            lora={"fr": str(adapters["fr"].path)},
            **ENGINE,
        )
    assert not (tmp_path / "o" / "results").exists()


def test_a_scoring_job_scores_each_row_under_its_adapter(tmp_path, data, tiny_model_dir, adapters):
    run_job(
        str(data),
        str(tmp_path / "out"),
        task="score",
        model=str(tiny_model_dir),
        prompt_column="question",
        id_column="id",
        lora={name: str(a.path) for name, a in adapters.items()},
        lora_column="adapter_name",
        **ENGINE,
    )
    rows = {r["id"]: r for r in read_results(str(tmp_path / "out")).to_pylist()}
    # r0 (fr) and r5 (de) score QUESTIONS[0]: the same text under different adapters
    # scores differently; r1 (de) and r6 (the base model) likewise.
    assert rows["r0"]["adapter"] == "fr" and rows["r5"]["adapter"] == "de"
    assert rows["r0"]["prompt_tokens"] == rows["r5"]["prompt_tokens"]
    assert rows["r6"]["adapter"] is None
    # Each row scores as the scoring of PEFT's merged model (the base for r6) does, to
    # fp32 rounding: the adapter's own answer, not merely a different one.
    models = {name: _merged_dir(a, tiny_model_dir, tmp_path) for name, a in adapters.items()}
    models[None] = tiny_model_dir
    scored = [r for r in rows.values() if r["error"] is None]
    assert len(scored) == 9  # all but r4, whose adapter is not one of the job's
    for name, model in models.items():
        mine = [r for r in scored if r["adapter"] == name]
        texts = [QUESTIONS[int(r["id"][1:]) % len(QUESTIONS)] for r in mine]
        expected = score(texts, model=str(model), **ENGINE).to_dicts()
        for row, want in zip(mine, expected):
            assert row["prompt_tokens"] == want["prompt_tokens"], row["id"]
            assert row["prompt_logprob_sum"] == pytest.approx(want["prompt_logprob_sum"], abs=1e-3)
            assert row["perplexity"] == pytest.approx(want["perplexity"], rel=1e-4)
    assert rows["r0"]["perplexity"] != pytest.approx(rows["r5"]["perplexity"], rel=1e-2)
    assert rows["r1"]["perplexity"] != pytest.approx(rows["r6"]["perplexity"], rel=1e-2)


def _merged_dir(adapter, base_dir, tmp_path):
    """PEFT's merged model of `adapter` as a model directory (the base's tokenizer files)."""
    import shutil

    out = tmp_path / f"merged-{adapter.name}"
    adapter.merged.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out / name)
    return out
