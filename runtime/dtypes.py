"""The accumulator dtype every attention path shares (kernels, flex blocks, the LSE merge, the
ring's and the dilated op's accumulators): fp64 for fp64 inputs, else fp32."""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
