"""`LLM()` start against llama.cpp's load of the same model, warm and cold page cache.

Each start is a fresh process. tokenmill's is timed from the `LLM(...)` call to its
return (the engine ready for a first step); the first generate of one token is timed
apart, and so is the whole process (interpreter, imports and LLM()) from its spawn.
A second table splits each tokenmill start into its phases (`LLM.start_phases`: the
tokenizer, the load, quantizing, packing, the KV cache ...), beside the imports.
llama.cpp's is `llama-server` from its spawn to the first `GET /health` that answers
200 (its model loaded, its context allocated).

Modes: bf16, int8 and int4 start from the bf16 checkpoint (the quantized modes quantize
as they load); gguf starts from the directory its Q4_0 GGUF converts to (converted
once, before any timing, as `tokenmill bench` does). Each is set against llama.cpp's
load of its precision class's GGUF: BF16, Q8_0, Q4_0, Q4_0.

A cold start first drops every file of the model from the page cache
(`posix_fadvise(POSIX_FADV_DONTNEED)`) and checks with `mincore` that its pages left:
the share still resident is printed beside each cold figure (not 0 where another
process holds them mapped or dirty). A warm start has every file read just before. The
bound is the disk: `dd` of the largest weight file after dropping it gives the read
speed, and each row's bytes over it the least time a cold start could take.

Run:  python benchmarks/load_time.py --shape llama-3.1-8b [--shape-layers 2]
          [--modes bf16,int8,int4,gguf] [--caches warm,cold] [--repeat 1]
          [--llama-bin-dir DIR] [--threads N] [--json FILE]
      python benchmarks/load_time.py MODEL_DIR --gguf FILE.gguf ...
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.bench.cpu import cpu_name
from tokenmill.bench.page_cache import (
    disk_read_speed,
    drop_from_page_cache,
    model_files,
    resident_share,
)

LLAMA_BIN = "/tmp/llama-scale/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
MODES = ("bf16", "int8", "int4", "gguf")
# The llama.cpp format of each mode's precision class.
PEER_FORMAT = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0", "gguf": "Q4_0"}
QUANTIZATION = {"bf16": None, "int8": "int8", "int4": "int4", "gguf": "gguf"}
READY_TIMEOUT_S = 1800.0
PROMPT = "The quick brown fox"


@dataclass
class Start:
    """One start of one system, in a fresh process."""

    system: str  # "tokenmill" or "llama-server"
    mode: str  # tokenmill's mode, or llama.cpp's format
    cache: str  # "warm" or "cold"
    ready_s: float  # LLM() call to return; llama-server spawn to /health ok
    process_s: float  # spawn to ready (tokenmill: with the interpreter and imports)
    first_token_s: float | None  # tokenmill: a 1-token generate after ready
    peak_rss_bytes: int
    resident_before: float  # share of the model's file pages resident at spawn
    read_bytes: int  # bytes of the files it reads
    # tokenmill: seconds per phase of LLM() (LLM.start_phases), the imports first
    phases: dict[str, float] | None = None


# -- one start ----------------------------------------------------------------------------


def child(model: str, mode: str, spawned: float) -> None:
    """In the fresh process: LLM() timed, then a 1-token generate; one JSON line out."""
    start = time.perf_counter()
    from tokenmill import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model, dtype="bfloat16", device="cpu", quantization=QUANTIZATION[mode])
    ready = time.perf_counter()
    process_s = time.time() - spawned
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))
    first = time.perf_counter() - ready
    facts = {
        "imports_s": imported - start,
        "ready_s": ready - imported,
        "process_s": process_s,
        "first_token_s": first,
        "peak_rss_bytes": _peak_rss(os.getpid()),
        "phases": {"imports": imported - start, **llm.start_phases},
    }
    print(json.dumps(facts), flush=True)


def start_tokenmill(model: Path, mode: str, cache: str, files: list[Path]) -> Start:
    resident = _prepare(files, cache)
    command = [sys.executable, __file__, "--child", str(model), mode, repr(time.time())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"tokenmill {mode} failed: {done.stderr.strip()[-500:]}")
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    return Start(
        "tokenmill",
        mode,
        cache,
        facts["ready_s"],
        facts["process_s"],
        facts["first_token_s"],
        facts["peak_rss_bytes"],
        resident,
        sum(f.stat().st_size for f in files),
        facts["phases"],
    )


def start_llama_server(server: Path, gguf: Path, fmt: str, cache: str, threads: int) -> Start:
    resident = _prepare([gguf], cache)
    port = _free_port()
    command = [
        str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-c", "512", "-np", "1", "-t", str(threads), "--no-webui", "--log-disable",
    ]  # fmt: skip
    spawned = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not _healthy(port):
            if process.poll() is not None:
                tail = process.stderr.read()[-500:].decode(errors="replace")
                raise RuntimeError(f"llama-server exited with {process.returncode}: {tail}")
            if time.perf_counter() - spawned > READY_TIMEOUT_S:
                raise RuntimeError(f"llama-server not healthy after {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.01)
        ready = time.perf_counter() - spawned
        rss = _peak_rss(process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return Start("llama-server", fmt, cache, ready, ready, None, rss, resident, gguf.stat().st_size)


def _prepare(files: list[Path], cache: str) -> float:
    """Make the files' pages cold (dropped) or warm (read); their resident share now."""
    if cache == "cold":
        drop_from_page_cache(files)
    else:
        for path in files:
            with open(path, "rb") as f:
                while f.read(16 << 20):
                    pass
    return resident_share(files)


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the run ------------------------------------------------------------------------------


def _models(args) -> tuple[Path, dict[str, Path]]:
    """(the bf16 checkpoint's directory, {llama.cpp format: GGUF}), built or given."""
    if args.shape:
        from tokenmill.bench.scale_build import build_scale_model
        from tokenmill.bench.scale_gguf import scale_gguf_path

        model_dir = build_scale_model(args.shape, num_layers=args.shape_layers)
        formats = {PEER_FORMAT[m] for m in args.modes}
        return model_dir, {fmt: scale_gguf_path(model_dir, fmt) for fmt in sorted(formats)}
    if args.model is None:
        raise SystemExit("give MODEL_DIR or --shape NAME")
    ggufs = {}
    if args.gguf:
        from tokenmill.bench.llamacpp import layer_format

        ggufs[layer_format(args.gguf)] = Path(args.gguf)
    return Path(args.model), ggufs


def _read_by_llm(model_dir: Path, mode: str = "bf16") -> list[Path]:
    """The files LLM() reads of a model directory: in the gguf mode every one (its
    converted directory links the GGUF it runs); else all but the GGUFs a scale model
    keeps beside its checkpoint (llama.cpp's)."""
    files = model_files(model_dir)
    return files if mode == "gguf" else [f for f in files if f.suffix != ".gguf"]


def _median(starts: list[Start]) -> Start:
    """The start of median ready time (its other figures with it)."""
    ordered = sorted(starts, key=lambda s: s.ready_s)
    return ordered[(len(ordered) - 1) // 2]


def _table(rows: list[Start], disk: float, cpu: str) -> str:
    lines = [
        f"CPU: {cpu}",
        f"disk read: {disk / 1e9:.2f} GB/s (dd of the largest weight file after DONTNEED)",
        "",
        f"{'system':<13} {'mode':<5} {'cache':<5} {'ready s':>8} {'process s':>9} "
        f"{'1st tok s':>9} {'GB read':>8} {'disk s':>7} {'resident':>8} {'peak RSS GB':>11}",
    ]
    for r in rows:
        first = f"{r.first_token_s:9.2f}" if r.first_token_s is not None else f"{'-':>9}"
        lines.append(
            f"{r.system:<13} {r.mode:<5} {r.cache:<5} {r.ready_s:8.2f} {r.process_s:9.2f} "
            f"{first} {r.read_bytes / 1e9:8.2f} {r.read_bytes / disk:7.2f} "
            f"{r.resident_before:8.1%} {r.peak_rss_bytes / 1e9:11.2f}"
        )
    lines.append(
        "ready: LLM() to its return / llama-server spawn to /health ok; process: spawn to "
        "ready; disk s: GB read / disk read speed (a cold start's bound); resident: the "
        "files' pages in the page cache at spawn"
    )
    return "\n".join(lines)


def _phase_table(rows: list[Start]) -> str:
    """Seconds per phase of each tokenmill start, phases in the order they ran."""
    timed = [r for r in rows if r.phases]
    if not timed:
        return ""
    names = list(dict.fromkeys(name for r in timed for name in r.phases))
    lines = [
        "tokenmill's start by phase, seconds (imports: before LLM(); the rest: LLM.start_phases)",
        f"{'mode':<5} {'cache':<5} " + " ".join(f"{n:>9}" for n in names),
    ]
    for r in timed:
        cells = " ".join(f"{r.phases.get(n, 0.0):9.2f}" for n in names)
        lines.append(f"{r.mode:<5} {r.cache:<5} {cells}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, model, mode, spawned = sys.argv
        child(model, mode, float(spawned))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a bf16 HF-layout model directory")
    parser.add_argument("--shape", help="a scale model shape (tokenmill bench --shape)")
    parser.add_argument("--shape-layers", type=int, help="fewer layers than published")
    parser.add_argument("--gguf", help="with MODEL_DIR: its GGUF (llama.cpp, and the gguf mode)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--caches", default="warm,cold")
    parser.add_argument("--repeat", type=int, default=1, help="starts per row (median)")
    parser.add_argument("--llama-bin-dir", default=LLAMA_BIN)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    caches = [c for c in args.caches.split(",") if c]
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    for cache in caches:
        if cache not in ("warm", "cold"):
            parser.error(f"unknown cache {cache!r}; choose warm or cold")

    from tokenmill.engine import resolve_model

    model_dir, ggufs = _models(args)
    # The gguf mode runs the Q4_0 file's converted directory, converted once, here.
    sources = {m: model_dir for m in args.modes if m != "gguf"}
    if "gguf" in args.modes:
        if PEER_FORMAT["gguf"] not in ggufs:
            raise SystemExit("the gguf mode needs a Q4_0 GGUF: --shape, or --gguf FILE")
        sources["gguf"] = Path(resolve_model(str(ggufs[PEER_FORMAT["gguf"]])))
    server = Path(args.llama_bin_dir) / "llama-server"
    weight_file = max(_read_by_llm(model_dir), key=lambda p: p.stat().st_size)
    disk = disk_read_speed(weight_file)

    rows: list[Start] = []
    for mode in args.modes:
        files = _read_by_llm(sources[mode], mode)
        for cache in caches:
            starts = [
                start_tokenmill(sources[mode], mode, cache, files) for _ in range(args.repeat)
            ]
            rows.append(_median(starts))
            print(_table(rows[-1:], disk, cpu_name()).splitlines()[-2], file=sys.stderr)
    if not server.is_file():
        print(f"llama-server not found in {args.llama_bin_dir}: its rows left out", file=sys.stderr)
    else:
        for fmt in sorted({PEER_FORMAT[m] for m in args.modes} & set(ggufs)):
            for cache in caches:
                starts = [
                    start_llama_server(server, ggufs[fmt], fmt, cache, args.threads)
                    for _ in range(args.repeat)
                ]
                rows.append(_median(starts))
    print(_table(rows, disk, cpu_name()))
    print()
    print(_phase_table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"cpu": cpu_name(), "disk_bytes_per_s": disk, "rows": [asdict(r) for r in rows]},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
