"""Click options derived from the job definition (`pipelines/options.py`).

`job_options(surface)` turns each option of a surface into a click option: its flag
(`--max-tokens`, or the definition's own, e.g. `--raw/--chat`), type and bounds
(`click.IntRange`, `click.Choice`), default, help, `multiple=True` for a repeatable
option and KEY=VALUE pairs for a mapping. A command then hands `given_options(ctx)` -
only what the user set - to `run_job`, the flow or `generate`, where every default
comes from the same definition.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import click
from click.core import ParameterSource

from tokenmill.pipelines.option_types import BOOL, CLI, FLOAT, INT, Option
from tokenmill.pipelines.options import options_for


def parse_key_values(pairs: Iterable[str], *, flag: str) -> dict[str, Any]:
    """`KEY=VALUE` pairs as a dict; JSON values (true, 3, {...}) are decoded.

    Raises:
        ValueError: a pair without "=" (the message does not repeat it: it may be a secret).
    """
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} must be KEY=VALUE (got one without '=')")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def job_options(
    surface: str,
    *,
    only: str | None = None,
    skip_sections: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
) -> Callable[[click.Command], click.Command]:
    """Decorator: a click option for every job option of `surface`.

    Args:
        surface: CLI (`tokenmill run`) or FLOW (`tokenmill flow run`, `serve`).
        only: keep only the options that are also on this surface.
        skip_sections: leave out the options of these sections.
        defaults: this command's own defaults for some options (shown in --help; the
            command passes them on itself).
    """
    chosen = [
        option
        for option in options_for(surface)
        if (only is None or only in option.surfaces) and option.section not in set(skip_sections)
    ]
    defaults = defaults or {}

    def decorate(command: Callable) -> Callable:
        # click applies decorators bottom-up: add them in reverse to keep the table's order.
        for option in reversed(chosen):
            command = _click_option(option, defaults.get(option.name, option.default))(command)
        return command

    return decorate


def given_options(ctx: click.Context, surface: str = CLI) -> dict[str, Any]:
    """The job options of `surface` the user set (flag or environment variable); the
    rest take the definition's defaults where they are used."""
    names = {option.name for option in options_for(surface)}
    return {
        name: value
        for name, value in ctx.params.items()
        if name in names and ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    }


def _click_option(option: Option, default: Any) -> Callable:
    flag = option.flag or "--" + option.name.replace("_", "-")
    repeatable = option.repeatable or option.type.mapping
    kwargs: dict[str, Any] = {
        "help": option.help + (" Repeatable." if repeatable else ""),
        "default": default,
        "show_default": default is not None and default != (),
        "envvar": option.envvar,
        "metavar": option.metavar,
    }
    if option.type is BOOL:
        if "/" not in flag:
            flag = f"{flag}/--no-{flag[2:]}"
        kwargs.pop("metavar")
    elif option.type.mapping:
        metavar = option.metavar or option.type.metavar
        kwargs.update(multiple=True, metavar=metavar, callback=key_values_callback(flag))
        kwargs["default"] = None
    else:
        kwargs["type"] = _click_type(option)
        kwargs["multiple"] = option.repeatable
    return click.option(flag, option.name, **kwargs)


def _click_type(option: Option) -> Any:
    if option.type in (INT, FLOAT) and (option.ge, option.gt, option.le) != (None, None, None):
        range_type = click.IntRange if option.type is INT else click.FloatRange
        low = option.ge if option.ge is not None else option.gt
        return range_type(min=low, max=option.le, min_open=option.gt is not None)
    if option.type in (INT, FLOAT):
        return int if option.type is INT else float
    if option.type.choices:
        return click.Choice(list(option.type.choices))
    return _ParsedType(option)


class _ParsedType(click.ParamType):
    """A value the definition's type parses from text (e.g. text, a future JSON type)."""

    def __init__(self, option: Option) -> None:
        self.option = option
        self.name = option.type.metavar.lower()

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.option.type.parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def key_values_callback(flag: str) -> Callable:
    """A click callback turning a repeated `flag KEY=VALUE` into a dict (None if not given)."""

    def parse(ctx: click.Context, param: click.Parameter, pairs: tuple[str, ...]) -> Any:
        try:
            return parse_key_values(pairs, flag=flag) or None
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None

    return parse
