"""Hugging Face Hub repo ids ("org/name") -> a snapshot directory in the HF cache.

Only what the engine loads is fetched: the config, the tokenizer files (the chat template
lives in chat_template.jinja in current repos, in tokenizer_config.json in older ones)
and the safetensors weights with their index - never pickled .bin/.pt weights.
`huggingface_hub` does the work, so HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN
mean what they mean everywhere else, and its progress bars show while files download.

A snapshot lives at `<cache>/models--org--name/snapshots/<commit>/`: the directory names
the exact commit it holds, which is what identifies the model in a ledger or a job
(`snapshot_revision`). Everything that can go wrong (offline and not cached, an unknown,
private or gated repo, a repo without safetensors) raises HubError with a message that
names the repo and what to do; tokens never appear in messages.

`huggingface_hub` is imported where it is used: a few hundred milliseconds that only a
job naming a Hub model should pay.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# What a snapshot needs for the engine (fnmatch patterns over the repo's file paths).
HUB_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    # A vision model's image processor (transformers reads processor_config.json's first).
    "preprocessor_config.json",
    "processor_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
)
# org/name as the Hub spells repo ids: letters, digits, "-", "_", "." (no leading "." or "-").
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubError(FileNotFoundError):
    """A Hub repo id that cannot be had; the message names it and what to do."""


@dataclass(frozen=True)
class HubSnapshot:
    """A model snapshot in the HF cache."""

    repo_id: str
    revision: str  # the 40-hex commit the snapshot holds
    path: Path  # the snapshot directory (an HF-layout model directory)


def is_repo_id(model: str) -> bool:
    """Whether `model` is spelled like a Hub repo id ("org/name"); paths are checked first."""
    return bool(_REPO_ID.match(model)) and ".." not in model


def download(repo_id: str, revision: str | None = None) -> HubSnapshot:
    """The snapshot of `repo_id` at `revision`, downloaded (only the engine's files) unless
    it is in the cache already.

    Args:
        repo_id: "org/name".
        revision: a branch, tag or commit; None = "main".

    Returns:
        The snapshot, with the commit it resolved to.

    Raises:
        HubError: offline and not cached, unknown/private/gated repo, unknown revision, or a
            repo without safetensors weights.
    """
    label = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    path = download_files(repo_id, revision, HUB_FILE_PATTERNS)
    check_snapshot(path, label)
    return HubSnapshot(repo_id, path.name, path)


def download_files(
    repo_id: str, revision: str | None, patterns: tuple[str, ...], *, kind: str = "model"
) -> Path:
    """The snapshot directory of `repo_id` at `revision` holding the files that match
    `patterns` (fetched unless cached); its name is the commit.

    Args:
        kind: what the repo holds, for messages ("model", "LoRA adapter").

    Raises:
        HubError: as `download`, naming the repo as a `kind`.
    """
    from huggingface_hub import snapshot_download

    label = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns)))
    except Exception as error:  # huggingface_hub's errors, mapped to what to do
        raise _hub_error(error, repo_id, label, kind) from None


def check_snapshot(path: Path, label: str) -> None:
    """Raise HubError unless the snapshot has a config and safetensors weights."""
    if not (path / "config.json").is_file():
        raise HubError(f"model {label} has no config.json: not a transformers model repo")
    if not any(path.glob("*.safetensors")):
        raise HubError(
            f"model {label} has no safetensors weights, and pickled .bin/.pt weights are "
            "never loaded: pick a repo (or revision) that has *.safetensors, or convert the "
            "weights to safetensors yourself"
        )


def snapshot_revision(model_dir: str | os.PathLike) -> str | None:
    """The commit a directory in the HF cache holds (`.../snapshots/<commit>`), else None."""
    path = Path(model_dir)
    if path.parent.name == "snapshots" and _COMMIT.match(path.name):
        return path.name
    return None


def cached_snapshots() -> list[HubSnapshot]:
    """Every model snapshot in the HF cache, newest first within a repo."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    snapshots = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: -r.last_modified):
            snapshots.append(
                HubSnapshot(repo.repo_id, revision.commit_hash, revision.snapshot_path)
            )
    return snapshots


def _hub_error(error: Exception, repo_id: str, label: str, kind: str = "model") -> HubError:
    from huggingface_hub import errors

    if kind != "model":
        return _files_error(error, repo_id, label, kind)

    if isinstance(error, errors.GatedRepoError):
        return HubError(
            f"model {label} is gated: accept its licence on the model's Hub page, then set "
            "HF_TOKEN (or run `hf auth login`) with an account that has access"
        )
    if isinstance(error, errors.RepositoryNotFoundError):
        return HubError(
            f"no model {repo_id!r} on the Hugging Face Hub: check the spelling; if it is "
            "private, set HF_TOKEN (or run `hf auth login`) with an account that can read it"
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return HubError(f"model {label}: no such revision (branch, tag or commit) in the repo")
    if isinstance(error, errors.LocalEntryNotFoundError):
        if _is_offline():
            return HubError(
                f"model {label} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
                f"run `tokenmill models pull {repo_id}` where the Hub can be reached (with "
                "the same HF_HOME / HF_HUB_CACHE), or unset HF_HUB_OFFLINE"
            )
        return HubError(
            f"model {label} could not be downloaded (the Hub did not answer) and is not in the "
            "Hugging Face cache: check the network, or pull it where the Hub can be reached"
        )
    if isinstance(error, errors.IncompleteSnapshotError):
        return HubError(
            f"model {label} is only partly in the Hugging Face cache (an interrupted "
            f"download): run `tokenmill models pull {repo_id}` again with the Hub reachable"
        )
    if isinstance(error, errors.HFValidationError):
        return HubError(f"{repo_id!r} is not a valid Hub repo id")
    return HubError(f"model {label} could not be fetched: {type(error).__name__}: {error}")


def _is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _files_error(error: Exception, repo_id: str, label: str, kind: str) -> HubError:
    """`_hub_error` for a repo that is not a model (no `tokenmill models pull` for it)."""
    from huggingface_hub import errors

    if isinstance(error, errors.GatedRepoError):
        return HubError(f"{kind} {label} is gated: set HF_TOKEN with an account that has access")
    if isinstance(error, errors.RepositoryNotFoundError):
        return HubError(f"no {kind} {repo_id!r} on the Hugging Face Hub: check the spelling")
    if isinstance(error, errors.RevisionNotFoundError):
        return HubError(f"{kind} {label}: no such revision (branch, tag or commit) in the repo")
    if isinstance(error, errors.LocalEntryNotFoundError):
        where = "HF_HUB_OFFLINE is set" if _is_offline() else "the Hub did not answer"
        return HubError(
            f"{kind} {label} is not in the Hugging Face cache and {where}: download it "
            f"where the Hub can be reached (`hf download {repo_id}`, same HF_HOME)"
        )
    if isinstance(error, errors.HFValidationError):
        return HubError(f"{repo_id!r} is not a valid Hub repo id")
    return HubError(f"{kind} {label} could not be fetched: {type(error).__name__}: {error}")
