"""`tokenmill models`: list, inspect and convert model files."""

from __future__ import annotations

import click


@click.group("models")
def models() -> None:
    """List, inspect and convert models."""
