"""Pack builders shared by the GPU tests and the benchmark: offsets from segment lengths."""
from __future__ import annotations

from typing import List, Sequence

import torch


def offsets(lengths: Sequence[int], ratio: int, device="cuda"):
    """``cu_seqlens``, ``cu_seqlens_comp`` (int32) for segments of the given lengths."""
    cu = [0]
    comp = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        comp.append(comp[-1] + n // ratio)
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)
    return as_i32(cu), as_i32(comp)


def edge_lengths(ratio: int) -> List[int]:
    """Ragged pack with tails, an empty segment and segments shorter than ratio."""
    return [3 * ratio + 1, 0, max(ratio - 1, 0), 5 * ratio, 1, 2 * ratio + ratio // 2 + 1, ratio]


def random_inputs(n_tok: int, ratio: int, coff: int, head_dim: int, device="cuda", generator=None):
    """Fresh random kv, score (bf16) and ape (fp32); never zeros."""
    cols = coff * head_dim
    kv = torch.randn(n_tok, cols, device=device, generator=generator).to(torch.bfloat16)
    score = (2 * torch.randn(n_tok, cols, device=device, generator=generator)).to(torch.bfloat16)
    ape = 0.5 * torch.randn(ratio, cols, device=device, generator=generator)
    return kv, score, ape
