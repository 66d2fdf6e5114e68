"""Reference implementations of the compressor pooling, in eager PyTorch (CPU or CUDA tensors).

Three modes, one window gather:

``"fp32"``      the fp32-intermediate reference and the CPU execution path of the API. Every
                reduction runs left to right over the window positions as separate elementwise
                ops, so the order is pinned; the fused kernels reproduce it bit for bit.
``"upstream"``  what Megatron-LM runs today: ``torch.softmax`` in fp32, weights rounded to
                bf16, a bf16 multiply and ``.sum`` over the window; backward by autograd.
``"fp64"``      the oracle: everything in float64 from the given inputs, ``torch.softmax``;
                returns float64. Differentiable, so ``torch.autograd.gradcheck`` can drive it
                with float64 inputs; its backward uses the analytic formulas in float64.

Window semantics (SPEC section 2): output row ``cu_seqlens_comp[s] + b`` pools block ``b`` of
segment ``s``. With ``coff == 2`` positions ``k < ratio`` read the previous block's tokens in
the first half of the columns (invalid for a segment's first block: score ``-inf``, kv 0, ape
not added), positions ``k >= ratio`` the block's own tokens in the second half. With
``coff == 1`` the window is the own block. Ape row = position within its block. Rows from
``cu_seqlens_comp[-1]`` up to ``total_comp`` are padding: segment 0's first block (tokens
``0..ratio-1``), whose incoming gradients are ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

MODES = ("fp32", "upstream", "fp64")


@dataclass
class Windows:
    """Gather indices of every output row's window (R rows, W = coff*ratio positions)."""

    token: torch.Tensor    # (R, W) int64: token read by position k of row r (0 where invalid)
    half: torch.Tensor     # (W,) int64: which coff-half of the columns position k reads
    ape_row: torch.Tensor  # (W,) int64: ape row of position k
    valid: torch.Tensor    # (R, W) bool: False for the previous block of a first block
    used_rows: int         # rows below this receive gradients (cu_seqlens_comp[-1])


def build_windows(cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, ratio: int, coff: int,
                  total_comp: int, device: torch.device) -> Windows:
    """Map every output row to its window. Offsets are read on the host (a sync on CUDA)."""
    cu = cu_seqlens.to("cpu", torch.int64)
    comp = cu_seqlens_comp.to("cpu", torch.int64)
    num_segments = cu.shape[0] - 1
    used = int(comp[-1])
    rows_per_segment = comp[1:] - comp[:-1]
    segment = torch.repeat_interleave(torch.arange(num_segments), rows_per_segment)  # (used,)
    block = torch.arange(used) - comp[:-1][segment]
    first_token = cu[:-1][segment] + block * ratio
    padding = total_comp - used
    first_token = torch.cat([first_token, torch.zeros(padding, dtype=torch.int64)])
    block = torch.cat([block, torch.zeros(padding, dtype=torch.int64)])

    k = torch.arange(coff * ratio)
    if coff == 2:
        offset = k - ratio                   # previous block: -ratio..-1, own block: 0..ratio-1
        half = (k >= ratio).long()
        valid = (block[:, None] > 0) | (k[None, :] >= ratio)
    else:
        offset = k
        half = torch.zeros_like(k)
        valid = torch.ones(total_comp, ratio, dtype=torch.bool)
    token = torch.where(valid, first_token[:, None] + offset[None, :], 0)
    return Windows(token.to(device), half.to(device), (k % ratio).to(device), valid.to(device), used)


def _gather(kv, score, ape, win: Windows, ratio: int, coff: int, dtype: torch.dtype,
            kv_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """S (R, W, d): ``score + ape`` in ``dtype``, -inf where invalid; KV (R, W, d): kv in
    ``kv_dtype`` (default ``dtype``), 0 where invalid. Differentiable in kv, score and ape."""
    num_tokens, cols = kv.shape
    d = cols // coff
    half = win.half.expand_as(win.token)
    s = score.reshape(num_tokens, coff, d)[win.token, half].to(dtype)
    s = s + ape.reshape(ratio, coff, d)[win.ape_row, win.half].to(dtype)
    valid = win.valid[:, :, None]
    s = torch.where(valid, s, float("-inf"))
    x = torch.where(valid, kv.reshape(num_tokens, coff, d)[win.token, half].to(kv_dtype or dtype), 0)
    return s, x


def _softmax_in_order(s: torch.Tensor) -> torch.Tensor:
    """softmax over dim 1 with the denominator summed left to right (pinned order)."""
    e = torch.exp(s - s.amax(dim=1, keepdim=True))
    den = e[:, 0]
    for k in range(1, e.shape[1]):
        den = den + e[:, k]
    return e / den[:, None]


def _pool_in_order(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``sum_k x_k * p_k`` left to right, one multiply and one add per position."""
    acc = x[:, 0] * p[:, 0]
    for k in range(1, x.shape[1]):
        acc = acc + x[:, k] * p[:, k]
    return acc


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def reference_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int, coff: int,
                      total_comp: Optional[int] = None, mode: str = "fp32") -> torch.Tensor:
    """``out`` (total_comp, head_dim): bf16 for "fp32"/"upstream", float64 for "fp64"."""
    _check_mode(mode)
    if total_comp is None:
        total_comp = int(cu_seqlens_comp[-1])
    win = build_windows(cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, kv.device)
    if mode == "fp32":
        s, x = _gather(kv, score, ape, win, ratio, coff, torch.float32)
        return _pool_in_order(x, _softmax_in_order(s)).to(torch.bfloat16)
    if mode == "upstream":
        s, x = _gather(kv, score, ape, win, ratio, coff, torch.float32, kv_dtype=torch.bfloat16)
        p = torch.softmax(s, dim=1).to(torch.bfloat16)
        return (x * p).sum(dim=1)
    s, x = _gather(kv, score, ape, win, ratio, coff, torch.float64)
    return (x * torch.softmax(s, dim=1)).sum(dim=1)


def _scatter_gradients(kv, win: Windows, gkv, gs, ratio: int, coff: int, dtype: torch.dtype,
                       ape_dtype: torch.dtype):
    """Place per-position gradients (U, W, d) at their (token, column); never-consumed slots
    stay +0.0. grad_ape sums over rows: each position k owns exactly one (ape row, half)."""
    num_tokens, cols = kv.shape
    d = cols // coff
    used = win.used_rows
    valid = win.valid[:used]
    token = win.token[:used][valid]
    half = win.half.expand(used, -1)[valid]
    grad_kv = torch.zeros(num_tokens, coff, d, dtype=dtype, device=kv.device)
    grad_score = torch.zeros_like(grad_kv)
    grad_kv[token, half] = gkv[valid].to(dtype)
    grad_score[token, half] = gs[valid].to(dtype)
    per_position = torch.where(valid[:, :, None], gs, 0).sum(dim=0)  # (W, d)
    grad_ape = per_position.reshape(coff, ratio, d).transpose(0, 1).reshape(ratio, cols).to(ape_dtype)
    return grad_kv.reshape(num_tokens, cols), grad_score.reshape(num_tokens, cols), grad_ape


def reference_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio: int, coff: int,
                       mode: str = "fp32") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_kv, grad_score, grad_ape)`` for ``grad_out`` (total_comp, head_dim); gradients of
    padding rows are ignored. bf16/bf16/fp32 for "fp32"/"upstream", float64 for "fp64"."""
    _check_mode(mode)
    total_comp = grad_out.shape[0]
    win = build_windows(cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, kv.device)
    used = win.used_rows
    if mode == "upstream":
        return _upstream_backward(kv, score, ape, win, grad_out, ratio, coff)
    dtype = torch.float32 if mode == "fp32" else torch.float64
    used_win = Windows(win.token[:used], win.half, win.ape_row, win.valid[:used], used)
    with torch.no_grad():
        s, x = _gather(kv, score, ape, used_win, ratio, coff, dtype)
        p = _softmax_in_order(s)
        g = grad_out[:used].to(dtype)[:, None, :]
        pd = p * (g * x)
        total = pd[:, 0]
        for k in range(1, pd.shape[1]):
            total = total + pd[:, k]
        gs = pd - p * total[:, None]
        gkv = g * p
    if mode == "fp32":
        return _scatter_gradients(kv, win, gkv, gs, ratio, coff, torch.bfloat16, torch.float32)
    return _scatter_gradients(kv, win, gkv, gs, ratio, coff, torch.float64, torch.float64)


def _upstream_backward(kv, score, ape, win: Windows, grad_out, ratio: int, coff: int):
    """Autograd of the upstream eager forward; padding rows' gradients zeroed first."""
    leaves = [t.detach().requires_grad_() for t in (kv, score, ape)]
    with torch.enable_grad():
        s, x = _gather(*leaves, win, ratio, coff, torch.float32, kv_dtype=torch.bfloat16)
        out = (x * torch.softmax(s, dim=1).to(torch.bfloat16)).sum(dim=1)
        g = grad_out.clone()
        g[win.used_rows:] = 0
        grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    return tuple(torch.zeros_like(t) if gr is None else gr for t, gr in zip(leaves, grads))
