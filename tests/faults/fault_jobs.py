"""Real `tokenmill run` jobs in child processes, faults injected, and the checks after.

Shared by tests/faults/ and tests/faults/fault_matrix.py. A `FaultJob` is one input and
one output directory on the tiny random model; `run()` starts the CLI, optionally with
a fault point armed (`tokenmill/faults.py`), and `outcome()` reads the output back the
way a user of the results would and counts what went wrong.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.connectors.atomic import is_temp_name

NUM_ROWS = 40
PLAN_WINDOW_ROWS = 10  # 4 planning windows: room for kills while planning
TOKENS = ["--max-tokens", "4", "--shard-tokens", "60", "--plan-window-rows", str(PLAN_WINDOW_ROWS)]
ENGINE = ["--dtype", "float32", "--engine-option", f"kv_cache_memory={8 << 20}"]
# An embedding job generates nothing (no --max-tokens); its encoder computes a batch of
# at most 16 tokens per step, so a 60-token shard takes several steps (room for a kill
# or a fault mid-shard, as a generation shard's decode steps give).
EMBED_ARGS = [
    "--task",
    "embed",
    "--shard-tokens",
    "60",
    "--plan-window-rows",
    str(PLAN_WINDOW_ROWS),
    "--dtype",
    "float32",
    "--engine-option",
    "max_num_batched_tokens=16",
]
TOKENMILL = str(Path(sys.executable).with_name("tokenmill"))


def write_input(
    path: Path, num_rows: int = NUM_ROWS, *, variant: str = "", duplicates: bool = False
) -> Path:
    """A Parquet input of `num_rows` prompts with ids id-0..; `variant` changes the text.
    With `duplicates`, every third row repeats the prompt of an earlier row (often in an
    earlier planning window), so the job has copy shards (`pipelines/dedupe.py`)."""
    prompts = [
        ("Summarise the following text in one sentence: " if i % 2 else "")
        + f"item {i}{variant} " * (1 + i % 4)
        for i in range(num_rows)
    ]
    if duplicates:
        prompts = [prompts[i // 3] if i % 3 == 2 else p for i, p in enumerate(prompts)]
    ids = [f"id-{i}" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path)
    return path


@dataclass
class RunResult:
    """How one CLI run ended."""

    returncode: int
    output: str  # stdout and stderr together

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL


@dataclass
class Outcome:
    """What a reader of a finished output finds, against the input's ids."""

    rows_lost: int
    rows_duplicated: int
    temp_files: list[str]
    ledger_matches: bool  # ledger.json exists and its sums equal the rows'
    rows_failed: int = 0
    problems: list[str] = field(default_factory=list)
    # Rows that take an identical row's answer, and those whose answer is not that row's.
    rows_copied: int = 0
    copies_wrong: int = 0

    @property
    def ok(self) -> bool:
        return not (
            self.rows_lost or self.rows_duplicated or self.temp_files or self.copies_wrong
        ) and (self.ledger_matches)


@dataclass
class FaultJob:
    """One job: the tiny model, an input, an output directory."""

    model_dir: Path
    input: Path
    output: Path
    num_rows: int = NUM_ROWS
    extra_args: list[str] = field(default_factory=list)
    task: str = "generate"  # or "embed": the model is then an embedding model
    # Job options the CLI's extra_args give, as run_job takes them (count_shards plans
    # with them in-process).
    options: dict = field(default_factory=dict)

    def command(self, *more: str) -> list[str]:
        return [
            TOKENMILL,
            "run",
            str(self.input),
            str(self.output),
            "--model",
            str(self.model_dir),
            "--id-column",
            "id",
            "--no-progress",
            "--json",
            *(EMBED_ARGS if self.task == "embed" else [*TOKENS, *ENGINE]),
            *self.extra_args,
            *more,
        ]

    def start(self, fault: str | None = None, *more: str, stall_s: float = 5) -> subprocess.Popen:
        """Start the CLI job (with `fault` armed: TOKENMILL_FAULT_POINT) and return it."""
        env = dict(os.environ)
        env.pop("TOKENMILL_FAULT_POINT", None)
        if fault:
            env["TOKENMILL_FAULT_POINT"] = fault
            env["TOKENMILL_FAULT_STALL_S"] = str(stall_s)
        return subprocess.Popen(
            self.command(*more),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )

    def run(self, fault: str | None = None, *more: str, timeout_s: float = 300) -> RunResult:
        """Run the CLI job to its end (with `fault` armed)."""
        child = self.start(fault, *more)
        try:
            output, _ = child.communicate(timeout=timeout_s)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        return RunResult(child.returncode, output)

    def published_parts(self) -> list[str]:
        results = self.output / "results"
        if not results.is_dir():
            return []
        return sorted(p.name for p in results.iterdir() if not p.name.startswith("."))

    def num_shards(self) -> int:
        """How many shards the job has, from a finished run's ledger."""
        return json.loads((self.output / "ledger.json").read_text())["num_shards"]

    def outcome(self) -> Outcome:
        """Read the results the way a user would (every file under results/ that a
        dataset reader lists) and compare them with the input's ids and the ledger."""
        expected = pq.read_table(self.input, columns=["id"])["id"].to_pylist()
        problems: list[str] = []
        tables = [pq.read_table(self.output / "results" / name) for name in self.published_parts()]
        rows = pa.concat_tables(tables) if tables else pa.table({"id": pa.array([], pa.string())})
        ids = rows["id"].to_pylist()
        lost = len(set(expected) - set(ids))
        duplicated = len(ids) - len(set(ids))
        temps = [
            str(p.relative_to(self.output)) for p in self.output.rglob("*") if is_temp_name(p.name)
        ]
        ledger_path = self.output / "ledger.json"
        matches = ledger_path.exists()
        if not matches:
            problems.append("no ledger.json")
        else:
            ledger = json.loads(ledger_path.read_text())
            for key in ("prompt_tokens", "cached_tokens", "completion_tokens"):
                if ledger[key] != sum(rows[key].to_pylist()):
                    matches = False
                    problems.append(f"ledger {key} {ledger[key]} != rows' sum")
            if ledger["rows_ok"] + ledger["rows_failed"] != len(ids):
                matches = False
                problems.append("ledger row counts != rows")
        failed = sum(1 for r in rows["finish_reason"].to_pylist() if r == "error") if ids else 0
        copied, wrong = _check_copies(rows)
        return Outcome(lost, duplicated, temps, matches, failed, problems, copied, wrong)


def shape_killed_and_resumed(model_dir: Path, shape, output: Path, fault: str) -> Outcome:
    """A job over an input shape (`tests/input_shapes.py`) killed at `fault`, then run
    again: what a reader of its results finds against the rows the shape holds, and
    whether the ledger's counts are the records read.

    Raises:
        AssertionError: the kill did not happen or the rerun failed.
    """
    job = FaultJob(
        model_dir, shape.path, output, extra_args=[*shape.cli_args, "--passthrough", "prompt"]
    )
    killed = job.run(fault)
    assert killed.killed, (
        f"{fault}: expected a SIGKILL, got rc {killed.returncode}: " + (killed.output[-1500:])
    )
    rerun = job.run()
    assert rerun.returncode == 0, rerun.output[-2000:]
    tables = [pq.read_table(output / "results" / name) for name in job.published_parts()]
    lost, duplicated = shape.check(pa.concat_tables(tables))
    ledger = json.loads((output / "ledger.json").read_text())
    expected = {
        "rows_ok": len(shape.rows) - shape.rows_failed,
        "rows_failed": shape.rows_failed,
        "rows_skipped_blank": shape.blank,
        "rows_read": shape.rows_read,
    }
    problems = [f"ledger {k} {ledger[k]} != {v}" for k, v in expected.items() if ledger[k] != v]
    temps = [str(p.relative_to(output)) for p in output.rglob("*") if is_temp_name(p.name)]
    failed = shape.rows_failed
    return Outcome(lost, duplicated, temps, not problems, failed, problems)


def _check_copies(rows: pa.Table) -> tuple[int, int]:
    """(rows copied, copies whose answer or bill is not what the rule says): a copy has
    its source's output and finish reason, bills nothing, and its source is computed."""
    if "duplicate_of" not in rows.column_names:
        return 0, 0
    by_id = {r["id"]: r for r in rows.to_pylist()}
    copies = [r for r in by_id.values() if r["duplicate_of"] is not None]
    wrong = 0
    for copy in copies:
        source = by_id.get(copy["duplicate_of"])
        if (
            source is None
            or source["duplicate_of"] is not None
            or (copy["output"], copy["finish_reason"])
            != (source["output"], source["finish_reason"])
            or (copy["prompt_tokens"], copy["cached_tokens"], copy["completion_tokens"])
            != (0, 0, 0)
        ):
            wrong += 1
    return len(copies), wrong


def vision_job(directory: Path, job: FaultJob) -> FaultJob:
    """`job` on a tiny random Gemma 3 vision model (built once in `directory`), its input
    rewritten as an image job's: good images as bytes and as paths under an image root,
    every sixth row a hostile one (`hostile_images`)."""
    model_dir = build_vision_model(directory / "vision-model")
    root = job.input.parent / "images"
    write_image_input(job.input, root)
    options = {"image_column": "image", "image_root": [str(root)], "max_image_pixels": 1_000_000}
    args = ["--image-column", "image", "--image-root", str(root), "--max-image-pixels", "1000000"]
    return FaultJob(model_dir, job.input, job.output, extra_args=args, options=options)


def build_vision_model(directory: Path) -> Path:
    """A tiny random Gemma 3 vision-language model (tests/engine/vision_models.py) with a
    character tokenizer and a chat template that places image parts; built once."""
    if (directory / "preprocessor_config.json").is_file():
        return directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from vision_models import build_gemma3_vlm, save_marker_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    build_gemma3_vlm(directory)
    save_marker_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}"
        "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def hostile_images(root: Path) -> list[dict]:
    """Images no job may run, each as an image cell's struct: a decompression bomb (a
    PNG header claiming 50,000 x 50,000 pixels), a header over the job's pixel limit, a
    truncated PNG, a text file, and a path that climbs out of the image root."""
    import io
    import zlib

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buffer, format="PNG")
    png = buffer.getvalue()
    buffer = io.BytesIO()
    Image.frombytes("RGB", (32, 32), random.Random(1).randbytes(32 * 32 * 3)).save(buffer, "PNG")
    noisy = buffer.getvalue()

    def claiming(width: int, height: int) -> bytes:
        """The PNG with its header's size (and the header's CRC) rewritten."""
        ihdr = b"IHDR" + width.to_bytes(4, "big") + height.to_bytes(4, "big") + png[24:29]
        return png[:12] + ihdr + zlib.crc32(ihdr).to_bytes(4, "big") + png[33:]

    (root.parent / "outside.png").write_bytes(png)
    return [
        {"bytes": claiming(50_000, 50_000), "path": None},  # past Pillow's own bomb check
        {"bytes": claiming(2_000, 1_000), "path": None},  # past the job's max_image_pixels
        {"bytes": noisy[: len(noisy) * 2 // 3], "path": None},  # its header intact
        {"bytes": b"just some text, not an image", "path": None},
        {"bytes": None, "path": str(root / ".." / "outside.png")},
    ]


def write_image_input(path: Path, root: Path, num_rows: int = NUM_ROWS) -> Path:
    """A Parquet input of `num_rows` (id, prompt, image) rows: small random PNGs, as bytes
    and as files under `root`, and every sixth row one of `hostile_images`."""
    import io

    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    hostile = hostile_images(root)
    cells = []
    for i in range(num_rows):
        if i % 6 == 5:
            cells.append(hostile[(i // 6) % len(hostile)])
            continue
        image = Image.new("RGB", (12 + i % 9, 10 + i % 7), tuple(rng.randrange(256) for _ in "rgb"))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        if i % 2:
            (root / f"{i}.png").write_bytes(buffer.getvalue())
            cells.append({"bytes": None, "path": str(root / f"{i}.png")})
        else:
            cells.append({"bytes": buffer.getvalue(), "path": None})
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(
        pa.table(
            {
                "id": [f"id-{i}" for i in range(num_rows)],
                "prompt": [f"describe {'abc'[i % 3] * (1 + i % 4)}" for i in range(num_rows)],
                "image": pa.array(cells, struct),
            }
        ),
        path,
    )
    return path


def build_moe_model(directory: Path) -> Path:
    """A tiny random Qwen3-MoE (8 experts, 2 per token, every layer sparse) with the tiny
    model's tokenizer and chat template, for mixture-of-experts generation fault jobs;
    built once per directory."""
    if (directory / "model.safetensors").is_file() and "Qwen3Moe" in (
        directory / "config.json"
    ).read_text():
        return directory
    import torch
    import transformers
    from tiny_model import build_tiny_model

    build_tiny_model(directory)
    tiny = json.loads((directory / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(
        vocab_size=tiny["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=tiny["max_position_embeddings"],
        bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"],
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def build_embedding_model(directory: Path) -> Path:
    """A tiny random BERT embedding model (mean pooling, normalised, sentence-transformers'
    files) for embedding fault jobs; built once per directory."""
    from pooling_models import build_sentence_encoder

    if not (directory / "modules.json").is_file():
        build_sentence_encoder(directory)
    return directory


# -- process kills at random points ---------------------------------------------------

# Where a job can be killed: kind -> fault spec. "{n}" becomes a random call number
# within what the run will still make (`kill_spec`).
KILL_KINDS = {
    "planning": "plan_window:{n}",
    "mid-shard": "engine_step:{n}",
    "part write": "write@/results/:{n}",
    "stats write": "write@/shard_stats/:{n}",
    "plan write": "write@/_plan/:{n}",
    "fingerprint write": "write@_input.json:1",
    "ledger write": "write@ledger.json:1",
    "ledger dataset write": "write@/ledger/:1",
}
REQUIRED_KINDS = ("planning", "mid-shard", "part write", "ledger write")
LEDGER_KINDS = ("ledger write", "ledger dataset write")


def choose_kill_points(rng: random.Random, num_points: int = 5) -> list[str]:
    """`num_points` (>= 4) kinds of kill: the required four plus random others, in a
    random order except that ledger writes come last (a run killed there has already
    published every part, so no later kill could land in a shard)."""
    others = [k for k in KILL_KINDS if k not in REQUIRED_KINDS]
    kinds = [*REQUIRED_KINDS, *rng.sample(others, max(0, num_points - len(REQUIRED_KINDS)))]
    rng.shuffle(kinds)
    return sorted(kinds, key=lambda k: k in LEDGER_KINDS)


def kill_spec(kind: str, rng: random.Random, *, num_pending: int, num_shards: int) -> str:
    """The fault spec of one kill of `kind`, with a call number the run will reach."""
    limits = {
        "planning": NUM_ROWS // PLAN_WINDOW_ROWS,
        "mid-shard": min(12, num_pending),  # a shard takes >= 1 step (an encoder batch: 1)
        "part write": num_pending,
        "stats write": num_pending,
        "plan write": num_shards,
    }
    return KILL_KINDS[kind].format(n=rng.randint(1, max(1, limits.get(kind, 1))))


def kill_and_resume(job: FaultJob, rng: random.Random, num_points: int = 5) -> list[str]:
    """Kill the job at `num_points` random points in a row, resuming it each time, then
    let a last run finish. Returns the fault specs used.

    Raises:
        AssertionError: a kill did not happen or a run failed.
    """
    num_shards = count_shards(job)
    used = []
    for kind in choose_kill_points(rng, num_points):
        pending = num_shards - len(job.published_parts())
        if kind in ("mid-shard", "part write", "stats write") and pending == 0:
            continue  # every shard is done: none is left to be killed in
        spec = kill_spec(kind, rng, num_pending=pending, num_shards=num_shards)
        result = job.run(spec)
        assert result.killed, (
            f"{spec}: expected a SIGKILL, got rc {result.returncode}: " + (result.output[-1500:])
        )
        used.append(spec)
    final = job.run()
    assert final.returncode == 0, final.output[-2000:]
    return used


def count_shards(job: FaultJob) -> int:
    """The job's number of shards: planned in-process into a scratch output (no model
    is loaded to plan), with the options the CLI runs use."""
    from tokenmill.pipelines.planning import plan_job
    from tokenmill.pipelines.spec import JobSpec

    scratch = job.output.with_name(job.output.name + "-plan-probe")
    options = {"task": "embed"} if job.task == "embed" else {"max_tokens": int(TOKENS[1])}
    spec = JobSpec(
        str(job.input),
        str(scratch),
        model=str(job.model_dir),
        id_column="id",
        shard_tokens=int(TOKENS[3]),
        plan_window_rows=PLAN_WINDOW_ROWS,
        dtype="float32",
        **options,
        **job.options,
    )
    return len(plan_job(spec).shards)


# -- a disk that fills up ----------------------------------------------------------------


class NoSmallDisk(RuntimeError):
    """A small filesystem cannot be mounted here (mounting a tmpfs needs root)."""


DISK_SIZE = "16m"


@contextlib.contextmanager
def small_disk(where: Path):
    """A `DISK_SIZE` tmpfs mounted at `where` (NoSmallDisk where mounting needs root)."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(where)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        raise NoSmallDisk(
            f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode()[:200]}"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Write a ballast file until the disk is full."""
    ballast = disk / "ballast"
    chunk = b"\0" * (1 << 20)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return ballast


def fill_after_first_part(job: FaultJob, disk: Path) -> tuple[int, str, Path]:
    """Run the job, fill the disk once it has published a part; return how it ended."""
    child = job.start()
    try:
        deadline = time.monotonic() + 120
        while not job.published_parts():
            assert child.poll() is None, child.stdout.read()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.005)
        ballast = fill(disk)
        output, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, output, ballast
