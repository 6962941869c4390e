"""Precision recipes: per-layer rules mapping module paths to compute formats, and the MX
(microscaling) numerics behind the ``mxfp8`` format."""

from gemctl.precision.mx import dequantize_mx, mx_qdq, quantize_mx
from gemctl.precision.mx_linear import MXRecipe, mx_linear
from gemctl.precision.rules import apply_precision, resolve_formats

__all__ = ["apply_precision", "resolve_formats", "quantize_mx", "dequantize_mx", "mx_qdq", "mx_linear", "MXRecipe"]
