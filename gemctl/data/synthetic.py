"""GEM-like synthetic traffic with a learnable signal.

Each sample is a user with a jagged history (item id + action id per event), non-sequence sparse
features (user id, the candidate ad, a multi-hot bag of context ids), dense features, and two
labels (ctr, cvr) drawn from a fixed random *teacher* model, so a model can learn something real
and NE/AUC mean something.

- History lengths: L = round(exp(N(0, 1) * sigma + ln(max_len / 4))) clamped to [1, max_len], the
  length law of BENCHMARKS.md (fill ~0.32 of max_len at sigma 0.8), plus a fraction of empty
  histories (users with no recorded events).
- Ids: Zipf(alpha) popularity through a fixed random permutation of the id space (popular ids are
  scattered over the table, as hashed ids are).
- Teacher: logit = logit(base_ctr) + teacher_scale * (ad bias + user bias + dense . w
  + <action-weighted mean of history item vectors, ad vector> + context weights), each term of
  unit-ish scale; cvr = ctr * Bernoulli(sigmoid(a second such logit)).

Batch k of the training stream is generated from its own seeded generator, so it is the same
batch whatever the order, worker or restart that produces it.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from gemctl.data.batch import FeatureSpec, JaggedBatch, concat_batches, offsets_from_lengths
from gemctl.data.shuffle import Dealer

_TRAIN, _EVAL, _TEACHER, _TRAIN_SUB = 0, 1, 2, 3
_TEACHER_DIM = 8


def _mix(*parts: int) -> int:
    """A stable 63-bit seed from integers (splitmix64 steps)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1


class _Zipf:
    """Zipf(alpha) ids over [0, n) by inverse CDF, scattered by a fixed permutation."""

    def __init__(self, n: int, alpha: float, gen: torch.Generator):
        ranks = torch.arange(1, n + 1, dtype=torch.float64)
        cdf = torch.cumsum(ranks.pow(-alpha), 0)
        self.cdf = cdf / cdf[-1]
        self.perm = torch.randperm(n, generator=gen)
        self.n = n

    def sample(self, count: int, gen: torch.Generator) -> torch.Tensor:
        u = torch.rand(count, generator=gen, dtype=torch.float64)
        rank = torch.searchsorted(self.cdf, u).clamp_(max=self.n - 1)
        return self.perm[rank]


class SyntheticSource:
    def __init__(self, data_cfg, dealer: Dealer | None = None):
        self.cfg = data_cfg
        self.dealer = dealer or Dealer()
        # The stream is cut into units: whole local batches without BBS (so one rank's batch k is
        # unit k, as before), sub-batches with it.
        self.unit_size = data_cfg.batch_size // self.dealer.units_per_rank
        self._unit_tag = _TRAIN if self.dealer.kind == "none" else _TRAIN_SUB
        s = data_cfg.synthetic
        self.s = s
        self.spec = FeatureSpec(
            seq_features={"item_id": s.num_items, "action": s.num_actions},
            sparse_features={
                "user_id": s.num_users,
                "ad_id": s.num_ads,
                "context": s.num_contexts,
            },
            num_dense=16,
            tasks=("ctr", "cvr"),
            max_seq_len=data_cfg.max_len,
        )
        g = torch.Generator().manual_seed(_mix(data_cfg.seed, _TEACHER))
        self.items = _Zipf(s.num_items, s.zipf_alpha, g)
        self.users = _Zipf(s.num_users, s.zipf_alpha, g)
        self.ads = _Zipf(s.num_ads, s.zipf_alpha, g)
        k = _TEACHER_DIM
        # Teacher parameters: fixed for a seed, never seen by the model.
        self.t_item = torch.randn(s.num_items, k, generator=g)
        self.t_ad = torch.randn(s.num_ads, k, generator=g)
        self.t_ad_bias = torch.randn(s.num_ads, generator=g)
        self.t_user_bias = torch.randn(s.num_users, generator=g)
        self.t_action = torch.rand(s.num_actions, generator=g) * 2 - 0.5
        self.t_context = torch.randn(s.num_contexts, generator=g) * 0.5
        self.t_dense = torch.randn(self.spec.num_dense, 2, generator=g)
        self.t_cvr_ad = torch.randn(s.num_ads, generator=g)
        self.base_logit = math.log(s.base_ctr / (1 - s.base_ctr))
        self.num_eval = s.eval_samples

    # ------------------------------------------------------------------------------------------
    def _lengths(self, n: int, gen: torch.Generator) -> torch.Tensor:
        max_len = self.cfg.max_len
        z = torch.randn(n, generator=gen, dtype=torch.float64)
        lengths = torch.exp(z * self.s.length_sigma + math.log(max_len / 4)).round()
        lengths = lengths.clamp_(1, max_len).to(torch.int64)
        empty = torch.rand(n, generator=gen) < self.s.zero_length_fraction
        return lengths.masked_fill_(empty, 0)

    def _generate(self, n: int, seed: int, first_sample_id: int) -> JaggedBatch:
        s = self.s
        gen = torch.Generator().manual_seed(seed)
        lengths = self._lengths(n, gen)
        offsets = offsets_from_lengths(lengths)
        total = int(offsets[-1])
        item = self.items.sample(total, gen)
        action = torch.randint(0, s.num_actions, (total,), generator=gen)
        user = self.users.sample(n, gen)
        ad = self.ads.sample(n, gen)
        hot = s.context_hotness
        context = torch.randint(0, s.num_contexts, (n * hot,), generator=gen)
        dense = torch.randn(n, self.spec.num_dense, generator=gen)

        # Teacher: history affinity = <action-weighted mean of item vectors, ad vector>.
        seg = torch.repeat_interleave(torch.arange(n), lengths)
        weighted = self.t_item[item] * self.t_action[action, None]
        hist = torch.zeros(n, _TEACHER_DIM).index_add_(0, seg, weighted)
        hist = hist / lengths.clamp(min=1).sqrt()[:, None]
        affinity = (hist * self.t_ad[ad]).sum(1) / math.sqrt(_TEACHER_DIM)
        ctx = self.t_context[context].view(n, hot).sum(1) / math.sqrt(hot)
        dense_terms = dense @ self.t_dense / math.sqrt(self.spec.num_dense)
        signal = (
            0.6 * self.t_ad_bias[ad]
            + 0.6 * self.t_user_bias[user]
            + dense_terms[:, 0]
            + affinity
            + ctx
        )
        ctr_logit = self.base_logit + s.teacher_scale * signal / math.sqrt(2.0)
        cvr_logit = -0.5 + s.teacher_scale * (self.t_cvr_ad[ad] + dense_terms[:, 1]) / math.sqrt(2.0)
        ctr_prob = torch.sigmoid(ctr_logit)
        ctr = torch.bernoulli(ctr_prob, generator=gen)
        cvr = ctr * torch.bernoulli(torch.sigmoid(cvr_logit), generator=gen)

        ones = torch.arange(n + 1, dtype=torch.int64)
        return JaggedBatch(
            seq_ids={"item_id": item, "action": action},
            seq_offsets=offsets,
            seq_offsets_cpu=offsets,
            max_seq_len=int(lengths.max()) if n else 0,
            sparse_ids={"user_id": user, "ad_id": ad, "context": context},
            sparse_offsets={"user_id": ones, "ad_id": ones, "context": ones * hot},
            dense=dense,
            labels=torch.stack([ctr, cvr], 1).to(torch.float32),
            sample_ids=torch.arange(first_sample_id, first_sample_id + n, dtype=torch.int64),
            extras={"teacher_ctr": ctr_prob},
        )

    # ------------------------------------------------------------------------------------------
    def _unit_seed(self, unit: int) -> int:
        return _mix(self.cfg.seed, self._unit_tag, unit)

    def unit_lengths(self, unit: int) -> torch.Tensor:
        """History lengths of a unit without generating it (the same draws _generate makes first)."""
        return self._lengths(self.unit_size, torch.Generator().manual_seed(self._unit_seed(unit)))

    def train_batch(self, step: int) -> JaggedBatch:
        """This rank's training batch of ``step`` (random access: any worker can make any batch)."""
        d = self.dealer
        first = step * d.units_per_step
        lengths = [self.unit_lengths(first + i) for i in range(d.units_per_step)] if d.kind == "bbs" else None
        units = [first + i for i in d.my_units(lengths)]
        return concat_batches(
            [self._generate(self.unit_size, self._unit_seed(u), u * self.unit_size) for u in units]
        )

    def train_batches(self, start_step: int = 0) -> Iterator[JaggedBatch]:
        step = start_step
        while True:
            yield self.train_batch(step)
            step += 1

    def eval_batches(self) -> Iterator[JaggedBatch]:
        b = self.cfg.eval_batch_size
        for i, start in enumerate(range(0, self.num_eval, b)):
            n = min(b, self.num_eval - start)
            # Eval sample ids are negative so they never collide with training ids.
            batch = self._generate(n, _mix(self.cfg.seed, _EVAL, i), 0)
            batch.sample_ids = -1 - torch.arange(start, start + n, dtype=torch.int64)
            yield batch

    def baselines(self) -> dict[str, dict[str, float]]:
        """The teacher itself (the best achievable NE/AUC) and the background rate."""
        from gemctl.metrics.quality import auc, normalized_entropy

        probs, labels = [], []
        for i, start in enumerate(range(0, self.num_eval, self.cfg.eval_batch_size)):
            n = min(self.cfg.eval_batch_size, self.num_eval - start)
            batch = self._generate(n, _mix(self.cfg.seed, _EVAL, i), 0)
            probs.append(batch.extras["teacher_ctr"])
            labels.append(batch.labels[:, 0])
        q, y = torch.cat(probs), torch.cat(labels)
        return {"teacher": {"ne": normalized_entropy(q, y), "auc": auc(q, y)}}
