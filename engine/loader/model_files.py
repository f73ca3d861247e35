"""Model argument (HF-layout directory, .gguf file, alias or Hub repo id) -> HF-layout
directory.

Hub repo ids ("org/name") resolve to a snapshot in the Hugging Face cache (hub.py).

A GGUF file runs from the file itself: its config and tokenizer files are written once
into a cache directory keyed by the file's content hash and the converter version, with
a `model.gguf` link to the file, from which the loader reads the weights
(gguf_tensors.py); no copy of the weights is written. Such a directory (and an alias's
extracted archive) is written into a temporary directory beside its final place and
renamed into it, so concurrent writers never see or leave a partial model: the first
rename wins and the others discard their identical copies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import tempfile
import time
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader

from tokenmill.engine.env import cache_dir
from tokenmill.engine.loader import hub
from tokenmill.engine.loader.aliases import ALIASES, DEFAULT_MODEL, ModelAlias
from tokenmill.engine.loader.gguf_convert import (
    CONVERSION_RECORD,
    CONVERTER_VERSION,
    GGUF_LINK,
    TABLE_FILE,
    WEIGHTS_FILE,
)
from tokenmill.engine.loader.gguf_tensors import GGUFTensors, index_gguf, link_is_current, relink

SOURCE_RECORD = "tokenmill_source.json"
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_INDEX_FILE = "model.safetensors.index.json"
# Weights in Python's pickle format: unpickling runs whatever code the file names, so
# they are never loaded (torch.load's weights_only is a mitigation, not a guarantee).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Temporary conversion directories older than this belong to a process that died.
_STALE_TMP_SECONDS = 24 * 3600


class ModelFilesError(FileNotFoundError):
    """A model argument that does not lead to a usable model; the message says why."""


@dataclass(frozen=True)
class ModelInfo:
    """What `tokenmill models` shows about one model."""

    name: str
    path: Path | None  # HF-layout directory, or the .gguf file if not converted yet
    architecture: str | None  # e.g. "LlamaForCausalLM"
    num_parameters: int | None
    dtype: str | None  # e.g. "bfloat16", or "gguf:Q4_1" before conversion
    source: str  # "directory" | "gguf" | "alias" | "cache" | "hub ..." (+ a note)
    revision: str | None = None  # the commit of a Hub snapshot
    # A mixture of experts': the parameters one token runs through (its top-k experts
    # of each sparse layer, and everything outside the experts); None for a dense model.
    num_active_parameters: int | None = None


def resolve_model(
    model: str | os.PathLike | None = None,
    *,
    cache_root: str | os.PathLike | None = None,
    revision: str | None = None,
) -> Path:
    """Find or build the HF-layout directory for a model argument.

    Args:
        model: an HF-layout directory, a `.gguf` file, an alias name, a Hub repo id
            ("org/name"), or None for the default alias (`DEFAULT_MODEL`).
        cache_root: where converted GGUF files live; default `cache_dir()`.
        revision: branch, tag or commit of a Hub repo id (default "main").

    Returns:
        A directory with config.json, safetensors weights and tokenizer files; for a repo
        id its snapshot directory, whose name is the commit (`hub.snapshot_revision`).
    """
    if is_hub_model(model):
        return _hub_snapshot(str(model), revision).path
    if revision is not None:
        raise ModelFilesError(
            f"revision {revision!r} given for {str(model)!r}, which is not a Hub repo id"
        )
    kind, path = _locate(model)
    if kind == "directory":
        check_model_dir(path)
        return path
    root = Path(cache_root) if cache_root is not None else cache_dir()
    if kind == "archive":
        return _extract_cached(path, root, _display_name(model))
    return _convert_cached(path, root, _display_name(model))


def check_model_dir(path: str | os.PathLike) -> None:
    """Raise ModelFilesError naming every file an HF-layout directory is missing."""
    path = Path(path)
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    try:
        missing += [f.name for f in weight_files(path) if not f.is_file()]
    except ModelFilesError as error:
        missing.append(str(error))
    if missing:
        raise ModelFilesError(f"model directory {path} is missing: {', '.join(missing)}")


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model directory (one file, or the shards of an index),
    or the link to the GGUF file a GGUF model's directory reads its weights from.

    The one lister: loading reads exactly these files and `weights_hash` hashes exactly
    these, so the hash in a ledger covers what was loaded. Other `*.safetensors` files
    in the directory (an adapter, a consolidated copy) are neither loaded nor hashed.

    Raises:
        ModelFilesError: neither model.safetensors nor an index is there.
    """
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        return [model_dir / name for name in sorted(set(shards))]
    if (model_dir / WEIGHTS_FILE).is_file():
        return [model_dir / WEIGHTS_FILE]
    gguf = model_dir / GGUF_LINK
    if gguf.is_symlink() or gguf.is_file():  # a link, or a copy made by following it
        return [gguf]
    raise ModelFilesError(f"{WEIGHTS_FILE} or {_INDEX_FILE}{_pickle_note(model_dir)}")


def _pickle_note(model_dir: Path) -> str:
    """Why the pickled weights next to a missing safetensors file are not an option."""
    pickled = sorted(p.name for p in model_dir.glob("*") if p.suffix.lower() in PICKLE_SUFFIXES)
    if not pickled:
        return ""
    return (
        f" (found {', '.join(pickled[:3])}{' ...' if len(pickled) > 3 else ''}: pickled "
        "weights are never loaded, because unpickling can run code from the file; "
        "convert them to safetensors, e.g. with transformers' save_pretrained)"
    )


def weights_hash(model_dir: str | os.PathLike) -> str:
    """A stable sha256 over the weight files' contents, for the job ledger.

    Args:
        model_dir: an HF-layout directory.

    Returns:
        64 hex digits. Read from the conversion record when there is one; otherwise each
        file is hashed once and its digest cached by (path, size, mtime).
    """
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    record_file = model_dir / CONVERSION_RECORD
    recorded = {}
    if record_file.is_file():
        recorded = json.loads(record_file.read_text(encoding="utf-8")).get("weights_sha256", {})
    digests = [(f.name, recorded.get(f.name) or file_sha256(f)) for f in files]
    return hashlib.sha256("\n".join(f"{n} {d}" for n, d in digests).encode()).hexdigest()


def file_sha256(path: str | os.PathLike, *, cache_root: str | os.PathLike | None = None) -> str:
    """sha256 of a file's bytes, remembered in the cache keyed by (path, size, mtime)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    index_file = (Path(cache_root) if cache_root is not None else cache_dir()) / "digests.json"
    known = _read_json(index_file)
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    # Re-read before writing so concurrent hashers lose at most each other's newest entry;
    # entries for older versions of this file are dropped.
    known = {k: v for k, v in _read_json(index_file).items() if not k.startswith(f"{path}|")}
    known[key] = digest.hexdigest()
    _write_json_atomic(index_file, known)
    return known[key]


def model_info(model: str | os.PathLike | None = None, *, revision: str | None = None) -> ModelInfo:
    """Describe a model without converting it.

    Args:
        model: as for `resolve_model` (a Hub repo id is fetched if it is not cached).
        revision: as for `resolve_model`.

    Returns:
        Its ModelInfo; a GGUF not converted yet is described from its own header.
    """
    if is_hub_model(model):
        snapshot = _hub_snapshot(str(model), revision)
        info = _dir_info(snapshot.repo_id, snapshot.path, "hub")
        return dataclasses.replace(info, revision=snapshot.revision)
    kind, path = _locate(model)
    name = _display_name(model)
    if kind == "directory":
        check_model_dir(path)
        return _dir_info(name, path, "directory")
    source = "alias" if name in ALIASES else "gguf"
    if kind == "archive":
        return _dir_info(name, _extract_cached(path, cache_dir(), name), source)
    converted = _converted_path(path, cache_dir())
    if converted.is_dir():
        return _dir_info(name, converted, source)
    return _gguf_info(name, path, f"{source} (not indexed yet)")


def list_models() -> list[ModelInfo]:
    """Every alias (installed or not), every conversion in the cache and every model
    snapshot in the Hugging Face cache."""
    infos = []
    for alias in ALIASES.values():
        try:
            infos.append(model_info(alias.name))
        except ModelFilesError:
            note = f"alias (not installed: {alias.install_command})"
            infos.append(ModelInfo(alias.name, None, None, None, None, note))
    listed = {info.path for info in infos}
    models_dir = cache_dir() / "models"
    entries = sorted(models_dir.iterdir()) if models_dir.is_dir() else []
    for entry in entries:
        if entry.name.startswith(".") or entry in listed or not entry.is_dir():
            continue
        name = _read_json(entry / SOURCE_RECORD).get("name", entry.name)
        infos.append(_dir_info(name, entry, "cache"))
    for snapshot in hub.cached_snapshots():
        try:
            info = _dir_info(snapshot.repo_id, snapshot.path, f"hub @ {snapshot.revision[:12]}")
        except (ModelFilesError, OSError, ValueError):  # a partial download
            note = f"hub @ {snapshot.revision[:12]} (incomplete: pull it again)"
            info = ModelInfo(snapshot.repo_id, snapshot.path, None, None, None, note)
        infos.append(dataclasses.replace(info, revision=snapshot.revision))
    return infos


def is_hub_model(model: str | os.PathLike | None) -> bool:
    """Whether a model argument names a Hub repo: "org/name", not an alias or a local path."""
    return (
        isinstance(model, str)
        and model not in ALIASES
        and hub.is_repo_id(model)
        and not Path(model).expanduser().exists()
    )


def _hub_snapshot(repo_id: str, revision: str | None) -> hub.HubSnapshot:
    try:
        snapshot = hub.download(repo_id, revision)
        check_model_dir(snapshot.path)
    except hub.HubError as error:
        raise ModelFilesError(str(error)) from None
    return snapshot


def alias_gguf_path(alias: ModelAlias) -> Path:
    """The file of an alias (its GGUF, or its model archive), found in its installed
    package without importing it."""
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    missing = ModelFilesError(
        f"model {alias.name!r} needs the {alias.pip_spec.split('==')[0]} package; "
        f"install it with `{alias.install_command}`"
    )
    if not locations:
        raise missing
    if alias.is_assembled:
        try:  # the package's module is a few lines of hashlib and pathlib
            module = importlib.import_module(alias.package)
            return _already_joined(module) or Path(module.assemble())
        except (ImportError, FileNotFoundError) as error:  # a part package is missing
            raise missing from error
    path = Path(locations[0]) / alias.filename
    if not path.is_file():
        raise missing
    return path


def _already_joined(module) -> Path | None:
    """The file an earlier `assemble()` of this alias package joined, where its sha256 -
    remembered by (path, size, mtime) - is the one the package expects; else None.
    `assemble()` itself hashes the whole file on every call, that is on every start."""
    expected = getattr(module, "EXPECTED_SHA256", None)
    output_path = getattr(module, "default_output_path", None)
    if not isinstance(expected, str) or output_path is None:
        return None
    path = Path(output_path())
    return path if path.is_file() and file_sha256(path) == expected else None


def _locate(model: str | os.PathLike | None) -> tuple[str, Path]:
    """("directory" | "gguf" | "archive", path) for a model argument."""
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in ALIASES:
        alias = ALIASES[model]
        return ("archive" if alias.is_archive else "gguf"), alias_gguf_path(alias)
    path = Path(model).expanduser()
    if path.is_dir():
        return "directory", path.resolve()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf", path.resolve()
    if path.is_file():
        raise ModelFilesError(f"{path} is a file but not a .gguf file")
    raise ModelFilesError(
        f"no model {str(model)!r}: not a directory, a .gguf file, a Hub repo id (org/name), "
        f"or an alias ({', '.join(sorted(ALIASES))})"
    )


def _converted_path(gguf_path: Path, root: Path) -> Path:
    digest = file_sha256(gguf_path, cache_root=root)
    return root / "models" / f"gguf-{digest[:32]}-v{CONVERTER_VERSION}"


def _convert_cached(gguf_path: Path, root: Path, name: str) -> Path:
    digest = file_sha256(gguf_path, cache_root=root)

    def index(tmp: Path) -> dict:
        index_gguf(gguf_path, tmp, digest)
        return {"name": name, "gguf_file": str(gguf_path), "gguf_sha256": digest}

    model_dir = _build_once(_converted_path(gguf_path, root), index)
    if not link_is_current(model_dir):
        # The file it was indexed from moved, is gone or was touched; this one has the
        # same bytes (its sha256 is the directory's key).
        relink(model_dir, gguf_path)
    return model_dir


def _extract_cached(archive: Path, root: Path, name: str) -> Path:
    """An alias's zipped HF-layout directory, extracted once into the cache (keyed by the
    archive's sha256), with the same atomic rename as a GGUF conversion.

    Raises:
        ModelFilesError: the archive holds a path outside its directory, or not a model.
    """
    digest = file_sha256(archive, cache_root=root)

    def extract(tmp: Path) -> dict:
        with zipfile.ZipFile(archive) as zipped:
            for member in zipped.namelist():
                target = (tmp / member).resolve()
                if not target.is_relative_to(tmp.resolve()):
                    raise ModelFilesError(f"{archive} holds a path outside its model: {member}")
            zipped.extractall(tmp)
        check_model_dir(tmp)
        return {"name": name, "archive": str(archive), "archive_sha256": digest}

    return _build_once(root / "models" / f"zip-{digest[:32]}", extract)


def _build_once(final: Path, build: Callable[[Path], dict]) -> Path:
    """The model directory `final`, built by `build` into a private temporary directory
    beside it (returning its source record) and renamed into place in one step, unless
    it exists: a reader never sees half a model, and of two processes building it at
    once, the first rename wins and the other's identical copy is dropped."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        source = build(tmp)
        _write_json_atomic(tmp / SOURCE_RECORD, source)
        # mkdtemp/mkstemp create private entries; give them the umask's mode like the rest.
        shutil.copymode(tmp / "config.json", tmp / SOURCE_RECORD)
        shutil.copymode(final.parent, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _remove_stale_tmp(parent: Path) -> None:
    cutoff = time.time() - _STALE_TMP_SECONDS
    for entry in [*parent.glob(".gguf-*.tmp-*"), *parent.glob(".zip-*.tmp-*")]:
        try:
            if entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:
            pass  # removed by someone else meanwhile


def _dir_info(name: str, path: Path, source: str) -> ModelInfo:
    config = _read_json(path / "config.json")
    architectures = config.get("architectures") or [config.get("model_type")]
    if (path / TABLE_FILE).is_file():
        return _indexed_gguf_info(name, path, source)
    num_by_dtype: Counter[str] = Counter()
    num_experts_params = 0
    mxfp4 = (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    for file in weight_files(path):
        for key, tensor in _safetensors_header(file).items():
            if key != "__metadata__":
                numel = _numel(tensor["shape"])
                if mxfp4 and tensor["dtype"] == "U8" and key.endswith(("_blocks", "_scales")):
                    # MXFP4: two weights a byte; a scale per 32 of them is no parameter.
                    numel = 2 * numel if key.endswith("_blocks") else 0
                    tensor = {**tensor, "dtype": "mxfp4"}
                num_by_dtype[tensor["dtype"]] += numel
                if ".experts." in key:
                    num_experts_params += numel
    dtype = num_by_dtype.most_common(1)[0][0] if num_by_dtype else None
    total = sum(num_by_dtype.values())
    return ModelInfo(
        name=name,
        path=path,
        architecture=architectures[0],
        num_parameters=total,
        dtype=_SAFETENSORS_DTYPES.get(dtype, dtype),
        source=source,
        num_active_parameters=_active(total, num_experts_params, config),
    )


def _active(total: int, num_experts_params: int, config: dict) -> int | None:
    """The parameters a token runs through: all but the experts its router passes over
    (every sparse layer keeps num_experts_per_tok of num_experts); None without experts."""
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    used = config.get("num_experts_per_tok")
    if not num_experts_params or not num_experts or not used:
        return None
    return total - num_experts_params * (num_experts - used) // num_experts


def _gguf_info(name: str, path: Path, source: str) -> ModelInfo:
    """A GGUF not indexed yet, described from its header (`source` as given)."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def get(key: str):
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    counts = [(t.name, t.tensor_type.name, int(t.n_elements)) for t in reader.tensors]
    experts = {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count")}
    return _gguf_counts_info(name, path, f"gguf:{arch}", source, counts, experts)


def _indexed_gguf_info(name: str, path: Path, source: str) -> ModelInfo:
    """A GGUF model's directory, described from the tensor table written when indexed."""
    tensors = GGUFTensors.open_dir(path, check_file=False)
    counts = [(e.name, e.kind, math.prod(e.dims)) for e in tensors.entries]
    architecture = (tensors.config.get("architectures") or ["?"])[0]
    return _gguf_counts_info(name, path, architecture, source, counts, tensors.config)


# llama.cpp's experts are stacks (blk.0.ffn_up_exps.weight) or, in its older layout, one
# tensor per expert (blk.0.ffn_up.3.weight).
_ONE_EXPERT = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")


def _gguf_counts_info(name, path, architecture, source, counts, config) -> ModelInfo:
    """counts: (GGUF name, GGML type, elements) of every tensor."""
    num_by_type: Counter[str] = Counter()
    num_experts_params = 0
    for tensor_name, kind, numel in counts:
        if tensor_name == "rope_freqs.weight":
            continue  # not a weight: the loader turns it into `rope_scaling`
        num_by_type[kind] += numel
        if "_exps." in tensor_name or _ONE_EXPERT.fullmatch(tensor_name):
            num_experts_params += numel
    total = sum(num_by_type.values())
    return ModelInfo(
        name=name,
        path=path,
        architecture=architecture,
        num_parameters=total,
        dtype=f"gguf:{num_by_type.most_common(1)[0][0]}",
        source=source,
        num_active_parameters=_active(total, num_experts_params, config),
    )


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def _safetensors_header(path: Path) -> dict:
    # Format: 8-byte little-endian header length, then the JSON header.
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def display_name(model: str | os.PathLike | None) -> str:
    """How ledgers and outputs name a model: the alias, or its directory's or file's base name."""
    if model is None:
        return DEFAULT_MODEL
    path = Path(model)
    return path.name if path.exists() else str(model)


def _display_name(model: str | os.PathLike | None) -> str:
    # `tokenmill models` shows a model as the user named it (a path in full).
    return DEFAULT_MODEL if model is None else str(model)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
