"""The reference implementations against the fp64 oracle, an independent loop-based pooling and
autograd. These pin down the semantics the fused kernels must reproduce."""
import itertools

import pytest
import torch

from csa_frontend.compressor.reference import build_windows, reference_backward, reference_forward
from csa_testing import (COFFS, HEAD_DIMS, PACK_KINDS, RATIOS, assert_close_bf16, assert_positive_zero,
                         consumed_mask, leveled, loop_pooling, make_kind, make_pack, max_abs_err, offsets)

MATRIX = list(itertools.product(RATIOS, COFFS, HEAD_DIMS, PACK_KINDS))


def _smoke(ratio, coff, head_dim, kind):
    return (ratio, head_dim) in ((4, 64), (3, 65), (128, 1)) and kind in ("ragged", "padding", "short")


def _consumed_slots(pack) -> torch.Tensor:
    """(T, coff*d) bool: slots some window reads, from the SPEC's list of what is never read."""
    r, coff, d = pack.ratio, pack.coff, pack.head_dim
    mask = torch.zeros(pack.kv.shape, dtype=torch.bool)
    cu = pack.cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        blocks = (end - start) // r
        own = slice(start, start + blocks * r)
        if coff == 1:
            mask[own, :] = True
        else:
            mask[own, d:] = True                               # own-block half of every block
            mask[start:start + max(blocks - 1, 0) * r, :d] = True  # all but the last block, as "previous"
    return mask


def _padding_window(pack):
    """The padding-row value: pool tokens 0..ratio-1 as a segment's first block."""
    r = pack.ratio
    cu, comp = offsets([r], r)
    return reference_forward(pack.kv[:r], pack.score[:r], pack.ape, cu, comp, r, pack.coff, 1)[0]


@pytest.mark.parametrize("ratio,coff,head_dim,kind", leveled(MATRIX, _smoke))
def test_reference_matches_fp64_oracle(ratio, coff, head_dim, kind):
    pack = make_kind(kind, ratio, coff, head_dim, seed=MATRIX.index((ratio, coff, head_dim, kind)))
    out = reference_forward(*pack.inputs, ratio, coff, pack.total_comp)
    oracle = reference_forward(*pack.inputs, ratio, coff, pack.total_comp, mode="fp64")
    assert out.dtype == torch.bfloat16 and out.shape == (pack.total_comp, head_dim)
    assert_close_bf16(out, oracle, "out")

    grads = reference_backward(*pack.inputs, pack.grad_out, ratio, coff)
    oracle_grads = reference_backward(*pack.inputs, pack.grad_out, ratio, coff, mode="fp64")
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for name, g, o in zip(("grad_kv", "grad_score"), grads, oracle_grads):
        assert_close_bf16(g, o, name)
    torch.testing.assert_close(grads[2].double(), oracle_grads[2], rtol=1e-4, atol=1e-5)

    unread = ~_consumed_slots(pack)
    for name, g in zip(("grad_kv", "grad_score"), grads):
        assert_positive_zero(g, unread, name)

    padding = out[pack.used_rows:]
    assert torch.isfinite(padding.float()).all()
    assert torch.equal(padding, _padding_window(pack).expand_as(padding))
    if pack.lengths[0] >= ratio:  # then row 0 is segment 0's first block
        assert torch.equal(padding, out[:1].expand_as(padding))


LOOP_MATRIX = [case for case in MATRIX if case[2] in (1, 65)]


@pytest.mark.parametrize("ratio,coff,head_dim,kind", leveled(LOOP_MATRIX, _smoke))
def test_reference_matches_loop_pooling(ratio, coff, head_dim, kind):
    pack = make_kind(kind, ratio, coff, head_dim, seed=7 + ratio)
    out_l, gkv_l, gs_l, gape_l, consumed = loop_pooling(pack)
    mask = consumed_mask(pack, consumed)
    assert torch.equal(mask, _consumed_slots(pack))

    out = reference_forward(*pack.inputs, ratio, coff, pack.total_comp)
    assert_close_bf16(out, out_l, "out")
    grad_kv, grad_score, grad_ape = reference_backward(*pack.inputs, pack.grad_out, ratio, coff)
    assert_close_bf16(grad_kv, gkv_l, "grad_kv")
    assert_close_bf16(grad_score, gs_l, "grad_score")
    torch.testing.assert_close(grad_ape.double(), gape_l, rtol=1e-4, atol=1e-5)
    assert_positive_zero(grad_kv, ~mask, "grad_kv")
    assert_positive_zero(grad_score, ~mask, "grad_score")
    # Gradients of consumed slots are g*p, nonzero for random inputs.
    assert bool((grad_kv[mask] != 0).all())


@pytest.mark.L0
def test_fp32_reference_closer_to_oracle_than_upstream():
    pack = make_pack([517, 1000, 33, 0, 250], 4, 2, 128, seed=3)
    errors = {}
    for mode in ("fp32", "upstream"):
        out = reference_forward(*pack.inputs, 4, 2, mode=mode)
        grads = reference_backward(*pack.inputs, pack.grad_out, 4, 2, mode=mode)
        errors[mode] = (out, *grads[:2])
    oracle = (reference_forward(*pack.inputs, 4, 2, mode="fp64"),
              *reference_backward(*pack.inputs, pack.grad_out, 4, 2, mode="fp64")[:2])
    for i, name in enumerate(("out", "grad_kv", "grad_score")):
        ours, theirs, exact = errors["fp32"][i], errors["upstream"][i], oracle[i]
        assert max_abs_err(ours, exact) <= max_abs_err(theirs, exact), name
        mean = lambda t: float((t.double() - exact).abs().mean())  # noqa: E731
        assert mean(ours) < 0.8 * mean(theirs), name


@pytest.mark.L0
@pytest.mark.parametrize("ratio,coff,lengths,extra_rows", [(2, 2, [5, 0, 1, 4], 2), (3, 1, [7, 2, 3], 1),
                                                         (1, 2, [3, 0, 2], 0)])
def test_fp64_reference_gradcheck(ratio, coff, lengths, extra_rows):
    pack = make_pack(lengths, ratio, coff, 3, extra_tokens=1, extra_rows=extra_rows, seed=11)
    leaves = [t.double().requires_grad_() for t in (pack.kv, pack.score, pack.ape)]
    cu, comp, total = pack.cu_seqlens, pack.cu_seqlens_comp, pack.total_comp

    def forward(kv, score, ape):
        return reference_forward(kv, score, ape, cu, comp, ratio, coff, total, mode="fp64")

    assert torch.autograd.gradcheck(forward, leaves)

    class Analytic(torch.autograd.Function):
        """fp64 oracle forward with the analytic (SPEC formula) backward."""

        @staticmethod
        def forward(ctx, kv, score, ape):
            ctx.save_for_backward(kv, score, ape)
            return forward(kv, score, ape)

        @staticmethod
        def backward(ctx, grad_out):
            return reference_backward(*ctx.saved_tensors, cu, comp, grad_out, ratio, coff, mode="fp64")

    used = pack.used_rows  # the analytic backward ignores padding rows by contract
    assert torch.autograd.gradcheck(lambda *x: Analytic.apply(*x)[:used], leaves)


@pytest.mark.L0
def test_padding_row_gradients_are_ignored():
    pack = make_pack([9, 6], 4, 2, 16, extra_rows=3, seed=5)
    base = reference_backward(*pack.inputs, pack.grad_out, 4, 2)
    noisy = pack.grad_out.clone()
    noisy[pack.used_rows:] = 1e4
    for mode in ("fp32", "upstream", "fp64"):
        expected = reference_backward(*pack.inputs, pack.grad_out, 4, 2, mode=mode)
        for a, b in zip(reference_backward(*pack.inputs, noisy, 4, 2, mode=mode), expected):
            assert torch.equal(a, b)
    assert torch.equal(base[0], reference_backward(*pack.inputs, noisy, 4, 2)[0])


@pytest.mark.L0
@pytest.mark.parametrize("coff", COFFS)
def test_all_minus_inf_window_gives_nan_like_eager(coff):
    pack = make_pack([8], 2, coff, 4, seed=2)
    score = pack.score.clone()
    score[[0, 1, 4, 5, 6, 7]] = float("-inf")
    # coff 2: row 0 (previous half invalid) and row 3 (tokens 4..7) see only -inf; coff 1: rows 0, 2, 3.
    nan_rows = {0, 3} if coff == 2 else {0, 2, 3}
    for mode in ("fp32", "upstream", "fp64"):
        out = reference_forward(pack.kv, score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp, 2, coff,
                                mode=mode)
        for row in range(out.shape[0]):
            assert bool(out[row].isnan().all()) == (row in nan_rows), (mode, row)
            assert bool(out[row].isnan().any()) == (row in nan_rows), (mode, row)


@pytest.mark.L0
def test_empty_pack_and_zero_rows():
    pack = make_pack([], 4, 2, 8)
    assert pack.kv.shape == (0, 16)
    out = reference_forward(*pack.inputs, 4, 2)
    assert out.shape == (0, 8)
    grads = reference_backward(*pack.inputs, pack.grad_out, 4, 2)
    assert [tuple(g.shape) for g in grads] == [(0, 16), (0, 16), (4, 16)]
    assert not grads[2].any()


@pytest.mark.L0
def test_windows_follow_the_spec_layout():
    cu, comp = offsets([5, 0, 8], 2)
    win = build_windows(cu, comp, 2, 2, int(comp[-1]) + 1, torch.device("cpu"))
    # rows: seg0 blocks (tokens 0-1, 2-3), seg2 blocks (5-6, 7-8, 9-10, 11-12), one padding row
    assert win.used_rows == 6
    assert win.token.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 5, 6], [5, 6, 7, 8], [7, 8, 9, 10],
                                  [9, 10, 11, 12], [0, 0, 0, 1]]
    assert win.valid[:, :2].tolist() == [[False] * 2, [True] * 2, [False] * 2, [True] * 2, [True] * 2,
                                         [True] * 2, [False] * 2]
    assert win.half.tolist() == [0, 0, 1, 1] and win.ape_row.tolist() == [0, 1, 0, 1]


@pytest.mark.L0
def test_unknown_mode_is_rejected():
    pack = make_pack([8], 4, 2, 8)
    with pytest.raises(ValueError, match="mode"):
        reference_forward(*pack.inputs, 4, 2, mode="fp16")
