"""llama.cpp's tools as the benchmark uses them: the built binaries, the GGUF formats
llama.cpp runs (the model's own file requantized with `llama-quantize`), and llama.cpp's
own benchmarks (`llama-bench`, `llama-batched-bench`) as reference figures.

Nothing of llama.cpp ships with tokenmill: the user builds it (docs/performance.md,
"Baselines") and passes the directory of its binaries (`--llama-bin-dir`) or the server
alone (`--llama-server`, whose directory is searched for the others).

A format's GGUF is made once and kept in tokenmill's cache, keyed by the source file,
the format and the `llama-quantize` binary; the source's own format is the source file.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shlex
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

TOOLS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-quantize")


@dataclass(frozen=True)
class LlamaFormat:
    """A GGUF tensor format llama.cpp runs, and what a run of it is compared with.

    dtype: the matmul peak its roofline is measured against (its products run in fp32
    arithmetic or integer dot products, BF16's in bf16). precision: the class a
    tokenmill mode is compared within (`peer_formats`).
    """

    name: str
    dtype: str
    precision: str


FORMATS = {
    f.name: f
    for f in (
        LlamaFormat("F32", "float32", "fp32"),
        LlamaFormat("BF16", "bfloat16", "bf16"),
        LlamaFormat("F16", "float32", "fp16"),
        LlamaFormat("Q8_0", "float32", "8-bit"),
        LlamaFormat("Q4_0", "float32", "4-bit"),
        LlamaFormat("Q4_1", "float32", "4-bit"),
        LlamaFormat("Q4_K", "float32", "4-bit"),
    )
}


def validate_format(name: str) -> str:
    """The format name, checked; raises ValueError for one llama.cpp is not run in here."""
    if name not in FORMATS:
        raise ValueError(f"unknown llama.cpp format {name!r}; choose from {', '.join(FORMATS)}")
    return name


@dataclass(frozen=True)
class LlamaTools:
    """Paths of llama.cpp's binaries; None for those not found."""

    server: Path | None = None
    bench: Path | None = None
    batched_bench: Path | None = None
    quantize: Path | None = None

    @classmethod
    def find(
        cls, bin_dir: str | Path | None = None, server: str | Path | None = None
    ) -> LlamaTools:
        """The tools in bin_dir, else beside `server` (else $TOKENMILL_LLAMA_SERVER's).

        Raises:
            FileNotFoundError: bin_dir is given and is not a directory.
        """
        server = server or os.environ.get("TOKENMILL_LLAMA_SERVER")
        if bin_dir is not None and not Path(bin_dir).is_dir():
            raise FileNotFoundError(f"--llama-bin-dir {bin_dir} is not a directory")
        if bin_dir is None and server:
            bin_dir = Path(server).parent
        found: dict[str, Path | None] = {}
        for tool in TOOLS:
            path = Path(bin_dir) / tool if bin_dir is not None else None
            found[tool] = path.resolve() if path is not None and _executable(path) else None
        if server and _executable(Path(server)):
            found["llama-server"] = Path(server).resolve()
        return cls(
            found["llama-server"],
            found["llama-bench"],
            found["llama-batched-bench"],
            found["llama-quantize"],
        )


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def layer_format(gguf: str | Path) -> str:
    """The tensor type most of a GGUF's decoder weights (2-D `blk.*` tensors) are in."""
    counts: dict[str, int] = {}
    for name, shape, kind in read_tensor_infos(gguf):
        if name.startswith("blk.") and len(shape) == 2:
            counts[kind] = counts.get(kind, 0) + shape[0] * shape[1]
    if not counts:
        raise ValueError(f"{gguf} has no decoder weights")
    return max(counts, key=counts.get)


def tensor_types(gguf: str | Path) -> dict[str, int]:
    """{tensor type name: number of tensors} over a whole GGUF (for the report)."""
    counts: dict[str, int] = {}
    for _, _, kind in read_tensor_infos(gguf):
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


# GGUF metadata value types (gguf's GGUFValueType) -> struct format of a fixed-size value.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


def read_tensor_infos(gguf: str | Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, type name) of every tensor in a GGUF file, from its header alone.

    The metadata is stepped over without decoding it: gguf's GGUFReader decodes every
    tokenizer entry into Python objects, which takes seconds to tens of seconds here.
    """
    from gguf import GGMLQuantizationType

    with open(gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF":
            raise ValueError(f"{gguf} is not a GGUF file")
        num_tensors, num_kv = struct.unpack_from("<QQ", data, 8)
        at = 24

        def string() -> str:
            nonlocal at
            (length,) = struct.unpack_from("<Q", data, at)
            at += 8 + length
            return data[at - length : at].decode("utf-8", errors="replace")

        def skip(kind: int) -> None:
            nonlocal at
            if kind in _SCALARS:
                at += struct.calcsize(_SCALARS[kind])
            elif kind == _STRING:
                string()
            elif kind == _ARRAY:
                item, count = struct.unpack_from("<IQ", data, at)
                at += 12
                if item in _SCALARS:
                    at += struct.calcsize(_SCALARS[item]) * count
                else:
                    for _ in range(count):
                        skip(item)
            else:
                raise ValueError(f"{gguf}: unknown metadata type {kind}")

        for _ in range(num_kv):
            string()
            (kind,) = struct.unpack_from("<I", data, at)
            at += 4
            skip(kind)
        infos = []
        for _ in range(num_tensors):
            name = string()
            (num_dims,) = struct.unpack_from("<I", data, at)
            shape = struct.unpack_from(f"<{num_dims}Q", data, at + 4)
            kind, _offset = struct.unpack_from("<IQ", data, at + 4 + 8 * num_dims)
            at += 4 + 8 * num_dims + 12
            infos.append((name, tuple(shape), GGMLQuantizationType(kind).name))
    return infos


def prepare_gguf(quantize: Path | None, source: Path, fmt: str, cache_dir: Path) -> Path:
    """The source GGUF in format `fmt`: the source itself when its layers already are,
    else `llama-quantize --allow-requantize source out fmt`, made once and cached.

    Raises:
        FileNotFoundError: a conversion is needed and there is no llama-quantize.
        RuntimeError: llama-quantize failed.
    """
    validate_format(fmt)
    if layer_format(source) == fmt:
        return source
    if quantize is None:
        raise FileNotFoundError(
            f"making a {fmt} GGUF needs llama-quantize: pass --llama-bin-dir DIR "
            '(docs/performance.md, "Baselines")'
        )
    stat = source.stat()
    identity = f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{fmt}\0"
    identity += _file_digest(quantize)
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    target = cache_dir / f"{source.stem}.{fmt}.{key}.gguf"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".gguf.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [str(quantize), "--allow-requantize", str(source), tmp, fmt],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"llama-quantize to {fmt} failed: {' | '.join(tail)}")
        os.replace(tmp, target)  # atomic: a concurrent run never sees half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def run_llama_bench(
    tools: LlamaTools, gguf: Path, threads: int, *, prompt: int = 512, generate: int = 128
) -> dict:
    """`llama-bench -p PROMPT -n GENERATE` on one GGUF: prompt and one-sequence generation
    tokens/s ({"pp_tok_s", "tg_tok_s", "build_commit", "cpu_info", ...})."""
    if tools.bench is None:
        raise FileNotFoundError("llama-bench not found beside llama-server")
    command = [str(tools.bench), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
               "-n", str(generate), "-o", "json"]  # fmt: skip
    records = json.loads(_run(command))
    facts = {"tool": "llama-bench", "command": _shell(command)}
    for record in records:
        key = "pp_tok_s" if record.get("n_prompt") else "tg_tok_s"
        facts[key] = float(record["avg_ts"])
        facts["build_commit"] = record.get("build_commit")
        facts["cpu_info"] = record.get("cpu_info")
    return facts


def run_batched_bench(
    tools: LlamaTools,
    gguf: Path,
    threads: int,
    *,
    prompt: int = 256,
    generate: int = 64,
    parallel: tuple[int, ...] = (1, 8, 16, 32, 64),
) -> dict:
    """`llama-batched-bench`: PROMPT-token prompts, GENERATE tokens each, for each count
    of parallel sequences: {"by_parallel": {n: total tok/s}, "best_tok_s", ...}."""
    if tools.batched_bench is None:
        raise FileNotFoundError("llama-batched-bench not found beside llama-server")
    context = max(parallel) * (prompt + generate) + 16
    command = [str(tools.batched_bench), "-m", str(gguf), "-t", str(threads), "-tb",
               str(threads), "-c", str(context), "-b", "2048", "-ub", "512", "-npp",
               str(prompt), "-ntg", str(generate), "-npl", ",".join(map(str, parallel)),
               "--output-format", "jsonl"]  # fmt: skip
    by_parallel = {}
    for line in _run(command).splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            by_parallel[int(record["pl"])] = float(record["speed"])
    best = max(by_parallel, key=by_parallel.get) if by_parallel else None
    return {
        "tool": "llama-batched-bench",
        "command": _shell(command),
        "by_parallel": by_parallel,
        "best_parallel": best,
        "best_tok_s": by_parallel.get(best),
    }


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{Path(command[0]).name} failed: {' | '.join(tail)}")
    return done.stdout


def _shell(command: list[str]) -> str:
    return shlex.join(command)
