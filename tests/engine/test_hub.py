"""Hub repo ids resolved offline from a pre-filled Hugging Face cache, and every way one can
fail (offline and not cached, unknown, gated, no safetensors) as a clear error."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from model_fixtures import fill_hf_cache, model_dir_files
from tiny_model import CHATML_TEMPLATE, build_tiny_model

from tokenmill.cli import main
from tokenmill.engine.loader import hub
from tokenmill.engine.loader.model_files import (
    ALIASES,
    ModelFilesError,
    list_models,
    model_info,
    resolve_model,
    weights_hash,
)
from tokenmill.engine.loader.tokenizer import Tokenizer

REPO = "acme/tiny-chat"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty HF cache, offline. huggingface_hub reads HF_HOME once, at import, into
    `constants`; this process has imported it already, so the constants are set too."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "tm-cache"))
    for name in list(ALIASES):  # listings stay fast whichever alias packages are installed
        alias = dataclasses.replace(ALIASES[name], package="tokenmill_no_such_package")
        monkeypatch.setitem(ALIASES, name, alias)
    return cache


@pytest.fixture
def tiny_files(tmp_path):
    return model_dir_files(build_tiny_model(tmp_path / "tiny"))


def test_repo_id_resolves_offline_to_its_snapshot(hub_cache, tiny_files):
    commit = fill_hf_cache(hub_cache, REPO, tiny_files)
    path = resolve_model(REPO)
    assert path == hub_cache / "models--acme--tiny-chat" / "snapshots" / commit
    assert hub.snapshot_revision(path) == commit
    info = model_info(REPO)
    assert (info.name, info.revision, info.source) == (REPO, commit, "hub")
    assert info.architecture == "LlamaForCausalLM"
    assert weights_hash(path) == weights_hash(tiny_files["model.safetensors"].parent)


def test_llm_loads_a_repo_id_and_records_its_commit(hub_cache, tiny_files):
    from tokenmill.engine.api.llm import LLM
    from tokenmill.engine.types.sampling_params import SamplingParams

    commit = fill_hf_cache(hub_cache, REPO, tiny_files)
    llm = LLM(REPO, dtype="float32", device="cpu", kv_cache_memory=4 << 20)
    assert llm.model_revision == commit
    local = LLM(tiny_files["config.json"].parent, dtype="float32", device="cpu")
    assert local.model_revision is None
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = local.generate(["The quick brown fox"], params)[0].token_ids
    assert llm.generate(["The quick brown fox"], params)[0].token_ids == expected


def test_revision_by_branch_tag_or_commit(hub_cache, tmp_path, tiny_files):
    main_commit = fill_hf_cache(hub_cache, REPO, tiny_files)
    other = model_dir_files(build_tiny_model(tmp_path / "other", seed=1))
    tagged = fill_hf_cache(hub_cache, REPO, other, refs=("v2",))
    assert main_commit != tagged
    assert resolve_model(REPO).name == main_commit
    assert resolve_model(REPO, revision="v2").name == tagged
    assert resolve_model(REPO, revision=main_commit).name == main_commit
    with pytest.raises(ModelFilesError, match=r"acme/tiny-chat \(revision v3\).*not in the"):
        resolve_model(REPO, revision="v3")
    with pytest.raises(ModelFilesError, match="not a Hub repo id"):
        resolve_model(tiny_files["config.json"].parent, revision="v2")


def test_chat_template_from_chat_template_jinja_or_tokenizer_config(hub_cache, tiny_files):
    """Current repos keep the template in chat_template.jinja, older ones in
    tokenizer_config.json; both render the same conversation."""
    config = json.loads(tiny_files["tokenizer_config.json"].read_text())
    assert config.pop("chat_template") == CHATML_TEMPLATE
    current = dict(tiny_files, **{"tokenizer_config.json": json.dumps(config).encode()})
    current["chat_template.jinja"] = CHATML_TEMPLATE.encode()
    fill_hf_cache(hub_cache, "acme/current", current)
    fill_hf_cache(hub_cache, "acme/older", tiny_files)
    messages = [{"role": "user", "content": "hi"}]
    rendered = {
        repo: Tokenizer.from_dir(resolve_model(repo)).apply_chat_template(messages)
        for repo in ("acme/current", "acme/older")
    }
    assert rendered["acme/current"] == rendered["acme/older"]
    assert rendered["acme/current"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_offline_and_not_cached_names_the_repo_and_the_pull_command(hub_cache):
    with pytest.raises(ModelFilesError) as error:
        resolve_model("acme/absent")
    message = str(error.value)
    assert "model acme/absent is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in message
    assert "`tokenmill models pull acme/absent`" in message


def test_repo_without_safetensors_is_refused(hub_cache, tiny_files):
    files = {k: v for k, v in tiny_files.items() if k != "model.safetensors"}
    files["pytorch_model.bin"] = b"pickled weights are never loaded"
    fill_hf_cache(hub_cache, "acme/pickled", files)
    with pytest.raises(ModelFilesError, match="acme/pickled has no safetensors weights"):
        resolve_model("acme/pickled")


def _http_error(kind, status: int):
    try:  # huggingface_hub 2 answers through httpx2, 1.x through httpx
        import httpx2 as httpx
    except ImportError:
        import httpx
    request = httpx.Request("GET", "https://hub.invalid/api/models/acme/x")
    return kind("boom", response=httpx.Response(status, request=request))


@pytest.mark.parametrize(
    ("kind", "status", "expected"),
    [
        ("RepositoryNotFoundError", 404, "no model 'acme/x' on the Hugging Face Hub"),
        ("GatedRepoError", 403, "model acme/x is gated: accept its licence"),
        ("RevisionNotFoundError", 404, "no such revision"),
    ],
)
def test_hub_errors_become_clear_messages(hub_cache, monkeypatch, kind, status, expected):
    import huggingface_hub
    from huggingface_hub import errors

    def refuse(*args, **kwargs):
        raise _http_error(getattr(errors, kind), status)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelFilesError, match=expected):
        resolve_model("acme/x")
    result = CliRunner().invoke(main, ["models", "pull", "acme/x"])
    assert result.exit_code == 1
    assert expected.split(":")[0] in result.output and "Traceback" not in result.output


def test_only_the_engine_files_are_fetched():
    from huggingface_hub.utils import filter_repo_objects

    repo_files = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "processor_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "training_args.pt",
        "model.gguf",
        "onnx/model.onnx",
        "tokenizer.model",
        "README.md",
    ]
    fetched = list(filter_repo_objects(repo_files, allow_patterns=list(hub.HUB_FILE_PATTERNS)))
    assert fetched == repo_files[:11]


def test_models_pull_list_and_info(hub_cache, tiny_files):
    commit = fill_hf_cache(hub_cache, REPO, tiny_files)
    runner = CliRunner()
    pulled = runner.invoke(main, ["models", "pull", REPO], catch_exceptions=False)
    assert pulled.exit_code == 0
    assert pulled.output.startswith(f"{REPO} @ {commit} -> {hub_cache}")
    listed = runner.invoke(main, ["models", "list"], catch_exceptions=False)
    row = next(line for line in listed.output.splitlines() if line.startswith(REPO))
    assert row.split()[1:4] == ["LlamaForCausalLM", "103.0K", "float32"]
    assert f"hub @ {commit[:12]}" in row
    assert [i.revision for i in list_models() if i.name == REPO] == [commit]
    info = runner.invoke(main, ["models", "info", REPO], catch_exceptions=False)
    assert f"revision:      {commit}" in info.output
    not_repo = runner.invoke(main, ["models", "pull", "smollm2-135m-instruct"])
    assert not_repo.exit_code == 1 and "not a Hub repo id" in not_repo.output


def test_hf_home_is_honoured_in_a_fresh_process(hub_cache, tiny_files):
    """A new process reads HF_HOME itself (nothing patched there)."""
    commit = fill_hf_cache(hub_cache, REPO, tiny_files)
    env = dict(os.environ, HF_HOME=str(hub_cache.parent), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    code = (
        "from tokenmill.engine.loader.model_files import resolve_model; print(resolve_model('%s'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code % REPO], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().endswith(f"snapshots/{commit}")


def test_a_job_runs_on_a_repo_id(hub_cache, tiny_files, tmp_path):
    """run_job plans (tokenizer, context, weights hash) and runs on the snapshot."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.pipelines.job import run_job

    commit = fill_hf_cache(hub_cache, REPO, tiny_files)
    # The same weights under another commit (say, a README edit): a job of its own.
    tagged = fill_hf_cache(hub_cache, REPO, tiny_files, refs=("v2",), commit="f" * 40)
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["The quick brown fox", "Summarise this"]}), source)
    job = dict(model=REPO, prompt_column="prompt", max_tokens=4)
    ledger = run_job(str(source), str(tmp_path / "out"), **job)
    assert (ledger.model, ledger.rows_ok, ledger.rows_failed) == (f"{REPO}@{commit}", 2, 0)
    assert ledger.weights_hash == weights_hash(resolve_model(REPO))
    again = run_job(str(source), str(tmp_path / "out"), **job)
    assert again.job_id == ledger.job_id and again.num_shards_run == 0  # resumed: all done
    # Resuming into the same output with another commit is refused, never mixed.
    with pytest.raises(ValueError, match="the input, model or options changed"):
        run_job(str(source), str(tmp_path / "out"), revision="v2", **job)
    other = run_job(str(source), str(tmp_path / "out-v2"), revision="v2", **job)
    assert other.model == f"{REPO}@{tagged}" and other.weights_hash == ledger.weights_hash
