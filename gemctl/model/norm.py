"""RMSNorm that runs in the activation's dtype.

Under bf16 autocast the input arrives in bf16 while the weight stays fp32; torch's rms_norm then
skips its fused kernel ("Mismatch dtype between input and weight", seen on H200 with torch 2.11).
Casting the weight to the input dtype keeps the fused path; the reduction is still accumulated in
fp32 inside the kernel.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    def forward(self, x):
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
