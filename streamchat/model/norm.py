"""RMSNorm as transformers computes it, the one normalisation every architecture here uses.

In float32, then back to the input's dtype before the weight multiplies
(transformers' order). A decode step's few float32 rows on CPU go to the C
kernel in one call (`cpu.rms_norm`); everything else runs in torch. Knows
nothing about layers or models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamchat.kernels import cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, small: bool = False) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; `small`: the C kernel may take a decode step's rows."""
    if small and x.dim() == 2 and x.shape[0] <= cpu.SKINNY_MAX_ROWS:
        out = cpu.rms_norm(x, weight, eps)
        if out is not None:
            return out
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)
