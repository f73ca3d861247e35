"""The job definition: values checked one way for every surface, and every surface derived
from it - adding an option is one entry in OPTIONS (a sampling one: one SamplingParams
field), plus a JOB option's typed JobSpec field, which a test here keeps in step."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from tokenmill.engine import FIELD_DEFAULT, SamplingParams
from tokenmill.pipelines import options as opts
from tokenmill.pipelines.option_types import (
    BOOL,
    CLI,
    FLOAT,
    FLOW,
    INT,
    JOB,
    NOTEBOOK,
    SAMPLE,
    SAMPLING,
    TEXT,
    Option,
)
from tokenmill.pipelines.options import (
    check_options,
    get_option,
    llm_options,
    options_for,
    per_row_fields,
)
from tokenmill.pipelines.spec import JobSpec


def test_the_per_row_overrides_are_the_openai_sampling_fields():
    assert set(per_row_fields()) == {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "n",
        "logprobs",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
    }


def test_greedy_is_the_default_everywhere():
    assert get_option("temperature").default == 0.0
    assert JobSpec("in", "out").sampling.temperature == 0.0
    assert check_options({}, surface=NOTEBOOK)["temperature"] == 0.0


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\], got 1.5"),
        ("temperature", float("nan"), "temperature must be >= 0, got nan"),
        ("n", 0, "n must be >= 1, got 0"),
        ("max_tokens", "8", "max_tokens must be an integer, got '8'"),
        ("max_tokens", True, "max_tokens must be an integer, got True"),
        ("raw", "yes", "raw must be true or false"),
        ("output_format", "xlsx", "output_format must be one of parquet, jsonl, openai-batch"),
        ("engine_options", ["a"], "engine_options must be a mapping, got list"),
        ("dtype", None, "dtype must be text, not None"),
    ],
)
def test_bad_values_are_refused_with_the_options_name(name, value, message):
    with pytest.raises(ValueError, match=message):
        check_options({name: value}, surface=JOB)


def test_values_are_made_canonical():
    values = check_options(
        {"stop": "\n", "passthrough": ["a", "b"], "price_input": 1, "storage_options": None},
        surface=JOB,
    )
    assert values["stop"] == ("\n",) and values["passthrough"] == ("a", "b")
    assert values["price_input"] == 1.0 and isinstance(values["price_input"], float)
    assert values["storage_options"] == {} and values["stop_token_ids"] == ()


def test_names_a_surface_does_not_take_are_refused_helpfully():
    with pytest.raises(TypeError, match="unknown option 'temprature'; did you mean 'temperature'"):
        check_options({"temprature": 1.0}, surface=JOB)
    with pytest.raises(TypeError, match="'chat' is not an option any more: prompts go through"):
        check_options({"chat": True}, surface=NOTEBOOK)
    with pytest.raises(TypeError, match="unknown option 'shard_tokens'"):
        check_options({"shard_tokens": 5}, surface=NOTEBOOK)  # a batch-only option
    with pytest.raises(TypeError, match="unknown option 'storage_secret'"):
        check_options({"storage_secret": "blk"}, surface=JOB)  # resolved by the flow


def test_exclusive_options(monkeypatch):
    extra = [
        Option("json_schema", TEXT, None, "A JSON schema.", SAMPLE, exclusive="constraint"),
        Option("regex", TEXT, None, "A regex.", SAMPLE, exclusive="constraint"),
        Option("json_object", BOOL, False, "Any JSON.", SAMPLE, exclusive="constraint"),
    ]
    monkeypatch.setattr(opts, "OPTIONS", (*opts.OPTIONS, *extra))
    assert check_options({"regex": "a+", "json_object": False}, surface=JOB)["regex"] == "a+"
    with pytest.raises(ValueError, match="give either regex or json_object, not both"):
        check_options({"regex": "a+", "json_object": True}, surface=JOB)
    with pytest.raises(ValueError, match="give at most one of json_schema, regex, json_object"):
        check_options({"json_schema": "{}", "regex": "a", "json_object": True}, surface=JOB)


def test_engine_options_may_not_repeat_an_option():
    assert llm_options(check_options({"engine_options": {"max_num_seqs": 8}}, surface=JOB)) == {
        "model": None,
        "revision": None,
        "max_image_pixels": 89_478_485,
        "dtype": "auto",
        "device": None,
        "quantization": None,
        "kv_cache_dtype": "auto",
        "max_num_seqs": 8,
    }
    with pytest.raises(ValueError, match="engine_options may not set dtype: give it as its own"):
        JobSpec("in", "out", engine_options={"dtype": "float32"})


def test_surfaces_nest_as_documented():
    names = {surface: {o.name for o in options_for(surface)} for surface in (CLI, FLOW, JOB)}
    assert names[CLI] <= names[FLOW] and names[FLOW] - names[CLI] == {"storage_secret"}
    assert names[CLI] <= names[JOB]
    notebook = {o.name for o in options_for(NOTEBOOK)}
    assert {"model", "raw", "system", "max_tokens", "engine_options"} <= notebook
    assert not notebook & {"shard_tokens", "price_input", "output_format", "format", "limit"}


# -- adding an option is one edit -------------------------------------------------------

ADD_ONE_OPTION = textwrap.dedent(
    """
    import dataclasses, inspect, json
    from tokenmill.pipelines import options
    from tokenmill.pipelines.option_types import INT, SAMPLE, Option

    # The one edit: an entry in OPTIONS (made before the surfaces are imported).
    options.OPTIONS = (*options.OPTIONS, Option(
        "throwaway_knob", INT, 3, "A throwaway option of the definition test.", SAMPLE,
        per_row=True, ge=1, le=9,
    ))

    from click.testing import CliRunner
    from prefect.exceptions import ParameterTypeError
    import tokenmill
    from tokenmill.cli import main
    from tokenmill.flows import batch_inference
    from tokenmill.pipelines import job
    from tokenmill.pipelines.spec import JobSpec

    run_job_signature = inspect.signature(tokenmill.run_job)
    seen = {}

    def capture(input, output, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    job.run_job = capture
    report = {
        "run_help": CliRunner().invoke(main, ["run", "--help"]).output,
        "flow_help": CliRunner().invoke(main, ["flow", "run", "--help"]).output,
        "generate_help": CliRunner().invoke(main, ["generate", "--help"]).output,
        "cli_exit": CliRunner().invoke(main, ["run", "a", "b", "--throwaway-knob", "4"]).exit_code,
        "refused_exit": CliRunner().invoke(
            main, ["run", "a", "b", "--throwaway-knob", "0"]).exit_code,
        "schema": batch_inference.parameters.model_dump()["properties"]["throwaway_knob"],
        "generate_default": inspect.signature(tokenmill.generate).parameters[
            "throwaway_knob"].default,
        "run_job_default": run_job_signature.parameters["throwaway_knob"].default,
        # JobSpec's fields are written out for type checkers: a new JOB option needs its
        # field there too, which test_jobspec_fields_are_the_job_options checks.
        "spec_in_step": [o.name for o in options.options_for("job")]
        == [f.name for f in dataclasses.fields(JobSpec) if f.kw_only],
        "per_row": "throwaway_knob" in options.per_row_fields(),
    }
    report["passed_to_run_job"] = seen.get("throwaway_knob")
    try:
        batch_inference.validate_parameters({"input": "i", "output": "o", "throwaway_knob": 10})
    except ParameterTypeError:
        report["flow_refuses_10"] = True
    try:
        tokenmill.generate(["hi"], throwaway_knob=0)  # checked before any model is loaded
    except ValueError as exc:
        report["generate_refuses_0"] = str(exc)
    print(json.dumps(report))
    """
)


def test_adding_an_option_is_one_entry_in_the_definition(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", ADD_ONE_OPTION],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for help_text in ("run_help", "flow_help", "generate_help"):
        assert "--throwaway-knob" in report[help_text], help_text
        assert "A throwaway option of the definition test." in " ".join(report[help_text].split())
    assert report["cli_exit"] == 1 and report["passed_to_run_job"] == 4
    assert report["refused_exit"] == 2  # click's range, from the same bounds
    schema = report["schema"]
    assert (schema["default"], schema["minimum"], schema["maximum"]) == (3, 1, 9)
    assert schema["description"] == "A throwaway option of the definition test."
    assert report["flow_refuses_10"] is True
    assert report["generate_default"] == report["run_job_default"] == 3
    assert report["spec_in_step"] is False and report["per_row"] is True
    assert report["generate_refuses_0"] == "throwaway_knob must be in [1, 9], got 0"


def test_every_option_is_documented_and_typed():
    for option in opts.OPTIONS:
        assert option.help.strip().endswith("."), option.name
        assert option.surfaces, option.name
        if option.ge is not None or option.gt is not None or option.le is not None:
            assert option.type in (INT, FLOAT), option.name


def test_jobspec_fields_are_the_job_options():
    """JobSpec's fields are written out for type checkers and IDEs; they are the JOB
    options, in the definition's order, with its defaults, repr and value types (a
    choice is a str: its values are checked, not typed)."""
    spec_fields = [f for f in dataclasses.fields(JobSpec) if f.kw_only]
    assert [f.name for f in spec_fields] == [o.name for o in options_for(JOB)]
    for spec_field, option in zip(spec_fields, options_for(JOB)):
        assert spec_field.default == option.default, option.name
        assert spec_field.repr == option.repr, option.name
        expected = opts.annotation_of(option)
        if option.type.choices:
            expected = str | None if option.accepts_none else str
        assert _annotation(spec_field.type) == _annotation(expected), option.name


def _annotation(annotation) -> str:
    """An annotation as text (JobSpec's are strings: `from __future__ import annotations`)."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type):
        return annotation.__name__
    return repr(annotation).replace("typing.", "")


def test_sampling_options_are_the_sampling_params_fields_a_job_offers():
    """Every sampling option comes from a SamplingParams field declared with a JobOption,
    with the field's name, default (or the job's own) and help."""
    offered = [f for f in dataclasses.fields(SamplingParams) if f.metadata.get("job") is not None]
    sampling = [o for o in opts.OPTIONS if o.to == SAMPLING]
    assert [o.name for o in sampling] == [f.name for f in offered]
    assert len(offered) == 19 and len(dataclasses.fields(SamplingParams)) == 21
    for option, param in zip(sampling, offered):
        assert option.help == param.metadata["help"], option.name
        job_default = param.metadata["job"].default
        if job_default is not FIELD_DEFAULT:
            assert option.default == job_default == 0.0 and option.name == "temperature"
        elif param.default is not dataclasses.MISSING:
            assert option.default == param.default, option.name
        else:  # a list field: the option is repeatable, unset until given
            assert option.repeatable and option.default is None, option.name
