"""The interface every data source implements, and the factory that picks one from the config."""

from __future__ import annotations

from typing import Iterator, Protocol

from gemctl.data.batch import FeatureSpec, JaggedBatch


class Source(Protocol):
    spec: FeatureSpec

    def train_batches(self, start_step: int = 0) -> Iterator[JaggedBatch]:
        """Endless training batches of ``data.batch_size`` (epochs follow one another).

        Deterministic for a seed: batch ``k`` is the same whether the iterator started at 0 or
        at ``start_step=k``.
        """

    def eval_batches(self) -> Iterator[JaggedBatch]:
        """The whole held-out split once, in batches of ``data.eval_batch_size``."""

    def baselines(self) -> dict[str, dict[str, float]]:
        """Reference predictors on the held-out split: {name: {"ne": .., "auc": ..}} (ctr task)."""


SOURCES = ("synthetic", "movielens100k", "parquet")


def build_source(data_cfg, shuffle_cfg=None, world_size: int = 1, rank: int = 0) -> Source:
    """The configured source, dealing each step's samples to ``rank`` of ``world_size``
    (in order, or by Base Batch Shuffling: gemctl.data.shuffle)."""
    from gemctl.data.shuffle import build_dealer

    dealer = build_dealer(shuffle_cfg, data_cfg.batch_size, world_size, rank)
    if data_cfg.source == "synthetic":
        from gemctl.data.synthetic import SyntheticSource

        return SyntheticSource(data_cfg, dealer)
    if data_cfg.source == "movielens100k":
        from gemctl.data.movielens import MovieLensSource

        return MovieLensSource(data_cfg, dealer=dealer)
    if data_cfg.source == "parquet":
        from gemctl.data.parquet import ParquetSource

        return ParquetSource(data_cfg, dealer=dealer)
    from gemctl.errors import ConfigError

    raise ConfigError("data.source", f"'{data_cfg.source}' is not a source; allowed: {', '.join(SOURCES)}")
