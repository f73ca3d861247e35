"""The vLLM and llama.cpp runners against stand-in modules (neither library runs here).

They check the runners' own logic - arguments, warm-up, fallbacks, counting, latency
bookkeeping - so the GPU script's first real run is not also their first run.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from tokenmill.bench.run_llamacpp import run_llamacpp
from tokenmill.bench.run_vllm import run_vllm
from tokenmill.bench.systems import Job, SystemSpec
from tokenmill.bench.workload import Workload

WORKLOAD = Workload(
    "w",
    prompt_ids=[[5, 6, 7, 8], [5, 6, 7, 9, 10], [11, 12]],
    output_lens=[3, 3, 3],
    prefix_group=[0, 0, None],
    shared_len=[3, 3, 0],
)


def _tokens(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + j) % 50 for j in range(n)]


class FakeVllmLLM:
    instances: list[FakeVllmLLM] = []
    broken_tokenizer = False

    def __init__(self, model: str, **kwargs) -> None:
        self.model, self.kwargs, self.calls = model, kwargs, []
        FakeVllmLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        if self.broken_tokenizer and not self.kwargs.get("skip_tokenizer_init"):
            raise RuntimeError("tokenizer exploded")
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append(len(prompts))
        outputs = []
        for prompt, p in zip(prompts, params):
            assert p.temperature == 0.0 and p.ignore_eos and not p.detokenize
            ids = prompt["prompt_token_ids"]
            metrics = SimpleNamespace(
                first_token_latency=0.5, first_token_ts=100.0, last_token_ts=100.0 + 0.02 * 2
            )
            outputs.append(
                SimpleNamespace(
                    outputs=[SimpleNamespace(token_ids=tuple(_tokens(ids, p.max_tokens)))],
                    num_cached_tokens=3 if ids[:3] == [5, 6, 7] and ids[3] == 9 else 0,
                    metrics=metrics,
                )
            )
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeVllmLLM
    module.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    module.__version__ = "0.0-fake"
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeVllmLLM.instances = []
    FakeVllmLLM.broken_tokenizer = False
    return module


def _job(tmp_path, kind: str, options: dict | None = None) -> Job:
    spec = SystemSpec(f"{kind}-x", kind, "bfloat16", True, options or {})
    return Job(spec, str(tmp_path), str(tmp_path / "w.json"), device="cuda")


def test_vllm_runner(fake_vllm, tmp_path):
    result = run_vllm(_job(tmp_path, "vllm"), WORKLOAD)
    (llm,) = FakeVllmLLM.instances
    assert llm.kwargs["dtype"] == "bfloat16" and llm.kwargs["enable_prefix_caching"]
    assert llm.kwargs["max_model_len"] == 1024
    assert llm.calls == [2, 3]  # warm-up, then the whole workload in one call
    assert result.output_ids == [_tokens(p, 3) for p in WORKLOAD.prompt_ids]
    assert result.num_generated_tokens == 9 and result.generated == [3, 3, 3]
    assert result.cached_prompt == [0, 3, 0] and result.num_cached_prompt_tokens == 3
    assert result.computed_prompt == [4, 2, 2] and result.num_computed_prompt_tokens == 8
    assert result.ttft_s == [0.5] * 3
    assert result.tpot_s == pytest.approx([0.02] * 3)
    assert result.extra["vllm_version"] == "0.0-fake"


def test_vllm_runner_falls_back_to_no_tokenizer(fake_vllm, tmp_path):
    FakeVllmLLM.broken_tokenizer = True
    result = run_vllm(_job(tmp_path, "vllm"), WORKLOAD)
    first, second = FakeVllmLLM.instances
    assert "skip_tokenizer_init" not in first.kwargs
    assert second.kwargs["skip_tokenizer_init"] is True
    assert result.extra["engine_args"]["skip_tokenizer_init"] is True


def test_vllm_runner_reports_every_failure(fake_vllm, tmp_path):
    FakeVllmLLM.broken_tokenizer = True
    job = _job(tmp_path, "vllm", {"engine_args": {"skip_tokenizer_init": False}})
    with pytest.raises(RuntimeError, match="every mode: RuntimeError: tokenizer exploded"):
        run_vllm(job, WORKLOAD)
    assert len(FakeVllmLLM.instances) == 1  # an explicit choice is not second-guessed


def test_vllm_runner_without_request_metrics(fake_vllm, tmp_path, monkeypatch):
    generate = FakeVllmLLM.generate

    def no_metrics(self, prompts, params, use_tqdm=True):
        outputs = generate(self, prompts, params, use_tqdm)
        for out in outputs:
            out.metrics = None
        return outputs

    monkeypatch.setattr(FakeVllmLLM, "generate", no_metrics)
    result = run_vllm(_job(tmp_path, "vllm"), WORKLOAD)
    assert result.ttft_s == [] and result.tpot_s == []


class FakeLlama:
    instances: list[FakeLlama] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        FakeLlama.instances.append(self)

    def generate(self, tokens, **kwargs):
        assert kwargs["top_k"] == 1 and kwargs["temp"] == 0.0
        j = 0
        while True:  # like llama.cpp: never stops by itself
            yield (sum(tokens) + j) % 50
            j += 1


def test_llamacpp_runner(monkeypatch, tmp_path):
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    FakeLlama.instances = []
    job = _job(tmp_path, "llamacpp", {"gguf": "/models/x.gguf"})
    result = run_llamacpp(job, WORKLOAD)
    (llm,) = FakeLlama.instances
    assert llm.kwargs["model_path"] == "/models/x.gguf"
    assert result.output_ids == [_tokens(p, 3) for p in WORKLOAD.prompt_ids]
    # The second prompt reuses the first's 3 leading tokens from llama.cpp's KV.
    assert result.cached_prompt == [0, 3, 0]
    assert result.num_computed_prompt_tokens == 11 - 3
    assert all(t > 0 for t in result.ttft_s)


# A stand-in llama-server: the same command line and HTTP API (/health, streamed
# /completion with `timings`), recording its arguments and every request it served.
_FAKE_SERVER = r"""
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

record = Path(__file__).with_suffix(".json")
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
served = []
lock = threading.Lock()  # requests arrive on several threads at once


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, wanted = body["prompt"], body["n_predict"]
        with lock:  # one writer at a time, and the file replaced whole
            served.append(len(prompt))
            partial = record.with_suffix(".partial")
            partial.write_text(json.dumps({"argv": argv, "served": served}))
            os.replace(partial, record)
        cached = 3 if prompt[:3] == [5, 6, 7] and prompt[3:4] == [9] else 0
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for j in range(wanted):
            chunk = {"tokens": [(sum(prompt) + j) % 50], "stop": False}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        final = {"tokens": [], "stop": True,
                 "timings": {"cache_n": cached, "prompt_n": len(prompt) - cached}}
        self.wfile.write(b"data: " + json.dumps(final).encode() + b"\n\n")


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_server(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n{_FAKE_SERVER}")
    path.chmod(0o755)
    return path


def test_llamacpp_server_runner_starts_the_server_with_the_slots_asked_for(tmp_path):
    import json

    from tokenmill.bench.run_llamacpp_server import run_llamacpp_server
    from tokenmill.bench.workload import warmup_prompts

    server = _fake_server(tmp_path)
    options = {"gguf": "/models/x.gguf", "server": str(server), "parallel": 2}
    result = run_llamacpp_server(_job(tmp_path, "llamacpp-server", options), WORKLOAD)
    record = json.loads(server.with_suffix(".json").read_text())
    argv = record["argv"]
    assert argv[argv.index("-m") + 1] == "/models/x.gguf"
    assert argv[argv.index("-np") + 1] == "2"
    longest = max(len(p) + n for p, n in zip(WORKLOAD.prompt_ids, WORKLOAD.output_lens))
    assert argv[argv.index("-c") + 1] == str(2 * (longest + 16))
    # The warm-up prompts, then every request once.
    assert len(record["served"]) == len(warmup_prompts(WORKLOAD)) + WORKLOAD.num_requests
    assert result.output_ids == [_tokens(p, 3) for p in WORKLOAD.prompt_ids]
    assert result.cached_prompt == [0, 3, 0]  # the server's own count (`timings`)
    assert result.num_computed_prompt_tokens == 11 - 3
    assert result.extra["parallel"] == 2
    assert all(t > 0 for t in result.ttft_s)


def test_llama_server_slots_reach_the_server_and_bad_counts_are_refused(tmp_path):
    from tokenmill.bench.harness import BenchConfig
    from tokenmill.bench.systems import baseline_systems

    server = str(_fake_server(tmp_path))
    (spec,), notes = baseline_systems(
        ["llamacpp-server"], llama_server=server, llama_server_slots=4
    )
    assert notes == [] and spec.options["parallel"] == 4
    (spec,), _ = baseline_systems(["llamacpp-server"], llama_server=server)
    assert "parallel" not in spec.options  # the runner's default: one per request, <= 64
    with pytest.raises(ValueError, match="llama_server_slots must be >= 1"):
        BenchConfig(llama_server_slots=(8, 0))
