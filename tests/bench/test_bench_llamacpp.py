"""llama.cpp in the benchmark without llama.cpp: its tools stood in for by small scripts
that take the same arguments and print what the real ones print - finding the binaries,
making each format's GGUF once, the like-for-like pairing of tokenmill modes with
llama.cpp formats, its own benchmarks' parsing, one-at-a-time workloads, and a whole
`tokenmill bench` run against llama-server in two formats."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from model_fixtures import write_tiny_gguf
from test_bench_fake_engines import WORKLOAD, _fake_server, _job, _tokens
from test_bench_report import SHAPE

from tokenmill.bench import llamacpp
from tokenmill.bench.report import best_of_ratio, build_summaries
from tokenmill.bench.result import RunResult
from tokenmill.bench.systems import (
    SystemSpec,
    baseline_systems,
    peer_formats,
    split_quantization,
    tokenmill_systems,
)
from tokenmill.bench.workload import PRESETS, build_workload
from tokenmill.cli import main


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory) -> dict[str, Path]:
    """The same tiny model in each format the tests use (F32 norms, 2-D weights in it)."""
    where = tmp_path_factory.mktemp("ggufs")
    return {
        fmt: write_tiny_gguf(where / f"tiny-{fmt}.gguf", quant_type=fmt).path
        for fmt in ("Q4_1", "Q4_0", "F32")
    }


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\nimport json, shutil, sys\n{body}")
    path.chmod(0o755)
    return path


def _fake_quantize(bin_dir: Path, ggufs: dict[str, Path]) -> Path:
    """llama-quantize --allow-requantize SRC DST FMT: copies the tiny model made in FMT,
    and appends its arguments to a record beside it."""
    files = {fmt: str(path) for fmt, path in ggufs.items()}
    record = bin_dir / "quantize.jsonl"
    return _script(
        bin_dir / "llama-quantize",
        f"""
files = {files!r}
_, src, dst, fmt = sys.argv[1:]
with open({str(record)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if fmt not in files:
    print("unsupported type", fmt, file=sys.stderr)
    sys.exit(1)
shutil.copy(files[fmt], dst)
""",
    )


def test_tensor_infos_are_read_from_the_header_alone(tiny_ggufs):
    from gguf import GGUFReader

    for fmt, path in tiny_ggufs.items():
        infos = llamacpp.read_tensor_infos(path)
        want = [
            (t.name, tuple(int(x) for x in t.shape), t.tensor_type.name)
            for t in GGUFReader(str(path)).tensors
        ]
        assert infos == want
        assert llamacpp.layer_format(path) == fmt
    assert llamacpp.tensor_types(tiny_ggufs["Q4_0"]) == {"F32": 5, "Q4_0": 15}


def test_tools_are_found_in_a_directory_or_beside_the_server(tmp_path):
    for tool in ("llama-server", "llama-bench", "llama-quantize"):
        _script(tmp_path / tool, "")
    (tmp_path / "llama-batched-bench").write_text("not executable")
    tools = llamacpp.LlamaTools.find(tmp_path)
    assert tools.server == (tmp_path / "llama-server").resolve()
    assert tools.quantize == (tmp_path / "llama-quantize").resolve()
    assert tools.batched_bench is None
    beside = llamacpp.LlamaTools.find(server=tmp_path / "llama-server")
    assert beside == tools
    with pytest.raises(FileNotFoundError, match="not a directory"):
        llamacpp.LlamaTools.find(tmp_path / "missing")


def test_each_format_is_made_once_and_the_source_format_is_the_source(tmp_path, tiny_ggufs):
    quantize = _fake_quantize(tmp_path, tiny_ggufs)
    source = tiny_ggufs["Q4_1"]
    cache = tmp_path / "cache"
    assert llamacpp.prepare_gguf(quantize, source, "Q4_1", cache) == source
    made = llamacpp.prepare_gguf(quantize, source, "Q4_0", cache)
    assert made.parent == cache and llamacpp.layer_format(made) == "Q4_0"
    assert llamacpp.prepare_gguf(quantize, source, "Q4_0", cache) == made  # cached
    calls = [json.loads(line) for line in (tmp_path / "quantize.jsonl").read_text().splitlines()]
    assert calls == [["--allow-requantize", str(source), calls[0][2], "Q4_0"]]
    with pytest.raises(RuntimeError, match="llama-quantize to Q8_0 failed: unsupported type"):
        llamacpp.prepare_gguf(quantize, source, "Q8_0", cache)
    assert list(cache.glob("*.tmp")) == []  # a failed conversion leaves nothing behind
    with pytest.raises(FileNotFoundError, match="needs llama-quantize"):
        llamacpp.prepare_gguf(None, source, "Q4_0", tmp_path / "other")
    with pytest.raises(ValueError, match="unknown llama.cpp format"):
        llamacpp.prepare_gguf(quantize, source, "Q3_K", cache)


def test_llama_bench_and_batched_bench_figures_are_parsed(tmp_path):
    _script(
        tmp_path / "llama-bench",
        """
print(json.dumps([
    {"n_prompt": 512, "n_gen": 0, "avg_ts": 695.5, "build_commit": "0c1e570", "cpu_info": "X"},
    {"n_prompt": 0, "n_gen": 128, "avg_ts": 124.25, "build_commit": "0c1e570", "cpu_info": "X"},
]))
""",
    )
    _script(
        tmp_path / "llama-batched-bench",
        """
print("main: n_kv_max = 4096")
for pl, speed in ((1, 120.0), (8, 240.5), (64, 150.0)):
    print(json.dumps({"pp": 256, "tg": 64, "pl": pl, "speed": speed}))
""",
    )
    tools = llamacpp.LlamaTools.find(tmp_path)
    bench = llamacpp.run_llama_bench(tools, tmp_path / "m.gguf", 2)
    assert bench["pp_tok_s"] == 695.5 and bench["tg_tok_s"] == 124.25
    assert bench["build_commit"] == "0c1e570" and "-p 512 -n 128" in bench["command"]
    batched = llamacpp.run_batched_bench(tools, tmp_path / "m.gguf", 2)
    assert batched["by_parallel"] == {1: 120.0, 8: 240.5, 64: 150.0}
    assert batched["best_parallel"] == 8 and batched["best_tok_s"] == 240.5


def test_int8_head_is_int8_with_its_lm_head_quantized():
    plain, spec = tokenmill_systems(["bfloat16"], {}, ["int8-head"])
    assert (plain.label, spec.label) == ("tokenmill-bf16", "tokenmill-int8-head")
    assert spec.options == {"engine_args": {"quantization": "int8", "quantize_lm_head": True}}
    assert peer_formats(spec) == ("Q8_0", "Q4_0")
    assert split_quantization("int8-head") == ("int8", None)


def test_gguf_head_is_gguf_with_its_lm_head_quantized():
    files = {"Q4_0": "/m/x.Q4_0.gguf"}
    _, spec = tokenmill_systems(["bfloat16"], {}, ["gguf-head:Q4_0"], gguf_files=files)
    assert spec.label == "tokenmill-gguf-head-Q4_0"
    assert spec.options == {
        "engine_args": {"quantization": "gguf", "quantize_lm_head": True},
        "model": "/m/x.Q4_0.gguf",
        "format": "Q4_0",
    }
    assert peer_formats(spec) == ("Q4_0",)
    assert split_quantization("gguf-head:Q4_0") == ("gguf", "Q4_0")


def test_gguf_formats_label_tokenmill_and_llama_systems():
    files = {"Q4_0": "/m/x.Q4_0.gguf", "BF16": "/m/x.BF16.gguf"}
    specs = tokenmill_systems(["bfloat16"], {}, ["int8", "gguf", "gguf:Q4_0"], gguf_files=files)
    by_label = {s.label: s for s in specs}
    assert list(by_label) == [
        "tokenmill-bf16",
        "tokenmill-int8",
        "tokenmill-gguf",
        "tokenmill-gguf-Q4_0",
    ]
    q4 = by_label["tokenmill-gguf-Q4_0"]
    assert q4.options == {
        "engine_args": {"quantization": "gguf"},
        "model": "/m/x.Q4_0.gguf",
        "format": "Q4_0",
    }
    with pytest.raises(ValueError, match="no Q8_0 GGUF"):
        tokenmill_systems(["bfloat16"], {}, ["gguf:Q8_0"], gguf_files=files)
    with pytest.raises(ValueError, match="only gguf takes a file format"):
        split_quantization("int8:Q8_0")

    # Like for like: bf16 with BF16, int8 with llama.cpp's 8- and 4-bit integer formats,
    # gguf with its own file's format.
    assert peer_formats(by_label["tokenmill-bf16"]) == ("BF16",)
    assert peer_formats(by_label["tokenmill-int8"]) == ("Q8_0", "Q4_0")
    assert peer_formats(by_label["tokenmill-gguf"], "Q4_1") == ("Q4_1",)
    assert peer_formats(q4, "Q4_1") == ("Q4_0",)

    server = "/usr/bin/true"
    llama, notes = baseline_systems(["llamacpp-server"], llama_server=server, llamacpp_ggufs=files)
    assert notes == [] and [s.label for s in llama] == ["llama-server-Q4_0", "llama-server-BF16"]
    assert [s.dtype for s in llama] == ["float32", "bfloat16"]  # the peak each is held to
    assert llama[0].options["format"] == "Q4_0" and llama[0].options["gguf"] == files["Q4_0"]
    assert peer_formats(llama[0]) == ()


def _run(wall: float, tokens: int = 100) -> RunResult:
    return RunResult("x", wall, tokens, tokens, 0, 0, [tokens], [0], [0], [], [])


def test_the_like_for_like_ratio_faces_the_fastest_peer_of_each_round():
    mine = [_run(1.0), _run(2.0), None, _run(1.0)]
    peer_a = [_run(2.0), _run(3.0), _run(1.0), None]
    peer_b = [_run(4.0), _run(2.5), _run(1.0), None]
    # Round 1: a is faster (2x); round 2: b (1.25x); round 3: mine failed; round 4: no peer.
    assert best_of_ratio(mine, [peer_a, peer_b]) == pytest.approx((2.0 + 1.25) / 2)
    assert best_of_ratio(mine, []) is None

    specs = [
        SystemSpec("tokenmill-bf16", "tokenmill", "bfloat16", False),
        SystemSpec("llama-server-BF16", "llamacpp-server", "bfloat16", True, {"format": "BF16"}),
        SystemSpec("llama-server-Q4_0", "llamacpp-server", "float32", True, {"format": "Q4_0"}),
    ]
    workload = build_workload(PRESETS["smoke"], list(range(10, 60)))
    n = workload.num_requests

    def run(wall: float) -> RunResult:
        lens = [len(p) for p in workload.prompt_ids]
        return RunResult("x", wall, sum(lens), sum(lens), 0, 48, lens, [0] * n,
                         workload.output_lens, [0.1] * n, [0.01] * n, load_avg_1m=1.5)  # fmt: skip

    runs = {"tokenmill-bf16": [run(1.0)], "llama-server-BF16": [run(3.0)],
            "llama-server-Q4_0": [run(2.0)]}  # fmt: skip
    peers = {
        "tokenmill-bf16": ["llama-server-BF16"],
        "llama-server-BF16": [],
        "llama-server-Q4_0": [],
    }
    summaries = build_summaries(
        specs, runs, {}, workload=workload, shape=SHAPE, peaks_gflops={}, peers=peers
    )
    mine = summaries[0]
    assert mine.peers == ["llama-server-BF16"] and mine.best_peer == "llama-server-BF16"
    assert mine.peer_ratio == pytest.approx(3.0)  # against its class, not the faster Q4_0
    assert mine.load_avg == 1.5


def test_the_noprefix_variant_keeps_mixed64s_lengths_and_shares_nothing():
    pool = list(range(100, 1100))
    mixed = build_workload(PRESETS["mixed64"], pool)
    alone = build_workload(PRESETS["mixed64-noprefix"], pool)
    assert [len(p) for p in alone.prompt_ids] == [len(p) for p in mixed.prompt_ids]
    assert alone.output_lens == mixed.output_lens
    assert alone.num_prompt_tokens == alone.num_unique_prompt_tokens == 22_697
    assert set(alone.prefix_group) == {None} and not alone.sequential
    assert len({tuple(p[:256]) for p in alone.prompt_ids}) == 64


def test_single8_is_one_request_at_a_time():
    workload = build_workload(PRESETS["single8"], list(range(100, 1100)))
    assert workload.sequential and workload.num_requests == 8
    assert workload.output_lens == [128] * 8
    assert all(16 <= len(p) <= 48 for p in workload.prompt_ids)


def test_a_sequential_workload_runs_on_one_slot_one_request_at_a_time(tmp_path):
    from dataclasses import replace

    from tokenmill.bench.run_llamacpp_server import run_llamacpp_server

    server = _fake_server(tmp_path)
    options = {"gguf": "/models/x.gguf", "server": str(server), "parallel": 8}
    sequential = replace(WORKLOAD, sequential=True)
    result = run_llamacpp_server(_job(tmp_path, "llamacpp-server", options), sequential)
    argv = json.loads(server.with_suffix(".json").read_text())["argv"]
    assert argv[argv.index("-np") + 1] == "1"
    assert result.output_ids == [_tokens(p, 3) for p in WORKLOAD.prompt_ids]
    # Each request's first token counts from its own submission: one after another, their
    # waits add up to less than the run (counted from the run's start, they would not).
    assert sum(result.ttft_s) < result.wall_s


def test_a_sequential_tokenmill_run_times_each_request_from_its_own_start(
    bench_model_dir, tmp_path
):
    from dataclasses import replace

    from tokenmill.bench.run_tokenmill import run_tokenmill
    from tokenmill.bench.systems import Job
    from tokenmill.bench.workload import load_preset

    workload = replace(load_preset("smoke", bench_model_dir), sequential=True)
    spec = SystemSpec("tokenmill-fp32", "tokenmill", "float32", False, {"engine_args": {}})
    result = run_tokenmill(Job(spec, str(bench_model_dir), ""), workload)
    assert result.generated == workload.output_lens
    assert result.extra["num_steps"] >= workload.num_requests * max(workload.output_lens)
    assert sum(result.ttft_s) < result.wall_s  # never counted from the start of the run


@pytest.fixture
def fake_llama_bin(tmp_path, tiny_ggufs) -> Path:
    """A directory with stand-ins for llama-server (test_bench_fake_engines'), llama-quantize,
    llama-bench and llama-batched-bench."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(_fake_server(tmp_path), bin_dir / "llama-server")
    _fake_quantize(bin_dir, tiny_ggufs)
    _script(
        bin_dir / "llama-bench",
        'print(json.dumps([{"n_prompt": 512, "avg_ts": 10.0}, {"n_prompt": 0, "avg_ts": 2.0}]))',
    )
    _script(bin_dir / "llama-batched-bench", 'print(json.dumps({"pl": 8, "speed": 5.0}))')
    return bin_dir


def test_bench_against_llama_server_in_two_formats(
    fake_llama_bin, tiny_ggufs, tmp_path, monkeypatch
):
    """One round: tokenmill fp32 and gguf on the Q4_0 file made from the model's Q4_1
    GGUF, llama-server on the F32 and Q4_0 files (slot counts swept), llama.cpp's own
    benchmarks; each tokenmill mode gets its class's ratio and the like-for-like table
    names the peer."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    args = ["bench", "--model", str(tiny_ggufs["Q4_1"]), "--preset", "smoke", "--baseline",
            "llamacpp-server", "--dtype", "float32", "--quantization", "gguf:Q4_0",
            "--llamacpp-formats", "F32,Q4_0", "--llama-bin-dir", str(fake_llama_bin),
            "--llama-server-slots", "2,4", "--llama-reference", "--json", str(out)]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Like for like" in result.output and "llama.cpp's own benchmarks" in result.output

    report = json.loads(out.read_text())
    systems = {s["label"]: s for s in report["systems"]}
    assert list(systems) == [
        "tokenmill-fp32", "tokenmill-gguf-Q4_0", "llama-server-F32", "llama-server-Q4_0",
    ]  # fmt: skip
    assert all(s["num_runs"] == 1 for s in systems.values())
    assert systems["tokenmill-fp32"]["peers"] == ["llama-server-F32"]
    assert systems["tokenmill-gguf-Q4_0"]["peers"] == ["llama-server-Q4_0"]
    assert systems["tokenmill-fp32"]["peer_ratio"] > 0
    # Two slot counts tried per llama-server format before the rounds, the faster kept.
    sweeps = [s for s in report["sweeps"] if "parallel" in s]
    assert sorted((s["system"], s["parallel"]) for s in sweeps) == [
        ("llama-server-F32", 2), ("llama-server-F32", 4),
        ("llama-server-Q4_0", 2), ("llama-server-Q4_0", 4),
    ]  # fmt: skip
    assert systems["llama-server-Q4_0"]["extra"]["parallel"] in (2, 4)
    files = report["llamacpp"]["files"]
    assert files["Q4_0"]["tensor_types"] == {"F32": 5, "Q4_0": 15}
    assert report["llamacpp"]["source_format"] == "Q4_1"
    tools = [(r["format"], r["tool"]) for r in report["llamacpp"]["reference"]]
    assert tools == [("F32", "llama-bench"), ("F32", "llama-batched-bench"),
                     ("Q4_0", "llama-bench"), ("Q4_0", "llama-batched-bench")]  # fmt: skip
