"""GEM-like model: torchrec tables, sequence tower, non-sequence tower, interaction, task heads."""

from gemctl.model.gem import GemModel, build_model

__all__ = ["GemModel", "build_model"]
