"""Flow parameters -> `JobSpec`, keeping credentials out of the Prefect database.

A flow run's parameters are stored by the Prefect server and shown in its UI, in
plain text. So `storage_options` given as a parameter must not hold credentials:
they come from the environment the tasks run in (AWS_ACCESS_KEY_ID, workload
identity, ...) or from a Prefect `Secret` block named by `storage_secret`, whose
value is loaded at run time and never stored with the run.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.pipelines.pricing import Prices
from tokenmill.pipelines.spec import JobSpec

# Option names that carry credentials in fsspec backends (s3fs, gcsfs, adlfs, object_store).
_SECRET_WORDS = frozenset(
    {"key", "secret", "token", "password", "passwd", "credential", "credentials", "sas"}
)


def check_storage_options(options: Mapping[str, Any] | None, *, where: str = "") -> None:
    """Raise ValueError if a storage option looks like a credential.

    Args:
        options: the storage options given as a flow parameter (nested dicts included).
        where: the path of `options` inside the parameter, for the message.
    """
    for name, value in (options or {}).items():
        path = f"{where}.{name}" if where else str(name)
        words = set(re.split(r"[^a-z0-9]+", str(name).lower()))
        if words & _SECRET_WORDS:
            raise ValueError(
                f"storage_options[{path!r}] looks like a credential, and flow parameters are "
                "stored by the Prefect server in plain text. Put credentials in a Prefect "
                "Secret block and pass its name as storage_secret, or set them in the "
                "workers' environment (e.g. AWS_ACCESS_KEY_ID)."
            )
        if isinstance(value, Mapping):
            check_storage_options(value, where=path)


def load_storage_secret(name: str) -> dict[str, Any]:
    """The storage options held in the Prefect Secret block `name` (a JSON object)."""
    from prefect.blocks.system import Secret

    value = Secret.load(name).get()
    if not isinstance(value, Mapping):
        raise ValueError(
            f"Secret block {name!r} must hold a JSON object of storage options, "
            f"not a {type(value).__name__}"
        )
    return dict(value)


def merge_storage_options(
    options: Mapping[str, Any] | None, secret: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """Parameter options overlaid with the secret's (the secret wins on a clash)."""
    if not options and not secret:
        return None
    return {**(options or {}), **(secret or {})}


def expand_placeholders(uri: str | None, when: datetime) -> str | None:
    """`{date}` and `{datetime}` in a URI, filled from the run's scheduled time (UTC).

    A scheduled deployment runs the same parameters every day, and a job's output
    holds one job: `output="s3://b/answers/{date}"` gives each day's run its own,
    while a retry of the same flow run (same scheduled time) resumes into the same one.
    Only these two names are replaced, so other braces in a URI are left alone.
    """
    if uri is None:
        return None
    when = when.astimezone(timezone.utc)
    return uri.replace("{date}", when.strftime("%Y-%m-%d")).replace(
        "{datetime}", when.strftime("%Y%m%dT%H%M%SZ")
    )


def build_spec(
    *,
    sampling: Mapping[str, Any],
    prices: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None,
    storage_secret: str | None,
    **spec_fields: Any,
) -> JobSpec:
    """A validated JobSpec from the flow's flat parameters.

    Args:
        sampling: SamplingParams fields (max_tokens, temperature, ...).
        prices: Prices fields.
        storage_options: non-secret filesystem options (checked here).
        storage_secret: name of a Secret block with more storage options, or None.
        **spec_fields: every other JobSpec field, as named there.

    Returns:
        The JobSpec; raises ValueError for invalid or conflicting options.
    """
    check_storage_options(storage_options)
    secret = load_storage_secret(storage_secret) if storage_secret else None
    return JobSpec(
        sampling=SamplingParams(**sampling),
        prices=Prices(**prices),
        storage_options=merge_storage_options(storage_options, secret),
        **spec_fields,
    )
