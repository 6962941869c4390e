"""gemctl: a training launcher for GEM-like hybrid sparse/dense recommendation models."""

__version__ = "0.1.0"
