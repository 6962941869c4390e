"""Precision recipes: per-layer rules mapping module paths to compute formats."""

from gemctl.precision.rules import apply_precision, resolve_formats

__all__ = ["apply_precision", "resolve_formats"]
