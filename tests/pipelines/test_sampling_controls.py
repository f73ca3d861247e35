"""Penalties, logit bias, allowed tokens, bad words and logprobs as job options: the same
on `tokenmill run`, the flow, `tokenmill.generate` and run_job, into SamplingParams."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from click.testing import CliRunner

from tokenmill.cli import main
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.flows import batch_inference
from tokenmill.flows.parameters import build_spec
from tokenmill.pipelines import job as job_mod
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.notebook import generate
from tokenmill.pipelines.plan import params_key
from tokenmill.pipelines.spec import JobSpec

CONTROLS = {
    "repetition_penalty": 1.2,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "logit_bias": {28: -100.0, 5: 2.5},
    "allowed_token_ids": [1, 2, 28],
    "bad_words": ["foo", "bar baz"],
    "logprobs": 3,
}


def _assert_controls(params: SamplingParams) -> None:
    for name, value in CONTROLS.items():
        assert getattr(params, name) == value, name


def test_the_cli_flags_reach_the_job(tmp_path, monkeypatch):
    seen = {}

    def fake_run_job(input, output, **options):
        seen.update(options)
        raise ValueError("stop here")

    monkeypatch.setattr(job_mod, "run_job", fake_run_job)
    args = ["run", "in.parquet", str(tmp_path / "out"), "--no-progress"]
    flags = [
        *("--repetition-penalty", "1.2", "--presence-penalty", "0.5"),
        *("--frequency-penalty", "-0.25", "--logit-bias", "28=-100", "--logit-bias", "5=2.5"),
        *("--allowed-token-ids", "1", "--allowed-token-ids", "2", "--allowed-token-ids", "28"),
        *("--bad-words", "foo", "--bad-words", "bar baz", "--logprobs", "3"),
    ]
    result = CliRunner().invoke(main, [*args, *flags])
    assert result.exit_code == 1 and "stop here" in result.output
    seen.pop("progress", None)  # the command's own flag, not a job option
    _assert_controls(JobSpec("in.parquet", "out", **seen).sampling)
    refused = CliRunner().invoke(main, [*args, "--presence-penalty", "2.5"])
    assert refused.exit_code == 2 and "--presence-penalty" in refused.output
    help_text = CliRunner().invoke(main, ["run", "--help"]).output
    assert "--logit-bias TOKEN_ID=BIAS" in help_text


def test_the_flow_takes_them_as_parameters():
    props = batch_inference.parameters.model_dump()["properties"]
    assert props["presence_penalty"]["minimum"] == -2 and props["presence_penalty"]["maximum"] == 2
    assert props["repetition_penalty"]["exclusiveMinimum"] == 0
    values = {**CONTROLS, "logit_bias": {"28": -100, "5": 2.5}}  # JSON object keys are text
    params = batch_inference.validate_parameters({"input": "in.jsonl", "output": "out", **values})
    del params["input"], params["output"]
    spec = build_spec("in.jsonl", "out", scheduled=datetime.now(timezone.utc), **params)
    _assert_controls(spec.sampling)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"logit_bias": {"x": 1}}, "logit_bias: logit_bias keys must be token ids"),
        ({"logit_bias": {"3": 200}}, r"must be in \[-100, 100\]"),
        ({"frequency_penalty": 3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"bad_words": [""]}, "bad_words must be non-empty strings"),
    ],
)
def test_bad_values_are_refused_before_any_work(options, message):
    with pytest.raises(ValueError, match=message):
        JobSpec("in.parquet", "out", **options)


def test_unset_controls_leave_a_jobs_params_key_as_it_was():
    """Shard ids hash the params' key: a job that uses none of the controls resumes its
    earlier results."""
    key = params_key(SamplingParams(temperature=0, max_tokens=8))
    assert not any(name in key for name in CONTROLS if name != "logprobs")
    assert params_key(SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5)) != key
    assert JobSpec("in.parquet", "out").sampling.allowed_token_ids is None


def test_generate_bans_a_token_and_gives_logprobs(tiny_model_dir):
    llm = llm_cache.get_llm(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20).llm
    prompts = ["The quick brown fox", "Numbers: 1 2 3"]
    free = generate(prompts, llm=llm, max_tokens=6)
    first_ids = [llm.tokenizer.encode(text, add_special_tokens=False)[0] for text in free["output"]]
    banned = generate(
        prompts,
        llm=llm,
        max_tokens=6,
        logit_bias={first_ids[0]: -100},
        logprobs=2,
    )
    assert banned["output"][0] != free["output"][0]
    steps = banned["logprobs"][0]
    assert len(steps) == banned["completion_tokens"][0]
    for step in steps:
        assert len(step["top_logprobs"]) == 2
        assert step["logprob"] <= 0 and bytes(step["bytes"]).decode("utf-8", "replace")
        tops = [t["logprob"] for t in step["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and step["logprob"] <= tops[0]
    assert "".join(bytes(s["bytes"]).decode() for s in steps) == banned["output"][0]
