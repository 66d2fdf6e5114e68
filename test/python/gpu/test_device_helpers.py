"""Device helpers whose bits the numerics contract rests on, checked exhaustively on the GPU.

``rcp_of_den`` replaces ``div.rn``'s reciprocal in the exact weights without its slow-path
branch; it must give the same bits for every denominator a softmax can produce (every fp32
value in [1, 512], the widest window) and NaN for NaN. Skips cleanly without CUDA.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass.cute.runtime import from_dlpack

from csa_frontend.compressor.kernels.common import rcp_of_den

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.L1,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

THREADS = 256


def _compiled_rcp(x: torch.Tensor, y: torch.Tensor):
    @cute.kernel
    def rcp_kernel(mX: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        i = bx * THREADS + tidx
        if i < mX.shape[0]:
            mY[i] = rcp_of_den(mX[i])

    @cute.jit
    def rcp_launch(mX: cute.Tensor, mY: cute.Tensor, n_blocks: cutlass.Int32):
        rcp_kernel(mX, mY).launch(grid=(n_blocks, 1, 1), block=(THREADS, 1, 1))

    args = (from_dlpack(x), from_dlpack(y), cutlass.Int32(-(-x.numel() // THREADS)))
    return cute.compile(rcp_launch, *args), args


def _all_floats(lo: float, hi: float) -> torch.Tensor:
    """Every fp32 value in [lo, hi] (both positive), in order."""
    first = torch.tensor([lo], dtype=torch.float32).view(torch.int32).item()
    last = torch.tensor([hi], dtype=torch.float32).view(torch.int32).item()
    return torch.arange(first, last + 1, dtype=torch.int32, device="cuda").view(torch.float32)


def test_rcp_of_den_is_correctly_rounded_over_every_denominator():
    x = _all_floats(1.0, 512.0)
    x = torch.cat([x, torch.tensor([float("nan")], device="cuda")])
    y = torch.full_like(x, float("nan"))
    fn, args = _compiled_rcp(x, y)
    fn(*args)
    torch.cuda.synchronize()
    want = 1.0 / x  # torch's CUDA division is IEEE div.rn
    got_bits, want_bits = y[:-1].view(torch.int32), want[:-1].view(torch.int32)
    wrong = (got_bits != want_bits).nonzero()
    assert wrong.numel() == 0, (f"{wrong.numel()} of {x.numel() - 1} reciprocals differ, first at "
                                f"{x[wrong[0, 0]].item()!r}: {y[wrong[0, 0]].item()!r} vs {want[wrong[0, 0]].item()!r}")
    assert torch.isnan(y[-1])
