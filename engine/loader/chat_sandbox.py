"""The jinja2 sandbox chat templates render in, with limits on time and size.

A chat template comes from a model directory, i.e. from whoever published the model.
jinja2's ImmutableSandboxedEnvironment already refuses Python internals
(`''.__class__`, `cycler.__init__.__globals__`: SecurityError), has no loader (so
`{% include %}` / `{% import %}` cannot read files) and caps `range()` at 100,000
items. It does not bound work or memory: nested loops run for hours, and
`'x' * 10**10`, `' '|center(10**10)` or `'%999999999d' % 1` build gigabytes. Here:

- every value an operation (`*`, `%`, `**`, a filter, a method call) could build is
  estimated before it runs, from the sizes of its operands (the product of the two
  largest), and refused above `MAX_VALUE_CHARS`; format widths of 7+ digits too;
- the rendered text is refused past `MAX_OUTPUT_CHARS`;
- a render that runs past `MAX_RENDER_SECONDS` is stopped (`render_deadline.py`: a
  watchdog thread raises in the render's thread; no trace hook slows every render).

Each limit is far above what a real chat template needs (a 1M-token prompt is ~4M
characters; rendering one takes milliseconds). A refused render raises
`ChatTemplateLimit` (a jinja2 SecurityError), which makes that row an error row.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.engine.loader.render_deadline import deadline

MAX_VALUE_CHARS = 64 << 20
MAX_OUTPUT_CHARS = 64 << 20
MAX_RENDER_SECONDS = 5.0
MAX_POWER_BITS = 4096
# A width or precision in a format string (`%999999999d`, `{:>999999999}`).
_HUGE_WIDTH = re.compile(r"\d{7,}")


class ChatTemplateLimit(jinja2.exceptions.SecurityError):
    """A chat template tried to use more time or memory than any real one needs."""


def _size(value: Any) -> int:
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return abs(value)
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return len(value)
    return 1


def check_sizes(what: str, values: list[Any], *, format_string: Any = None) -> None:
    """Refuse an operation whose result could exceed MAX_VALUE_CHARS.

    Args:
        what: the operation, for the message (e.g. "filter 'center'").
        values: its operands and arguments.
        format_string: the format string when the operation formats one (`%`,
            `format`), whose widths are checked too.
    """
    sizes = sorted((_size(v) for v in values), reverse=True) + [0, 0]
    # A count alone (`center(n)`) or a size times a count (`'x' * n`, `replace`).
    estimate = max(sizes[0], sizes[0] * sizes[1])
    if estimate > MAX_VALUE_CHARS:
        raise ChatTemplateLimit(
            f"chat template: {what} could build a value of about {estimate:,} characters "
            f"(limit {MAX_VALUE_CHARS:,})"
        )
    if isinstance(format_string, str) and _HUGE_WIDTH.search(format_string):
        raise ChatTemplateLimit(f"chat template: {what} uses a format width over 6 digits")


def _power_bits(base: Any, exponent: Any) -> int:
    """About how many bits `base ** exponent` has (0 unless both are positive powers)."""
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0:
        return 0
    return exponent * max(abs(base), 2).bit_length()


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment plus size checks on operators, calls and filters."""

    intercepted_binops = frozenset({"*", "%", "**"})

    def call_binop(self, context: Any, operator_name: str, left: Any, right: Any) -> Any:
        if operator_name != "**":
            fmt = left if operator_name == "%" else None
            check_sizes(f"operator {operator_name!r}", [left, right], format_string=fmt)
        elif _power_bits(left, right) > MAX_POWER_BITS:
            raise ChatTemplateLimit("chat template: a power too large to compute")
        return super().call_binop(context, operator_name, left, right)

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(__obj, "__name__", type(__obj).__name__)
        # The sandbox hands out str.format wrapped; the string is the wrapped method's.
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        fmt = owner if name in ("format", "format_map") else None
        check_sizes(f"call {name!r}", [owner, *args, *kwargs.values()], format_string=fmt)
        return super().call(__context, __obj, *args, **kwargs)


def _guarded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marker
    def guarded(*args: Any, **kwargs: Any) -> Any:
        plain = [a for a in args if not isinstance(a, (jinja2.Environment, jinja2.runtime.Context))]
        fmt = plain[0] if name == "format" and plain else None
        check_sizes(f"filter {name!r}", [*plain, *kwargs.values()], format_string=fmt)
        return func(*args, **kwargs)

    return guarded


def make_environment(**options: Any) -> LimitedSandbox:
    """A LimitedSandbox whose every filter checks its operands first.

    Args:
        **options: jinja2 Environment options (trim_blocks, extensions...).
    """
    env = LimitedSandbox(**options)
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    return env


def add_filter(env: jinja2.Environment, name: str, func: Callable[..., Any]) -> None:
    """Registers a filter with the same size checks as the built-in ones."""
    env.filters[name] = _guarded_filter(name, func)


def render_limited(template: jinja2.Template, variables: Mapping[str, Any]) -> str:
    """Render with the output and time limits.

    Args:
        template: compiled by an environment from `make_environment`.
        variables: the template's variables.

    Returns:
        The rendered text; raises ChatTemplateLimit past a limit.
    """
    with deadline(MAX_RENDER_SECONDS, RenderTookTooLong):
        pieces: list[str] = []
        length = 0
        for piece in template.generate(**variables):
            length += len(piece)
            if length > MAX_OUTPUT_CHARS:
                raise ChatTemplateLimit(
                    f"chat template: output longer than {MAX_OUTPUT_CHARS:,} characters"
                )
            pieces.append(piece)
        return "".join(pieces)


class RenderTookTooLong(ChatTemplateLimit):
    """A render stopped at MAX_RENDER_SECONDS (raised in the render's thread by
    `render_deadline.py`, which builds it without arguments)."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message or f"chat template: rendering took over {MAX_RENDER_SECONDS:g} s (stopped)"
        )
