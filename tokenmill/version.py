"""The package version: a module of its own, so any layer can name it without importing
the public API."""

__version__ = "0.1.0"
