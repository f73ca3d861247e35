"""The systems a benchmark compares, and the job each one's process receives.

A system is an engine at a precision with its settings: tokenmill at each requested
dtype, and the baselines (HF transformers `generate`, llama-cpp-python, vLLM). Each
timed run happens in a fresh process (`tokenmill.bench.child`) so peak RSS is that
system's alone and no system inherits another's warm caches or thread pools.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.bench.llamacpp import FORMATS

KINDS = ("tokenmill", "hf", "llamacpp", "llamacpp-server", "vllm")
# Baseline names accepted by `--baseline` -> (kind, dtype).
BASELINES = {
    "hf": ("hf", "float32"),
    "hf-bf16": ("hf", "bfloat16"),
    "llamacpp": ("llamacpp", "float32"),
    # llama.cpp's C++ server: parallel slots, continuous batching, the GGUF's own types.
    "llamacpp-server": ("llamacpp-server", "float32"),
    "vllm": ("vllm", "bfloat16"),
}
DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
HF_BATCH_SIZES = (8, 16, 32, 64)


@dataclass(frozen=True)
class SystemSpec:
    """One engine at one precision with its settings.

    options by kind - tokenmill: {"engine_args": {...LLM keyword arguments}}, plus on a
    structured workload {"structured": True} (enforce its JSON schema) or
    {"output_lens_from": LABEL} (generate, EOS ignored, exactly as many tokens per request
    as system LABEL did earlier in the same round), on a LoRA workload {"lora": "mixed"}
    (each request with its adapter, one generate call) or {"lora": "merged"} (merge each
    adapter into the weights, load, run its requests, in turn) with {"adapters": [dirs]};
    hf: {"batch_size": N};
    llamacpp: {"gguf": path}; llamacpp-server: {"gguf": path, "server": binary, "parallel":
    slots (optional), "args": [extra command-line arguments] (optional)}; either with
    "format" (the llama.cpp format the GGUF was made in, e.g. "Q4_0").
    tokenmill may run another model file than the benchmark's ({"model": path}).
    vllm: {"engine_args": {...}}.
    python: the interpreter that runs it (vLLM usually lives in its own environment).
    """

    label: str
    kind: str
    dtype: str
    is_baseline: bool
    options: dict = field(default_factory=dict)
    python: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown system kind {self.kind!r}; choose from {', '.join(KINDS)}")

    def with_options(self, **options: object) -> SystemSpec:
        return SystemSpec(
            self.label,
            self.kind,
            self.dtype,
            self.is_baseline,
            {**self.options, **options},
            self.python,
        )


@dataclass(frozen=True)
class Job:
    """Everything a child process needs to run one system once (written as JSON)."""

    system: SystemSpec
    model_dir: str
    workload_path: str
    device: str = "cpu"
    threads: int | None = None
    output_lens: list[int] | None = None  # overrides the workload's, per request

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, path: str | Path) -> Job:
        raw = json.loads(Path(path).read_text())
        return cls(**{**raw, "system": SystemSpec(**raw["system"])})


def tokenmill_systems(
    dtypes: list[str],
    engine_args: dict | None = None,
    quantizations: list[str] = (),
    *,
    structured: bool = False,
    kv_cache_dtypes: list[str] = (),
    gguf_files: dict[str, str] | None = None,
    lora_adapters: list[str] = (),
    checkpoints: list[str] = (),
) -> list[SystemSpec]:
    """tokenmill at each dtype, labelled e.g. "tokenmill-bf16", then each quantization
    ("tokenmill-int8"), which runs its float parts in the engine's best float precision
    here (bf16 on CPUs with native bf16, else fp32) - the precision it is compared with.
    Each of those runs once per KV cache dtype (none given: on the engine's default
    cache); a cache in another format is labelled with the format's label, an int8 one
    "-kv8" ("tokenmill-int8-kv8").

    "gguf:FMT" is the gguf mode on the model's file in llama.cpp format FMT, taken from
    gguf_files (FMT -> path; the harness makes them with llama-quantize), labelled
    "tokenmill-gguf-FMT".

    Each of `checkpoints` (a directory of the same model quantized by another tool:
    compressed-tensors, GPTQ, AWQ, FP8) runs as it is stored, its float parts in the
    engine's best float precision, labelled "tokenmill-ckpt-DIRNAME" and compared with
    every quantization mode run beside it (`counterparts`).

    With `structured`, each dtype runs twice per round: first constrained to the
    workload's schema ("tokenmill-bf16-json"), then unconstrained as its baseline,
    generating exactly the token counts the constrained run produced - so the two walls
    compare the same prompts and the same number of generated tokens.

    With `lora_adapters` (a LoRA workload), each dtype runs three ways per round: merging
    each adapter in turn ("tokenmill-fp32-merged"), every adapter in one call
    ("tokenmill-fp32-lora"), and the base model on the same requests ("tokenmill-fp32").
    """
    from tokenmill.engine import kv_cache_format

    specs = []
    for kv_cache_dtype in kv_cache_dtypes or [None]:
        args = dict(engine_args or {})
        # Labels and comparisons name only what differs from the default cache.
        if kv_cache_dtype is not None and not kv_cache_format(kv_cache_dtype).is_default:
            args["kv_cache_dtype"] = kv_cache_dtype
        plain = _tokenmill_systems_with(dtypes, args, quantizations, structured, gguf_files or {})
        plain += [_checkpoint_system(path, args) for path in checkpoints]
        specs += _with_lora(plain, list(lora_adapters)) if lora_adapters else plain
    return specs


def _with_lora(specs: list[SystemSpec], adapters: list[str]) -> list[SystemSpec]:
    """Before each system, its merge-per-adapter and mixed-adapter runs."""
    out = []
    for spec in specs:
        for mode in ("merged", "lora"):
            out.append(
                SystemSpec(
                    f"{spec.label}-{mode}",
                    spec.kind,
                    spec.dtype,
                    False,
                    {
                        **spec.options,
                        "lora": "mixed" if mode == "lora" else mode,
                        "adapters": adapters,
                    },
                )
            )
        out.append(spec)
    return out


def _kv_suffix(engine_args: dict) -> str:
    """ "-" and the KV-cache format's label where the system sets one ("-kv8")."""
    from tokenmill.engine import kv_cache_format

    kv_cache_dtype = engine_args.get("kv_cache_dtype")
    label = kv_cache_format(kv_cache_dtype).label if kv_cache_dtype else ""
    return f"-{label}" if label else ""


def _tokenmill_systems_with(
    dtypes: list[str],
    engine_args: dict,
    quantizations: list[str],
    structured: bool,
    gguf_files: dict[str, str],
) -> list[SystemSpec]:
    kv = _kv_suffix(engine_args)
    specs = []
    for dtype in dtypes:
        label = f"tokenmill-{DTYPE_SHORT.get(dtype, dtype)}{kv}"
        options = {"engine_args": dict(engine_args)}
        if not structured:
            specs.append(SystemSpec(label, "tokenmill", dtype, False, options))
            continue
        constrained = SystemSpec(
            f"{label}-json", "tokenmill", dtype, False, options | {"structured": True}
        )
        free = SystemSpec(
            label, "tokenmill", dtype, True, options | {"output_lens_from": constrained.label}
        )
        specs += [constrained, free]
    for quantization in quantizations:
        name, _, fmt = quantization.partition(":")
        method, variant_args = QUANTIZATION_VARIANTS.get(name, (name, {}))
        options: dict = {"engine_args": {**engine_args, "quantization": method, **variant_args}}
        if fmt:
            if fmt not in gguf_files:
                raise ValueError(f"{quantization}: no {fmt} GGUF was prepared")
            options |= {"model": gguf_files[fmt], "format": fmt}
        label = f"tokenmill-{name}{'-' + fmt if fmt else ''}{kv}"
        specs.append(SystemSpec(label, "tokenmill", best_float_dtype(), False, options))
    return specs


def _checkpoint_system(path: str, engine_args: dict) -> SystemSpec:
    label = f"tokenmill-ckpt-{Path(path).name}{_kv_suffix(engine_args)}"
    options = {"engine_args": dict(engine_args), "model": path, "checkpoint": True}
    return SystemSpec(label, "tokenmill", best_float_dtype(), False, options)


# Bench names for a quantization mode with other settings: name -> (mode, LLM settings).
QUANTIZATION_VARIANTS = {
    "int8-head": ("int8", {"quantize_lm_head": True}),
    "gguf-head": ("gguf", {"quantize_lm_head": True}),
}


def split_quantization(name: str) -> tuple[str, str | None]:
    """ "gguf:Q4_0" and "gguf-head:Q4_0" -> ("gguf", "Q4_0"); "int8" and "int8-head" ->
    ("int8", None)."""
    name, _, fmt = name.partition(":")
    method = QUANTIZATION_VARIANTS.get(name, (name,))[0]
    if fmt and method != "gguf":
        raise ValueError(f"{name}:{fmt}: only gguf takes a file format (gguf:FMT)")
    return method, fmt or None


# A tokenmill mode's weights -> the llama.cpp formats of the same precision class, the
# runs it is compared with like for like: bf16 with BF16, int8 with the 8- and 4-bit
# integer formats (llama.cpp computes both with int8 dot products), a GGUF's own blocks
# with the same file's format.
_PEERS = {
    "float32": ("F32",),
    "bfloat16": ("BF16",),
    "int8": ("Q8_0", "Q4_0"),
    "int4": ("Q4_0", "Q4_1"),
}


def peer_formats(spec: SystemSpec, source_format: str | None = None) -> tuple[str, ...]:
    """The llama.cpp formats tokenmill system `spec` is compared with like for like.

    source_format: the layer format of the model's own GGUF (the file plain "gguf" runs).
    """
    if spec.kind != "tokenmill":
        return ()
    quantization = spec.options.get("engine_args", {}).get("quantization")
    if quantization == "gguf":
        fmt = spec.options.get("format") or source_format
        return (fmt,) if fmt else ()
    return _PEERS.get(quantization or spec.dtype, ())


def best_float_dtype() -> str:
    """The float precision tokenmill runs fastest in on this machine's CPU."""
    import torch

    from tokenmill.engine import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")


def counterparts(spec: SystemSpec, specs: list[SystemSpec]) -> list[SystemSpec]:
    """The tokenmill systems a tokenmill system is compared with besides the baselines
    (those that ran): a quantized one or one with an int8 KV cache with the plain float
    system at its dtype; a quantized one also with the unquantized one on the same KV
    cache, and one with an int8 KV cache with the same system on the default cache."""
    if spec.kind != "tokenmill":
        return []
    args = spec.options.get("engine_args", {})

    def differing_only_in(other: SystemSpec, *keys: str) -> bool:
        theirs = other.options.get("engine_args", {})
        rest = {k: v for k, v in args.items() if k not in keys}
        return (
            other.kind == "tokenmill"
            and other.dtype == spec.dtype
            and other.label != spec.label
            and not other.options.get("checkpoint")  # another model's weights
            and other.options.get("structured") == spec.options.get("structured")
            and {k: v for k, v in theirs.items() if k not in keys} == rest
            and not any(k in theirs for k in keys)
        )

    found = []
    if spec.options.get("lora") == "mixed":  # against the base model and merging
        found += [
            o
            for o in specs
            if o.kind == "tokenmill"
            and o.dtype == spec.dtype
            and o.options.get("lora") in (None, "merged")
            and o.options.get("engine_args", {}) == args
        ]
    if "quantization" in args and "kv_cache_dtype" in args:
        found += [o for o in specs if differing_only_in(o, "quantization", "kv_cache_dtype")]
    if "quantization" in args:
        found += [o for o in specs if differing_only_in(o, "quantization")]
    if spec.options.get("checkpoint"):  # against the float run and each mode beside it
        found += [
            o
            for o in specs
            if o.kind == "tokenmill"
            and o.dtype == spec.dtype
            and not o.options.get("checkpoint")
            and o.options.get("lora") is None
            and {k: v for k, v in o.options.get("engine_args", {}).items() if k != "quantization"}
            == args
        ]
    if "kv_cache_dtype" in args:
        found += [o for o in specs if differing_only_in(o, "kv_cache_dtype")]
    return found


def baseline_systems(
    names: list[str],
    *,
    llamacpp_gguf: str | None = None,
    vllm_python: str | None = None,
    vllm_args: dict | None = None,
    llama_server: str | None = None,
    llama_server_slots: int | None = None,
    llamacpp_ggufs: dict[str, str] | None = None,
    llama_server_args: tuple[str, ...] = (),
) -> tuple[list[SystemSpec], list[str]]:
    """The requested baselines that can run here, and a note for each that cannot.

    Args:
        names: keys of BASELINES.
        llamacpp_gguf: the GGUF file llama.cpp runs (default: the model's source GGUF).
        vllm_python: interpreter with vLLM installed (default: this one).
        vllm_args: extra keyword arguments for vllm.LLM.
        llama_server: the llama-server binary (default: $TOKENMILL_LLAMA_SERVER).
        llama_server_slots: its parallel slots (default: one per request, at most 64, or
            the harness's sweep).
        llamacpp_ggufs: {format: GGUF path}: llama.cpp runs each, as a system of its own
            labelled with the format ("llama-server-Q4_0"), instead of llamacpp_gguf.
        llama_server_args: extra command-line arguments for llama-server.

    Returns:
        (systems, notes about skipped baselines).
    """
    systems, notes = [], []
    files = llamacpp_ggufs or {None: llamacpp_gguf}
    for name in names:
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
        kind, dtype = BASELINES[name]
        label = f"{kind}-{DTYPE_SHORT[dtype]}"
        if kind == "hf":
            if not _importable("transformers"):
                notes.append(f"{name}: skipped - transformers is not installed")
                continue
            systems.append(SystemSpec(label, kind, dtype, is_baseline=True))
        elif kind == "llamacpp":
            if not _importable("llama_cpp"):
                notes.append(
                    "llamacpp: skipped - llama-cpp-python is not installed "
                    "(pip install llama-cpp-python; builds from source in ~12 min)"
                )
                continue
            # Labelled without a dtype, like the server: llama.cpp runs the GGUF's own
            # tensor types (the default model's is Q4_1), not fp32.
            for fmt, gguf in files.items():
                options = {"gguf": gguf} | ({"format": fmt} if fmt else {})
                label = f"{kind}-{fmt}" if fmt else kind
                systems.append(SystemSpec(label, kind, _format_dtype(fmt, dtype), True, options))
        elif kind == "llamacpp-server":
            binary = llama_server or os.environ.get("TOKENMILL_LLAMA_SERVER")
            if not binary or not Path(binary).is_file():
                notes.append(
                    "llamacpp-server: skipped - no llama-server binary (build it from "
                    "llama.cpp's sources and pass --llama-bin-dir DIR or --llama-server PATH; "
                    'see docs/performance.md, "Baselines")'
                )
                continue
            for fmt, gguf in files.items():
                options = {"gguf": gguf, "server": str(Path(binary).resolve())}
                if fmt:
                    options["format"] = fmt
                if llama_server_slots is not None:
                    options["parallel"] = llama_server_slots
                if llama_server_args:
                    options["args"] = list(llama_server_args)
                label = f"llama-server-{fmt}" if fmt else kind
                systems.append(SystemSpec(label, kind, _format_dtype(fmt, dtype), True, options))
        else:
            python = vllm_python or sys.executable
            if not _importable("vllm", python):
                notes.append(f"vllm: skipped - vllm is not importable by {python}")
                continue
            options = {"engine_args": dict(vllm_args or {})}
            systems.append(SystemSpec(label, kind, dtype, True, options, python=vllm_python))
    return systems, notes


def _format_dtype(fmt: str | None, default: str) -> str:
    """The matmul peak a llama.cpp run in this format is measured against."""
    return FORMATS[fmt].dtype if fmt else default


def _importable(module: str, python: str | None = None) -> bool:
    if python is None or Path(python).resolve() == Path(sys.executable).resolve():
        return importlib.util.find_spec(module) is not None
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return (
            subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
