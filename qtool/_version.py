"""The package version: its one source (pyproject.toml reads it too)."""

__version__ = "0.1.0"
