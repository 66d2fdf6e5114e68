"""Helpers shared by the test suites: random packs, an independent loop-based pooling, error
metrics and the L0/L1 parametrisation."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List

import pytest
import torch

RATIOS = (1, 2, 3, 4, 8, 16, 128, 256)
COFFS = (1, 2)
HEAD_DIMS = (1, 64, 65, 128, 512)
PACK_KINDS = ("one", "ragged", "empty", "short", "padding")

# bf16 keeps 8 significant bits: one rounding of an fp32 value is within 2**-8 relative, and an
# fp32 path may land one bf16 step away from a correctly rounded fp64 value.
BF16_STEP = 2.0**-7


def pack_layout(kind: str, ratio: int):
    """(segment lengths, tokens after cu_seqlens[-1], padding rows) of a pack kind. Sizes are odd
    and scale with the ratio so every kind has a handful of rows at any ratio."""
    r = ratio
    return {
        "one": ([3 * r + r // 2 + 1], 0, 0),                 # one segment with a tail
        "ragged": ([2 * r + 1, 2 * r - 1, 3 * r], 0, 0),     # tails of different lengths
        "empty": ([0, r + 2, 0, 2 * r], 0, 0),               # empty segments, also the first
        "short": ([max(r - 1, 1), 2 * r + 1, max(r // 2, 1)], 0, 0),  # shorter than ratio
        "padding": ([r + 1, 2 * r], 5, 3),                   # spare tokens and static capacity
    }[kind]


@dataclass
class Pack:
    ratio: int
    coff: int
    head_dim: int
    lengths: List[int]
    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_comp: torch.Tensor
    grad_out: torch.Tensor
    total_comp: int
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def inputs(self):
        return self.kv, self.score, self.ape, self.cu_seqlens, self.cu_seqlens_comp

    @property
    def used_rows(self) -> int:
        return int(self.cu_seqlens_comp[-1])

    def to(self, device) -> "Pack":
        moved = {k: getattr(self, k).to(device) for k in
                 ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "grad_out")}
        return Pack(self.ratio, self.coff, self.head_dim, self.lengths, total_comp=self.total_comp, **moved)


def offsets(lengths, ratio):
    cu = [0]
    comp = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        comp.append(comp[-1] + n // ratio)
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(comp, dtype=torch.int32)


def make_pack(lengths, ratio: int, coff: int, head_dim: int, extra_tokens: int = 0, extra_rows: int = 0,
              seed: int = 0, device="cpu", score_scale: float = 2.0) -> Pack:
    """Fresh random inputs (never zeros) for a pack of segments of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    cu, comp = offsets(lengths, ratio)
    num_tokens = int(cu[-1]) + extra_tokens
    cols = coff * head_dim
    total_comp = int(comp[-1]) + extra_rows

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    pack = Pack(
        ratio, coff, head_dim, list(lengths),
        kv=randn(num_tokens, cols).bfloat16(),
        score=randn(num_tokens, cols, scale=score_scale).bfloat16(),
        ape=randn(ratio, cols, scale=0.5),
        cu_seqlens=cu, cu_seqlens_comp=comp,
        grad_out=randn(total_comp, head_dim).bfloat16(),
        total_comp=total_comp,
    )
    return pack if str(device) == "cpu" else pack.to(device)


def make_kind(kind: str, ratio: int, coff: int, head_dim: int, seed: int = 0, device="cpu") -> Pack:
    lengths, extra_tokens, extra_rows = pack_layout(kind, ratio)
    return make_pack(lengths, ratio, coff, head_dim, extra_tokens, extra_rows, seed=seed, device=device)


# -- an independent pooling, written from the SPEC text with plain loops ---------------------------

def window_positions(first_token: int, is_first_block: bool, ratio: int, coff: int, head_dim: int, j: int):
    """[(token, column, ape_row)] of output column j, or None for an invalid position."""
    positions = []
    if coff == 2:
        for k in range(ratio):
            positions.append(None if is_first_block else (first_token - ratio + k, j, k))
        for k in range(ratio):
            positions.append((first_token + k, head_dim + j, k))
    else:
        for k in range(ratio):
            positions.append((first_token + k, j, k))
    return positions


def loop_pooling(pack: Pack):
    """float64 forward and backward by plain Python loops over rows, columns and positions.
    Returns out, grad_kv, grad_score, grad_ape (nested lists) and the set of consumed slots."""
    r, coff, d = pack.ratio, pack.coff, pack.head_dim
    kv, score, ape = pack.kv.float().tolist(), pack.score.float().tolist(), pack.ape.tolist()
    g_out = pack.grad_out.float().tolist()
    cu, comp = pack.cu_seqlens.tolist(), pack.cu_seqlens_comp.tolist()
    num_tokens = len(kv)
    out = [[0.0] * d for _ in range(pack.total_comp)]
    grad_kv = [[0.0] * (coff * d) for _ in range(num_tokens)]
    grad_score = [[0.0] * (coff * d) for _ in range(num_tokens)]
    grad_ape = [[0.0] * (coff * d) for _ in range(r)]
    consumed = set()

    rows = []  # (row, first token, first block?, receives gradient?)
    for s in range(len(cu) - 1):
        for b in range((cu[s + 1] - cu[s]) // r):
            rows.append((comp[s] + b, cu[s] + b * r, b == 0, True))
    for row in range(comp[-1], pack.total_comp):
        rows.append((row, 0, True, False))

    for row, first, is_first, grads in rows:
        for j in range(d):
            pos = window_positions(first, is_first, r, coff, d, j)
            s_vals = [-math.inf if p is None else score[p[0]][p[1]] + ape[p[2]][p[1]] for p in pos]
            x_vals = [0.0 if p is None else kv[p[0]][p[1]] for p in pos]
            m = max(s_vals)
            e = [math.exp(v - m) for v in s_vals]
            den = sum(e)
            p_vals = [v / den for v in e]
            out[row][j] = sum(x * p for x, p in zip(x_vals, p_vals))
            if not grads:
                continue
            g = g_out[row][j]
            total = sum(g * x * p for x, p in zip(x_vals, p_vals))
            for p_pos, x, p in zip(pos, x_vals, p_vals):
                if p_pos is None:
                    continue
                tok, col, arow = p_pos
                assert (tok, col) not in consumed, f"slot {(tok, col)} consumed twice"
                consumed.add((tok, col))
                gs = p * g * x - p * total
                grad_kv[tok][col] = g * p
                grad_score[tok][col] = gs
                grad_ape[arow][col] += gs
    as64 = lambda v: torch.tensor(v, dtype=torch.float64).reshape(len(v), -1)  # noqa: E731
    return as64(out), as64(grad_kv), as64(grad_score), as64(grad_ape), consumed


def consumed_mask(pack: Pack, consumed) -> torch.Tensor:
    mask = torch.zeros(pack.kv.shape, dtype=torch.bool)
    for tok, col in consumed:
        mask[tok, col] = True
    return mask


# -- metrics ----------------------------------------------------------------------------------------

def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return float((actual.double() - expected.double()).abs().max())


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor, name: str, atol: float = 1e-5) -> None:
    """Within one bf16 step of an fp64 value (plus a small absolute slack for cancellation)."""
    diff = (actual.double().cpu() - expected.double().cpu()).abs()
    bound = BF16_STEP * expected.double().cpu().abs() + atol
    bad = diff > bound
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements beyond one bf16 step, worst "
                           f"{float((diff - bound).max()):.3g} over the bound")


def assert_positive_zero(t: torch.Tensor, mask: torch.Tensor, name: str) -> None:
    """Elements under ``mask`` are exactly +0.0."""
    sel = t[mask.to(t.device)]
    assert bool((sel == 0).all()) and not bool(torch.signbit(sel.float()).any()), \
        f"{name}: never-consumed slots are not all +0.0"


# -- parametrisation ------------------------------------------------------------------------------

def leveled(cases, smoke) -> list:
    """pytest params of ``cases``, marked L0 when ``smoke(case)`` is true, else L1."""
    params = []
    for case in cases:
        case = case if isinstance(case, tuple) else (case,)
        mark = pytest.mark.L0 if smoke(*case) else pytest.mark.L1
        params.append(pytest.param(*case, marks=mark, id="-".join(map(str, case))))
    return params


def sentinel_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer of t's shape filled with a recognisable value, to prove it stays untouched."""
    return torch.full_like(t, -7)
