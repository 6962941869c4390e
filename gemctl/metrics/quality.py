"""Model quality: normalized entropy (NE) and exact ROC AUC, in float64.

NE (He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook", 2014) is the
average log loss divided by the entropy of the background rate p = mean label:

    NE = -(1/N) sum_i [y_i log q_i + (1 - y_i) log(1 - q_i)]
         / -(p log p + (1 - p) log(1 - p))

with optional sample weights, as torchrec.metrics.ne computes it. NE < 1 means the model beats
predicting the background rate; lower is better.
AUC is the Mann-Whitney statistic with tied scores counted as one half (average ranks), exact
rather than binned.
"""

from __future__ import annotations

import math

import torch

_EPS = 1e-12


def _prep(preds, labels, weights):
    # dtype=float64 in as_tensor: Python floats must not pass through float32 on the way.
    preds = torch.as_tensor(preds, dtype=torch.float64).detach().flatten().cpu()
    labels = torch.as_tensor(labels, dtype=torch.float64).detach().flatten().cpu()
    if weights is None:
        weights = torch.ones_like(labels)
    else:
        weights = torch.as_tensor(weights, dtype=torch.float64).detach().flatten().cpu()
    if not (preds.shape == labels.shape == weights.shape):
        raise ValueError("preds, labels and weights must have the same number of elements")
    return preds, labels, weights


def normalized_entropy(preds, labels, weights=None) -> float:
    """NE of probabilities ``preds`` against 0/1 ``labels``; NaN when the labels are all one class."""
    q, y, w = _prep(preds, labels, weights)
    q = q.clamp(_EPS, 1 - _EPS)
    wsum = w.sum()
    ce = -(w * (y * torch.log(q) + (1 - y) * torch.log1p(-q))).sum() / wsum
    p = float((w * y).sum() / wsum)
    if p <= 0.0 or p >= 1.0:
        return float("nan")
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return float(ce) / base


def log_loss(preds, labels, weights=None) -> float:
    q, y, w = _prep(preds, labels, weights)
    q = q.clamp(_EPS, 1 - _EPS)
    return float(-(w * (y * torch.log(q) + (1 - y) * torch.log1p(-q))).sum() / w.sum())


def auc(preds, labels, weights=None) -> float:
    """Exact (weighted) ROC AUC with ties counted as 1/2; NaN when a class is absent."""
    s, y, w = _prep(preds, labels, weights)
    pos_w = w * y
    neg_w = w * (1 - y)
    total_pos, total_neg = float(pos_w.sum()), float(neg_w.sum())
    if total_pos <= 0 or total_neg <= 0:
        return float("nan")
    # Group equal scores: each positive beats the negatives strictly below it and ties half of
    # the negatives at its own score.
    uniq, inverse = torch.unique(s, sorted=True, return_inverse=True)
    pos_g = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, pos_w)
    neg_g = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, neg_w)
    neg_below = torch.cumsum(neg_g, 0) - neg_g
    wins = (pos_g * (neg_below + 0.5 * neg_g)).sum()
    return float(wins) / (total_pos * total_neg)
