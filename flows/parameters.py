"""The flow's parameters: derived from the job definition, turned into a `JobSpec`.

`job_parameters` gives the flow function one keyword parameter per FLOW option of
`pipelines/options.py`, typed with the option's bounds (`Annotated[int, Field(ge=1)]`,
`Literal[...]` for choices) and documented with its help text: Prefect builds the
flow's parameter schema from that signature and docstring, so UI forms,
`prefect deployment run -p max_tokens=64` and Python calls are validated before a run
starts. Parameters stay flat: one per option.

A flow run's parameters are stored by the Prefect server and shown in its UI, in
plain text. So `storage_options` given as a parameter must not hold credentials:
they come from the environment the tasks run in (AWS_ACCESS_KEY_ID, workload
identity, ...) or from a Prefect `Secret` block named by `storage_secret`, whose
value is loaded at run time and never stored with the run.
"""

# No `from __future__ import annotations`: the annotations built here are objects that
# Prefect and pydantic read at run time.
import inspect
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import Field

from tokenmill.pipelines.option_types import FLOW, Option
from tokenmill.pipelines.options import options_for, takes_options
from tokenmill.pipelines.spec import JobSpec

# The docstring line a flow function leaves for its options' documentation.
OPTIONS_MARKER = "{job options}"


def job_parameters(function: Callable) -> Callable:
    """Decorator: the FLOW options of the job definition as the flow function's keyword
    parameters (it takes them as `**options`), typed and documented for Prefect.

    The function's docstring holds the line `{job options}` inside its Args section;
    it is replaced by one `name: help` line per option.
    """
    lines = [f"{option.name}: {option.help}" for option in options_for(FLOW)]
    doc = inspect.getdoc(function) or ""
    marker = next(line for line in doc.splitlines() if line.strip() == OPTIONS_MARKER)
    indent = marker[: len(marker) - len(marker.lstrip())]
    function.__doc__ = doc.replace(marker, "\n".join(indent + line for line in lines))
    return takes_options(FLOW, annotate=flow_annotation)(function)


def flow_annotation(option: Option) -> Any:
    """An option's type as Prefect's schema shows it: bounds as pydantic constraints,
    lists and mappings as JSON arrays and objects, None allowed where it means unset."""
    if option.type.mapping:
        return dict[str, Any] | None
    annotation = option.type.annotation
    bounds = {k: getattr(option, k) for k in ("ge", "gt", "le") if getattr(option, k) is not None}
    if bounds:
        annotation = Annotated[annotation, Field(**bounds)]
    if option.repeatable:
        return list[annotation] | None
    return annotation | None if option.accepts_none else annotation


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


def build_spec(input: str, output: str, *, scheduled: datetime, **params: Any) -> JobSpec:
    """A validated JobSpec from the flow's parameters.

    Args:
        input, output: as given to the flow; `{date}`/`{datetime}` are filled in.
        scheduled: the run's scheduled time, for the placeholders.
        **params: the flow's other parameters: every FLOW option. The storage options
            are checked for credentials; `storage_secret`, if given, is loaded and
            merged over them. Path options (the ledger dataset) get their placeholders
            filled in too.

    Returns:
        The JobSpec; raises ValueError for invalid or conflicting options.
    """
    secret_name = params.pop("storage_secret", None)
    check_storage_options(params.get("storage_options"))
    secret = load_storage_secret(secret_name) if secret_name else None
    params["storage_options"] = merge_storage_options(params.get("storage_options"), secret)
    for option in options_for(FLOW):
        if option.path == "always" and option.name in params:
            params[option.name] = expand_placeholders(params[option.name], scheduled)
    return JobSpec(
        expand_placeholders(input, scheduled), expand_placeholders(output, scheduled), **params
    )
