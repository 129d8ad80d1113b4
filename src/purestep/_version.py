"""The package version (a base module: anything may import it)."""

__version__ = "0.1.0"
