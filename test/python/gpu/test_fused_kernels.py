"""Fused kernels vs the fp32-intermediate reference and the fp64 oracle, on the GPU.

Skips cleanly without CUDA. Outputs are NaN-poisoned before every launch, so an element the
kernel forgets shows up as NaN (inputs are finite), and never-consumed gradient slots must
come back as exact zeros because the reference has exact zeros there.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from csa_frontend import csa_compress
from csa_frontend.compressor import kernels
from csa_frontend.compressor.kernels import schedule, window_bwd
from csa_frontend.compressor.kernels.schedule import choose_schedule, serial_forward_schedule, takes_serial_forward
from csa_frontend.compressor.reference import reference_backward, reference_forward

from .packs import COLD_CONFIG_CAPTURE, COLD_CONFIG_RAISE, cancel_windows, edge_lengths, offsets, random_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, total_comp):
    out = torch.full((total_comp, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernels.forward(kv, score, ape, cu, comp, out, ratio=ratio, coff=coff, head_dim=head_dim)
    return out


def serial_launch(rows, ratio, coff, head_dim):
    """Whether a forward launch of ``rows`` rows of this configuration runs the serial forward
    (the limit depends on the configuration's own forward family)."""
    return takes_serial_forward(rows, head_dim, serial_forward_schedule(ratio, coff, head_dim),
                                choose_schedule(ratio, coff, head_dim, "fwd").family)


def run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim):
    gkv = torch.full_like(kv, float("nan"))
    gs = torch.full_like(score, float("nan"))
    gape = torch.full_like(ape, float("nan"))
    kernels.backward(kv, score, ape, cu, comp, grad_out, gkv, gs, gape,
                     ratio=ratio, coff=coff, head_dim=head_dim)
    return gkv, gs, gape


def current_kernels(direction, ratio, coff, head_dim):
    """``dispatch._kernels_for`` on the current CUDA device: the compiled kernels a call launches."""
    from csa_frontend.compressor.kernels import dispatch
    return dispatch._kernels_for(direction, torch.device("cuda", torch.cuda.current_device()), ratio, coff, head_dim)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_oracle_parity(name, got, ref, oracle):
    e_got, e_ref = max_err(got, oracle), max_err(ref, oracle)
    assert e_got <= e_ref * (1 + 1e-6) + 1e-4, f"{name}: err {e_got} vs reference err {e_ref}"


def assert_within_one_step(got, ref, count=True):
    """Every element at most one bf16 step (the spacing at |ref|) away, and (``count``) at most
    max(1, 0.1%) of the elements differ at all."""
    ref = ref.float()
    _, exp = torch.frexp(ref)
    step = torch.ldexp(torch.ones_like(ref), exp - 8)  # bf16 keeps 8 significant bits
    diff = (got.float() - ref).abs()
    assert torch.all(diff <= step), f"max diff {diff.max().item()}"
    n_diff = int((diff > 0).sum())
    assert not count or n_diff <= max(1, ref.numel() // 1000), f"{n_diff} of {ref.numel()} elements differ"


def assert_contract(name, got, ref, oracle, count=True):
    """Differing elements (``count``) <= max(1, 0.1%), max abs diff <= 1.6e-2, and oracle parity."""
    diff = (got.double() - ref.double()).abs()
    n_diff = int((diff > 0).sum())
    worst = diff.max().item() if diff.numel() else 0.0
    where = (diff > 0).nonzero()[:4].tolist()
    assert not count or n_diff <= max(1, ref.numel() // 1000), (
        f"{name}: {n_diff} of {ref.numel()} differ (max {worst} at {where})")
    assert worst <= 1.6e-2, f"{name}: max diff {worst} at {where}"
    assert_oracle_parity(name, got, ref, oracle)


def check_pack(ratio, coff, head_dim, lengths, *, pad_rows, seed, extra_tokens, fwd_exact, bwd_exact,
               variants=False):
    """Both directions of one pack against the reference, each under its family's contract (a
    launch small enough for the serial forward must match the reference bit for bit, and then
    runs again on its family's forward, checked but for the count of differing elements):
    ``fwd_exact`` (register window) asks every ``out`` element within one bf16 step,
    ``bwd_exact`` bit-identical ``grad_kv``/``grad_score``; otherwise the stream family's
    tolerance contract. ``extra_tokens`` past the last segment must come back as zero gradients.
    ``variants``: also the atomic and the frozen-ape backwards (``check_backward_variants``) and
    the public autograd op (``check_csa_compress``) on the same pack."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu, comp = offsets(lengths, ratio)
    n_tok = int(cu[-1]) + extra_tokens
    kv, score, ape = random_inputs(n_tok, ratio, coff, head_dim, generator=g)
    total = int(comp[-1]) + pad_rows
    out = launched = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, total)
    assert not torch.isnan(out).any(), "forward left elements unwritten"
    ref = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=total)
    oracle = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=total, mode="fp64")
    serial = serial_launch(total, ratio, coff, head_dim)
    if serial:
        # a small launch: the serial forward ran, with the reference's bits; then the family's
        # own forward on the same pack, under its contract but for the count of differing
        # elements, which at this size only the serial forward keeps (its reason to exist)
        assert torch.equal(out, ref), f"serial forward: {(out != ref).sum().item()} elements differ"
        with mock.patch.object(schedule, "SERIAL_FWD_MAX_OUTPUTS", 0):
            out = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, total)
        assert not torch.isnan(out).any(), "forward left elements unwritten"
    if fwd_exact:
        assert_within_one_step(out, ref, count=not serial)
        assert_oracle_parity("out", out, ref, oracle)
    else:
        assert_contract("out", out, ref, oracle, count=not serial)

    grad_out = torch.randn(total, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    gkv, gs, gape = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)
    for name, got in (("grad_kv", gkv), ("grad_score", gs), ("grad_ape", gape)):
        assert not torch.isnan(got).any(), f"{name}: elements left unwritten"
    rkv, rs, rape = reference_backward(kv, score, ape, cu, comp, grad_out, ratio, coff)
    okv, os_, oape = reference_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, mode="fp64")
    if bwd_exact:
        assert torch.equal(gkv, rkv), f"grad_kv differs in {(gkv != rkv).sum().item()} elements"
        assert torch.equal(gs, rs), f"grad_score differs in {(gs != rs).sum().item()} elements"
        torch.testing.assert_close(gape, rape, rtol=1e-5, atol=1e-5 * rape.abs().max().item())
        assert_oracle_parity("grad_kv", gkv, rkv, okv)
        assert_oracle_parity("grad_score", gs, rs, os_)
    else:
        # never-consumed slots are exact zeros in the reference: they must be exact zeros here too
        unconsumed = (rkv == 0) & (rs == 0)
        assert torch.all(gkv[unconsumed] == 0) and torch.all(gs[unconsumed] == 0)
        assert_contract("grad_kv", gkv, rkv, okv)
        assert_contract("grad_score", gs, rs, os_)
        torch.testing.assert_close(gape, rape, rtol=1e-4, atol=1e-4 * rape.abs().max().item())
    if variants:
        inputs = (kv, score, ape, cu, comp, grad_out)
        check_backward_variants(inputs, (gkv, gs, gape), ratio, coff, head_dim)
        check_csa_compress(inputs, total, launched, (gkv, gs, gape), ratio, coff)


def check_csa_compress(inputs, total_comp, out, grads, ratio, coff):
    """The public autograd op on a pack whose default launches gave ``out`` and ``grads``: it
    validates, sizes ``out`` from ``total_comp`` and allocates the gradients itself, and must
    carry those launches' bits."""
    kv, score, ape, cu, comp, grad_out = inputs
    leaves = [t.clone().requires_grad_() for t in (kv, score, ape)]
    pooled = csa_compress(*leaves, cu, comp, ratio=ratio, coff=coff, total_comp=total_comp)
    pooled.backward(grad_out)
    assert torch.equal(pooled.detach(), out), "csa_compress: out differs from the kernel launch"
    for name, leaf, want in zip(("kv", "score", "ape"), leaves, grads):
        assert torch.equal(leaf.grad, want), \
            f"csa_compress: grad of {name} differs in {(leaf.grad != want).sum().item()} elements"


def check_config(ratio, coff, head_dim, lengths, pad_rows=0, seed=0):
    """A register-window configuration: exact contract in both directions."""
    check_pack(ratio, coff, head_dim, lengths, pad_rows=pad_rows, seed=seed, extra_tokens=3,
               fwd_exact=True, bwd_exact=True)


@pytest.mark.L0
@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("ratio", [4])
@pytest.mark.parametrize("head_dim", [128])
def test_smoke(ratio, coff, head_dim):
    check_config(ratio, coff, head_dim, edge_lengths(ratio), pad_rows=2)


@pytest.mark.L1
@pytest.mark.parametrize("head_dim", [64, 65, 128, 512])
@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 8])
def test_matrix(ratio, coff, head_dim):
    check_config(ratio, coff, head_dim, edge_lengths(ratio), pad_rows=3, seed=ratio * 10 + coff)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 128), (2, 2, 4096)])
def test_larger_packs(ratio, coff, head_dim):
    lengths = [1000, 37, 4096 + 3, 0, 2, 777]
    check_config(ratio, coff, head_dim, lengths, pad_rows=5, seed=7)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 2), (1, 1, 3), (2, 2, 8), (8, 1, 6)])
def test_tiny_head_dims(ratio, coff, head_dim):
    """Head dims under 16: the backward CTA holds more row lanes than the slab's unrolled lane
    sum covers, so it sums them in a runtime loop (same order, same bits)."""
    assert choose_schedule(ratio, coff, head_dim, "bwd").row_lanes > window_bwd.UNROLLED_REDUCE_LANES
    check_config(ratio, coff, head_dim, [1000, 37, 4096 + 3, 0, 2, 777], pad_rows=4, seed=head_dim)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(5, 2, 130), (7, 2, 512), (12, 1, 64), (16, 1, 192), (13, 1, 128)])
def test_long_windows_at_vec2(ratio, coff, head_dim):
    """Windows past the forward's values budget that still run in registers at vec 2 (up to 16
    positions), whose backward is the register window up to 12 positions and streamed beyond
    (ratio > 8): each direction under the contract of the family that serves it, on packs long
    enough that the forward is the family's own, not the serial one."""
    fwd = choose_schedule(ratio, coff, head_dim, "fwd")
    assert fwd.family == "window" and fwd.vec == 2
    assert coff * ratio * fwd.vec > schedule.WINDOW_REGISTER_BUDGET["fwd"]
    bwd_window = choose_schedule(ratio, coff, head_dim, "bwd").family == "window"
    check_pack(ratio, coff, head_dim, [1000, 37, 4096 + 3, 0, 2, 777, 20000], pad_rows=3, seed=ratio + head_dim,
               extra_tokens=3, fwd_exact=True, bwd_exact=bwd_window)


@pytest.mark.L1
def test_many_short_segments():
    check_config(4, 2, 128, [13, 4, 0, 7, 3, 8, 256] * 70, pad_rows=0, seed=11)


@pytest.mark.L1
@pytest.mark.parametrize("n_seg", [31, 32, 33, 1024, 1025])
def test_segment_lookup_rounds(n_seg):
    """The warp-wide row lookup (``find_segment_warp``) takes one round up to 32 segments, two up
    to 1024, three beyond: segment counts on both sides of each, with empty segments (first and
    last), segments shorter than ratio and padding rows."""
    g = torch.Generator().manual_seed(n_seg)
    lengths = torch.randint(0, 24, (n_seg,), generator=g).tolist()
    lengths[0], lengths[-2], lengths[-1] = 0, 9, 0
    check_config(4, 2, 128, lengths, pad_rows=3, seed=n_seg)


@pytest.mark.L1
@pytest.mark.parametrize("n_seg", sorted({1, 2} | {32 * 2 ** k + e for e in (-1, 0) for k in range(3)}))
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (4, 1, 512), (16, 2, 256), (128, 1, 128)])
def test_one_round_lookup(monkeypatch, n_seg, ratio, coff, head_dim):
    """``CSA_FRONTEND_LOOKUP_ONE_ROUND`` (the default of every kernel but the register-window
    backward), set to 4 for every kernel: lookups in packs of fewer than 128 segments by one
    round of 1, 2 or 4 loads per lane and shuffles, more by the search (segment counts on both
    sides of each tier). Both directions of both families, each under its family's contract and bit for bit
    against the search, with empty, short and tail segments and padding rows, so the walking
    kernels also look rows up mid-walk."""
    from csa_frontend.compressor.kernels import dispatch

    def lookups(loads):
        for knob in schedule.LOOKUP_ONE_ROUND:
            monkeypatch.setitem(schedule.LOOKUP_ONE_ROUND, knob, loads)
        dispatch.clear_cache()

    g = torch.Generator().manual_seed(n_seg)
    lengths = torch.randint(0, 3 * ratio * 8, (n_seg,), generator=g).tolist()
    if n_seg > 1:
        lengths[0], lengths[-1] = 0, ratio - 1
    lengths[n_seg // 2] = 64 * ratio + 1  # past the serial forward's launches: the window forward runs
    rows = sum(n // ratio for n in lengths) + 3
    assert not serial_launch(rows, ratio, coff, head_dim)
    cu, comp = offsets(lengths, ratio)
    kv, score, ape = random_inputs(int(cu[-1]) + 3, ratio, coff, head_dim,
                                   generator=torch.Generator(device="cuda").manual_seed(n_seg))
    grad_out = torch.randn(rows, head_dim, device="cuda").to(torch.bfloat16)
    try:
        results = {}
        for loads in (0, 4):
            lookups(loads)
            results[loads] = (run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, rows),
                              *run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim))
        for name, searched, one_round in zip(("out", "grad_kv", "grad_score", "grad_ape"), *results.values()):
            assert torch.equal(searched, one_round), f"{name}: the one-round lookup changed bits"
        exact = {d: choose_schedule(ratio, coff, head_dim, d).family == "window" for d in ("fwd", "bwd")}
        check_pack(ratio, coff, head_dim, lengths, pad_rows=3, seed=n_seg, extra_tokens=3,
                   fwd_exact=exact["fwd"], bwd_exact=exact["bwd"])
    finally:
        dispatch.clear_cache()


def check_cancelling_forward(ratio, coff, head_dim, lengths, seed):
    """Windows whose weighted sums cancel to near zero: every ``out`` element within one bf16
    step of the reference (the checked fast pooling must hand these columns to the exact one;
    pooled fast, they land many steps away)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu, comp = offsets(lengths, ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim, generator=g)
    cancel_windows(kv, score, ape, cu, comp, ratio, coff, head_dim)
    total = int(comp[-1]) + 2
    out = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, total)
    ref = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=total)
    near_zero = (ref[: int(comp[-1])].float().abs() < 1e-2).float().mean().item()
    assert near_zero > 0.3, f"only {near_zero:.0%} of the outputs cancel: the test lost its inputs"
    assert_within_one_step(out, ref)
    oracle = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=total, mode="fp64")
    assert_oracle_parity("out", out, ref, oracle)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (4, 1, 128), (2, 2, 64), (8, 1, 64), (1, 2, 66),
                                                 (3, 2, 65), (4, 2, 512), (7, 2, 128), (16, 1, 512)])
def test_cancelling_windows(ratio, coff, head_dim):
    check_cancelling_forward(ratio, coff, head_dim, [4096 + 3, 0, 2 * ratio, 1000], seed=ratio + coff)


@pytest.mark.L1
@pytest.mark.parametrize("score_scale,kv_scale", [(40.0, 1.0), (1.0, 1e35), (1.0, 1e-38), (0.0, 1.0), (1e-30, 3.0)])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (2, 1, 64)])
def test_forward_extreme_magnitudes(ratio, coff, head_dim, score_scale, kv_scale):
    """Score spreads past the fast pooling's limit (x40), outputs near bf16's range ends (kv x1e35,
    x1e-38: products in the subnormal range), equal scores (x0: every weight 1/W) and spreads
    below one ulp: every ``out`` element within one bf16 step of the reference, whichever path
    pools it."""
    g = torch.Generator(device="cuda").manual_seed(int(score_scale) + ratio)
    lengths = [2000 + 3, 0, 2 * ratio, 333]
    cu, comp = offsets(lengths, ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim, generator=g)
    score = (score.float() * score_scale).to(torch.bfloat16)
    ape = ape * score_scale
    kv = (kv.float() * kv_scale).to(torch.bfloat16)
    total = int(comp[-1]) + 2
    out = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, total)
    ref = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=total)
    assert torch.isfinite(ref.float()).all()
    assert_within_one_step(out, ref)


@pytest.mark.L1
def test_padding_gradients_ignored():
    ratio, coff, d = 4, 2, 128
    cu, comp = offsets([33, 17], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, d)
    used = int(comp[-1])
    grad_out = torch.randn(used + 6, d, device="cuda").to(torch.bfloat16)
    a = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, d)
    grad_out[used:] = 1e4  # padding rows' incoming gradients must not matter
    b = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, d)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.L1
def test_empty_output():
    ratio, coff, d = 4, 2, 64
    cu, comp = offsets([3, 2], ratio)  # every segment shorter than ratio: no rows
    kv, score, ape = random_inputs(5, ratio, coff, d)
    out = run_forward(kv, score, ape, cu, comp, ratio, coff, d, 0)
    assert out.shape == (0, d)
    gkv, gs, gape = run_backward(kv, score, ape, cu, comp, out.new_zeros(0, d), ratio, coff, d)
    assert torch.all(gkv == 0) and torch.all(gs == 0) and torch.all(gape == 0)


@pytest.mark.L1
@pytest.mark.parametrize("coff", [1, 2])
def test_bitwise_deterministic(coff):
    ratio, d = 4, 256
    cu, comp = offsets([8192, 1001, 3000], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, d)
    grad_out = torch.randn(int(comp[-1]), d, device="cuda").to(torch.bfloat16)
    first = None
    for _ in range(20):
        res = (run_forward(kv, score, ape, cu, comp, ratio, coff, d, int(comp[-1])),
               *run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, d))
        if first is None:
            first = res
        for a, b in zip(first, res):
            assert torch.equal(a, b)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 128), (128, 2, 128), (16, 1, 256)])
def test_back_to_back_calls_see_their_neighbours_writes(ratio, coff, head_dim):
    check_back_to_back(ratio, coff, head_dim)


def check_back_to_back(ratio, coff, head_dim):
    """Every kernel is a programmatic dependent launch on sm_90+: it may start while the kernel
    before it on the stream still runs, and must wait before touching memory. Here each call's
    inputs are rewritten in place by the kernel right before it, and its outputs read by the
    kernel right after it and overwritten by the next call: every call must give exactly the
    bits of an isolated, synchronised call on the same data (a stale read shows the previous
    set's values)."""
    cu, comp = offsets([8192, 3 * ratio + 1, 4096], ratio)
    n_tok, total = int(cu[-1]), int(comp[-1])
    sets = []
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        kv, score, ape = random_inputs(n_tok, ratio, coff, head_dim, generator=g)
        grad_out = torch.randn(total, head_dim, device="cuda", generator=g).to(torch.bfloat16)
        out = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, total)
        grads = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)
        torch.cuda.synchronize()
        sets.append(((kv, score, ape, grad_out), (out, *grads)))
    kv, score, ape, grad_out = (torch.empty_like(t) for t in sets[0][0])
    out = torch.empty(total, head_dim, device="cuda", dtype=torch.bfloat16)
    gkv, gs, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    seen = []
    for i in range(9):
        inputs, _ = sets[i % 3]
        for dst, src in zip((kv, score, ape), inputs):
            dst.copy_(src)
        kernels.forward(kv, score, ape, cu, comp, out, ratio=ratio, coff=coff, head_dim=head_dim)
        grad_out.copy_(inputs[3])
        kernels.backward(kv, score, ape, cu, comp, grad_out, gkv, gs, gape, ratio=ratio, coff=coff,
                         head_dim=head_dim)
        seen.append(tuple(t.clone() for t in (out, gkv, gs, gape)))
    torch.cuda.synchronize()
    for i, got in enumerate(seen):
        for name, a, b in zip(("out", "grad_kv", "grad_score", "grad_ape"), got, sets[i % 3][1]):
            assert torch.equal(a, b), f"call {i}: {name} differs from the isolated call"


@pytest.mark.L1
def test_cuda_graph_replay():
    ratio, coff, d = 4, 2, 128
    cu, comp = offsets([300, 77, 1024], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, d)
    total = int(comp[-1])
    grad_out = torch.randn(total, d, device="cuda").to(torch.bfloat16)
    out = torch.empty(total, d, device="cuda", dtype=torch.bfloat16)
    gkv, gs, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)

    def step():
        kernels.forward(kv, score, ape, cu, comp, out, ratio=ratio, coff=coff, head_dim=d)
        kernels.backward(kv, score, ape, cu, comp, grad_out, gkv, gs, gape, ratio=ratio, coff=coff,
                         head_dim=d)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up compiles
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        nkv, nscore, nape = random_inputs(int(cu[-1]), ratio, coff, d,
                                          generator=torch.Generator(device="cuda").manual_seed(seed))
        kv.copy_(nkv), score.copy_(nscore), ape.copy_(nape)
        grad_out.copy_(torch.randn_like(grad_out, dtype=torch.float32).to(torch.bfloat16))
        out.fill_(float("nan")), gkv.fill_(float("nan")), gs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_within_one_step(out, reference_forward(kv, score, ape, cu, comp, ratio, coff))
        rkv, rs, _ = reference_backward(kv, score, ape, cu, comp, grad_out, ratio, coff)
        assert torch.equal(gkv, rkv) and torch.equal(gs, rs)


@pytest.mark.L1
def test_stream_row_buckets_capture_after_one_long_call():
    """A long pack compiles the stream backward; a graph then captures a short pack (the few-rows
    schedule) without compiling, and its replays match the long pack's kernels on the same rows
    within the tolerance contract."""
    from csa_frontend.compressor.kernels import dispatch, schedule
    ratio, coff, d = COLD_CONFIG_CAPTURE
    cu, comp = offsets([ratio * 600], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, d)
    grad_out = torch.randn(int(comp[-1]), d, device="cuda").to(torch.bfloat16)
    kernels.backward(kv, score, ape, cu, comp, grad_out, torch.empty_like(kv), torch.empty_like(score),
                     torch.empty_like(ape), ratio=ratio, coff=coff, head_dim=d)
    _, _, sched, per_sm, few_kernels = dispatch._kernels_for("bwd", kv.device, ratio, coff, d)
    few = few_kernels[2]
    assert not schedule.takes_few_rows_schedule(int(comp[-1]), sched, few, per_sm)
    keys = dispatch.cache_keys()
    short_cu, short_comp = offsets([ratio * 3 + 5, 2 * ratio], ratio)
    assert schedule.takes_few_rows_schedule(int(short_comp[-1]), sched, few, per_sm)
    skv, sscore = kv[: int(short_cu[-1])].clone(), score[: int(short_cu[-1])].clone()
    sgo = grad_out[: int(short_comp[-1])].clone()
    gkv, gs, gape = torch.empty_like(skv), torch.empty_like(sscore), torch.empty_like(ape)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.backward(skv, sscore, ape, short_cu, short_comp, sgo, gkv, gs, gape, ratio=ratio, coff=coff,
                         head_dim=d)
    assert dispatch.cache_keys() == keys
    gkv.fill_(float("nan")), gs.fill_(float("nan")), gape.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    rkv, rs, rape = reference_backward(skv, sscore, ape, short_cu, short_comp, sgo, ratio, coff)
    for got, ref in ((gkv, rkv), (gs, rs)):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gape, rape, rtol=1e-4, atol=1e-4 * rape.abs().max().item())


@pytest.mark.L1
def test_compile_under_capture_raises():
    ratio, coff, d = COLD_CONFIG_RAISE
    cu, comp = offsets([50], ratio)
    kv, score, ape = random_inputs(50, ratio, coff, d)
    out = torch.empty(10, d, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph):
            kernels.forward(kv, score, ape, cu, comp, out, ratio=ratio, coff=coff, head_dim=d)


# ---- stream family (windows too wide for registers): tolerance contract, not bitwise ----

def check_stream_config(ratio, coff, head_dim, lengths, pad_rows=1, seed=0):
    """A stream-family configuration: tolerance contract in both directions."""
    check_pack(ratio, coff, head_dim, lengths, pad_rows=pad_rows, seed=seed, extra_tokens=5,
               fwd_exact=False, bwd_exact=False)


def stream_edge_lengths(ratio):
    """Segments of 0, ratio-1, ratio and ratio+1 tokens among longer ones (with tails)."""
    return [ratio + 1, 0, ratio - 1, 3 * ratio + 7, ratio, 1, 2 * ratio, 40 * ratio + 5]


@pytest.mark.L0
def test_stream_smoke():
    check_stream_config(128, 2, 128, stream_edge_lengths(128))


def stream_matrix_cases():
    """(ratio, coff, head_dim, bucket): these packs are small enough for the backward's few-rows
    schedule, so where the planner has one they also run through the default schedule (the one
    long packs take) with the bucket turned off."""
    from csa_frontend.compressor.kernels.schedule import few_rows_schedule
    cases = []
    for ratio in (16, 32, 64, 128, 200, 256):
        for coff in (1, 2):
            for head_dim in (64, 128, 192, 512):
                cases.append((ratio, coff, head_dim, "planner"))
                if few_rows_schedule(ratio, coff, head_dim) is not None:
                    cases.append((ratio, coff, head_dim, "default_schedule"))
    return cases


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim,bucket", stream_matrix_cases())
def test_stream_matrix(ratio, coff, head_dim, bucket, monkeypatch):
    if bucket == "default_schedule":
        monkeypatch.setattr(schedule, "STREAM_BWD_FEW_ROWS", 0)
    check_stream_config(ratio, coff, head_dim, stream_edge_lengths(ratio), seed=ratio + coff)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(8, 2, 65), (33, 2, 66), (256, 1, 4096)])
def test_stream_odd_and_wide(ratio, coff, head_dim):
    check_stream_config(ratio, coff, head_dim, [3 * ratio + 1, ratio - 1, 2 * ratio], seed=3)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(16, 2, 256), (12, 2, 66), (9, 2, 3), (32, 1, 128), (20, 1, 4096)])
def test_online_forward(online_forward, ratio, coff, head_dim):
    """Stream windows of at most ``STREAM_FWD_ONLINE_WINDOW`` positions: the online forward (one
    thread per row and column slice, chunked online softmax), on packs long enough to pass the
    serial forward's limit, with odd and wide head dims, under the stream contract."""
    assert choose_schedule(ratio, coff, head_dim, "fwd").online
    assert current_kernels("fwd", ratio, coff, head_dim).one_segment is None
    check_stream_config(ratio, coff, head_dim, stream_edge_lengths(ratio) + [700 * ratio + 3], seed=ratio)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(16, 2, 256), (9, 2, 3), (32, 1, 128)])
def test_pipelined_forward_of_short_windows(online_forward_off, ratio, coff, head_dim):
    """CSA_FRONTEND_STREAM_FWD_ONLINE=0 hands short stream windows back to the pipelined
    forward, which must still hold the stream contract there."""
    assert not choose_schedule(ratio, coff, head_dim, "fwd").online
    check_stream_config(ratio, coff, head_dim, stream_edge_lengths(ratio) + [700 * ratio + 3], seed=ratio)


@pytest.mark.L1
def test_stream_deterministic():
    ratio, coff, d = 128, 2, 256
    cu, comp = offsets([8192, 3000], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, d)
    grad_out = torch.randn(int(comp[-1]), d, device="cuda").to(torch.bfloat16)
    first = None
    for _ in range(10):
        res = (run_forward(kv, score, ape, cu, comp, ratio, coff, d, int(comp[-1])),
               *run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, d))
        first = first or res
        for a, b in zip(first, res):
            assert torch.equal(a, b)


@pytest.mark.L1
@pytest.mark.parametrize("n_slab", [1, 5, 31, 32, 33, 250, 256, 600, 1500])
def test_slab_reduction_order(n_slab):
    """``ape_reduce`` sums the slabs in its documented order, bit for bit, whatever the slab
    count: ``ape_split`` chunks, each summed from 0.0 in slab order, then the chunk sums in
    chunk order (chunks that end inside a block of loads take the predicated path)."""
    from csa_frontend.compressor.kernels.schedule import ape_split
    ratio, coff, head_dim = 4, 2, 128
    _, reduce, *_ = current_kernels("bwd", ratio, coff, head_dim)
    n = ratio * coff * head_dim
    g = torch.Generator(device="cuda").manual_seed(n_slab)
    slab = 10 * torch.randn(n_slab, ratio, coff * head_dim, device="cuda", generator=g)
    got = torch.full((ratio, coff * head_dim), float("nan"), device="cuda")
    split = ape_split(n_slab)
    reduce(slab, got, split)
    chunk = -(-n_slab // split)
    parts = []
    for j in range(split):
        acc = torch.zeros(ratio, coff * head_dim, device="cuda")
        for k in range(j * chunk, min((j + 1) * chunk, n_slab)):
            acc = acc + slab[k]
        parts.append(acc)
    want = parts[0]
    for part in parts[1:]:
        want = want + part
    assert torch.equal(got, want), f"{int((got != want).sum())} of {n} elements differ"


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (3, 1, 65), (128, 2, 256), (128, 1, 128), (16, 2, 256),
                                               (100, 2, 66), (64, 1, 512)])
def test_atomic_grad_ape_path(ratio, coff, head_dim):
    """deterministic=False: same grad_kv/grad_score bits, grad_ape equal up to summation order."""
    check_atomic_path(ratio, coff, head_dim)


@pytest.mark.L1
def test_atomic_grad_ape_path_of_the_wide_window_backward(monkeypatch):
    """The same through the wide register-window backward (``wide_rows_schedule``) at any row count."""
    monkeypatch.setattr(schedule, "WINDOW_BWD_WIDE_MIN_ROWS", 1)
    assert schedule.wide_rows_schedule(4, 1, 512) is not None
    check_atomic_path(4, 1, 512)


def check_atomic_path(ratio, coff, head_dim):
    cu, comp = offsets([40 * ratio + 3, 0, ratio - 1, 7 * ratio], ratio)
    kv, score, ape = random_inputs(int(cu[-1]) + 2, ratio, coff, head_dim)
    grad_out = torch.randn(int(comp[-1]), head_dim, device="cuda").to(torch.bfloat16)
    det = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)
    check_backward_variants((kv, score, ape, cu, comp, grad_out), det, ratio, coff, head_dim,
                            variants=[(False, True)])


def check_backward_variants(inputs, det, ratio, coff, head_dim,
                            variants=((False, True), (True, False), (False, False))):
    """The other backwards of one pack against its deterministic one ``det``: for each
    ``(deterministic, wants_grad_ape)``, grad_kv and grad_score keep every bit (NaN-poisoned
    buffers, so every element is written), the atomic grad_ape equals ``det``'s up to summation
    order, and without grad_ape (a frozen ape) none is computed."""
    for deterministic, wants_ape in variants:
        got = [torch.full_like(t, float("nan")) for t in det[:2]]
        got.append(torch.full_like(det[2], float("nan")) if wants_ape else None)
        kernels.backward(*inputs, *got, ratio=ratio, coff=coff, head_dim=head_dim, deterministic=deterministic)
        what = f"deterministic={deterministic}, grad_ape {'wanted' if wants_ape else 'None'}"
        assert torch.equal(got[0], det[0]), f"{what}: grad_kv differs in {(got[0] != det[0]).sum().item()} elements"
        assert torch.equal(got[1], det[1]), f"{what}: grad_score differs in {(got[1] != det[1]).sum().item()} elements"
        if wants_ape:
            torch.testing.assert_close(got[2], det[2], rtol=1e-5, atol=1e-5 * det[2].abs().max().item(), msg=what)


@pytest.mark.L1
def test_atomic_path_takes_the_deterministic_kernels_where_row_groups_contend(monkeypatch):
    """deterministic=False at r16 c2 d256 with more row groups than STREAM_ATOMIC_MAX_GROUPS runs
    the deterministic kernels: grad_ape has the default's bits (128 atomic adds per element in
    any order would not). With the limit lifted, the same launch adds atomically again."""
    ratio, coff, head_dim = 16, 2, 256
    cu, comp = offsets([8192] * 4, ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim)
    grad_out = torch.randn(int(comp[-1]), head_dim, device="cuda").to(torch.bfloat16)
    from csa_frontend.compressor.kernels import dispatch
    rows = int(comp[-1])
    main, reduce, sched, per_sm, few = dispatch._kernels_for("bwd_atomic", kv.device, ratio, coff, head_dim)
    _, _, sched, rpt = dispatch.backward_for_rows(rows, main, reduce, sched, per_sm, few,
                                                  schedule.slab_bytes(ratio, coff, head_dim))
    assert schedule.bwd_row_groups(rows, sched, rpt) > schedule.STREAM_ATOMIC_MAX_GROUPS
    det = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)

    def atomic_run():
        fast = [torch.full_like(t, float("nan")) for t in det]
        kernels.backward(kv, score, ape, cu, comp, grad_out, *fast, ratio=ratio, coff=coff, head_dim=head_dim,
                         deterministic=False)
        assert torch.equal(fast[0], det[0]) and torch.equal(fast[1], det[1])
        return fast[2]

    assert sched.family == "stream" and torch.equal(atomic_run(), det[2])
    # the wrapper too, on its checked first call and on its prepared fast path after it
    from csa_frontend import csa_compressor_backward_wrapper
    for _ in range(2):
        got = csa_compressor_backward_wrapper(kv, score, ape, cu, comp, grad_out, ratio=ratio, coff=coff,
                                              deterministic=False)
        assert torch.equal(got["grad_ape"], det[2]) and torch.equal(got["grad_kv"], det[0])
    monkeypatch.setattr(schedule, "STREAM_ATOMIC_MAX_GROUPS", 10 ** 6)
    torch.testing.assert_close(atomic_run(), det[2], rtol=1e-5, atol=1e-5 * det[2].abs().max().item())


# ---- long row walks: the cp.async row pipeline across segment boundaries ----

@pytest.fixture
def few_ctas(monkeypatch):
    """Aim every launch at one CTA per column tile, so each thread (window backward) or CTA
    (stream family) walks many rows: the next row's window is staged while this one is
    pooled, across empty and short segments, tails and padding rows."""
    for name in ("BWD_TARGET_CTAS", "STREAM_BWD_TARGET_THREADS", "STREAM_FWD_TARGET_THREADS", "STREAM_GRID_SMS",
                 "STREAM_FWD_GRID_SMS"):
        monkeypatch.setattr(schedule, name, 1)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (4, 1, 512), (3, 2, 65), (2, 2, 64)])
def test_window_rows_walked_per_thread(few_ctas, ratio, coff, head_dim):
    lengths = edge_lengths(ratio) * 6 + [0, ratio - 1]
    check_config(ratio, coff, head_dim, lengths, pad_rows=7, seed=ratio + head_dim)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (2, 1, 64), (3, 2, 65)])
def test_window_rows_past_the_row_cap(few_ctas, monkeypatch, ratio, coff, head_dim):
    """A slab budget of one slab: the grid stays at one row group, so each thread walks every
    row of its lane, past BWD_MAX_ROWS_PER_THREAD (the budget's branch of ``bwd_rows_per_thread``)."""
    monkeypatch.setattr(schedule, "BWD_SLAB_BYTES", 1)
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    per_pack = sum(n // ratio for n in edge_lengths(ratio))
    lengths = edge_lengths(ratio) * -(-(schedule.BWD_MAX_ROWS_PER_THREAD + 2) * sched.row_lanes // per_pack)
    lengths += [0, ratio - 1]
    n_rows = sum(n // ratio for n in lengths)
    assert schedule.bwd_rows_per_thread(n_rows, sched, None, schedule.slab_bytes(ratio, coff, head_dim)) > \
        schedule.BWD_MAX_ROWS_PER_THREAD
    check_config(ratio, coff, head_dim, lengths, pad_rows=3, seed=ratio * 3 + head_dim)


@pytest.mark.L1
@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 512), (4, 1, 128), (3, 2, 65), (1, 2, 64),
                                              (8, 2, 128)])
def test_window_rows_interleaved(monkeypatch, ctas, ratio, coff, head_dim):
    """The interleaved row walk (``bwd_interleaved``), forced on: a thread's rows ``row_groups *
    row_lanes`` apart, so its cursor leaves its segment at almost every step (searches across
    empty, short and tail-only segments) and the last steps run past the real rows."""
    monkeypatch.setattr(schedule, "BWD_TARGET_CTAS", ctas)
    monkeypatch.setattr(schedule, "WINDOW_BWD_INTERLEAVE", "1")
    lengths = (edge_lengths(ratio) + [0, 5 * ratio, ratio - 1 if ratio > 1 else 3]) * 4
    check_config(ratio, coff, head_dim, lengths, pad_rows=5, seed=ctas * 7 + ratio + head_dim)


@pytest.mark.L1
@pytest.mark.parametrize("ctas", [1, 3, 256])
@pytest.mark.parametrize("head_dim", [512, 520, 1024])
def test_wide_window_backward_for_long_launches(monkeypatch, ctas, head_dim):
    """The register window's 16-byte backward (``wide_rows_schedule``: r4 c1, vec 8) taken at any
    row count (``WINDOW_BWD_WIDE_MIN_ROWS`` = 1): exact contract over ragged packs with empty,
    short and tail segments, padding rows and tokens past the pack; with one and three CTAs the
    threads walk many rows (interleaved where the rule says so). head_dim 520: 65 column threads
    and 3 row lanes per CTA."""
    from csa_frontend.compressor.kernels import dispatch
    ratio, coff = 4, 1
    wide = schedule.wide_rows_schedule(ratio, coff, head_dim)
    assert wide is not None and wide.vec == 8 and wide != choose_schedule(ratio, coff, head_dim, "bwd")
    monkeypatch.setattr(schedule, "WINDOW_BWD_WIDE_MIN_ROWS", 1)
    monkeypatch.setattr(schedule, "BWD_TARGET_CTAS", ctas)
    lengths = (edge_lengths(ratio) + [0, 5 * ratio, ratio - 1]) * 4
    rows = sum(n // ratio for n in lengths)
    kernels = current_kernels("bwd", ratio, coff, head_dim)
    picked = dispatch.backward_for_rows(rows, *kernels, schedule.slab_bytes(ratio, coff, head_dim))
    assert picked[2] == wide
    check_config(ratio, coff, head_dim, lengths, pad_rows=5, seed=ctas + head_dim)


@pytest.mark.L1
def test_wide_window_backward_at_its_default_threshold():
    """A one-segment pack of exactly ``WINDOW_BWD_WIDE_MIN_ROWS`` rows takes the wide backward
    on the default planner (interleaved, 256 row groups) and meets the exact contract; one row
    fewer takes the default schedule."""
    from csa_frontend.compressor.kernels import dispatch
    ratio, coff, head_dim = 4, 1, 512
    rows = schedule.WINDOW_BWD_WIDE_MIN_ROWS
    kernels = current_kernels("bwd", ratio, coff, head_dim)
    slab = schedule.slab_bytes(ratio, coff, head_dim)
    _, _, sched, rpt = dispatch.backward_for_rows(rows, *kernels, slab)
    assert sched == schedule.wide_rows_schedule(ratio, coff, head_dim)
    assert schedule.bwd_interleaved(rows, 1, ratio, coff, head_dim, sched, rpt)
    assert dispatch.backward_for_rows(rows - 1, *kernels, slab)[2] == choose_schedule(ratio, coff, head_dim, "bwd")
    check_config(ratio, coff, head_dim, [rows * ratio + 3], pad_rows=2, seed=11)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(16, 2, 64), (128, 1, 128), (33, 2, 66), (8, 2, 65), (128, 2, 64)])
def test_stream_rows_walked_per_cta(few_ctas, online_forward_off, ratio, coff, head_dim):
    """Stream CTAs (the pipelined forward's too: the online forward is off) walking many rows."""
    check_stream_config(ratio, coff, head_dim, stream_edge_lengths(ratio) * 3, pad_rows=4, seed=ratio)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 1, 128), (16, 2, 256), (64, 1, 512), (200, 2, 192)])
def test_one_segment_stream_forward_gives_the_default_bits(online_forward_off, ratio, coff, head_dim):
    """A pack of one segment runs the pipelined stream forward compiled with the search
    (``compile_forward_one_segment``), which writes every row (padding too) with the same bits
    as the default stream forward (the one-round lookup) on the same pack. (The online forward
    of short windows has no one-segment twin; r16 c2 runs here with it off.)"""
    from csa_frontend.compressor.kernels import dispatch
    kernels = current_kernels("fwd", ratio, coff, head_dim)
    assert kernels.sched.family == "stream" and kernels.one_segment is not None
    cu, comp = offsets([300 * ratio + ratio // 2], ratio)
    kv, score, ape = random_inputs(int(cu[-1]) + 2, ratio, coff, head_dim)
    rows = int(comp[-1]) + 2
    assert kernels.serial is None or not takes_serial_forward(rows, head_dim, kernels.serial[1], "stream")
    outs = []
    for variant in (kernels, kernels._replace(one_segment=None)):
        out = torch.full((rows, head_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
        fn, args = dispatch.forward_call(*variant, kv, score, ape, cu, comp, out)
        assert (fn is kernels.one_segment[0]) is (variant.one_segment is not None)
        fn(*args)
        outs.append(out)
    assert not torch.isnan(outs[0]).any(), "the one-segment forward left rows unwritten"
    assert torch.equal(outs[0], outs[1])


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(100, 2, 128), (200, 1, 192), (17, 1, 256)])
def test_stream_forward_bits_do_not_depend_on_its_grid(monkeypatch, ratio, coff, head_dim):
    """The stream forward lays its wave over the device's SMs (``fwd_rows_per_cta``), which is
    sound only because no output element's arithmetic depends on the grid: the same bits on 1,
    7 and 128 SMs' worth of CTAs and on the device's own count."""
    cu, comp = offsets([37 * ratio + 5, 0, ratio - 1, ratio, 90 * ratio + 1], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim)
    assert choose_schedule(ratio, coff, head_dim, "fwd").family == "stream"
    rows = int(comp[-1])
    assert rows * head_dim > schedule.serial_forward_outputs("stream")  # not the serial forward
    outs = []
    for sms in (0, 1, 7, 128):
        monkeypatch.setattr(schedule, "STREAM_FWD_GRID_SMS", sms)
        outs.append(run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, rows))
    assert not torch.isnan(outs[0].float()).any()
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def guess_packs(ratio):
    """(segment lengths, tokens in kv, output rows) of packs that make the stream kernels'
    first-row guess (``STREAM_FWD_GUESS``, ``STREAM_BWD_GUESS``) right, wrong, or not taken:
    whole blocks (one segment or several, empty ones too); a launch of ``T / ratio`` rows whose
    segments have tails, so later segments' rows and the padding rows guess wrong; tokens past
    the pack; ragged rows, where no guess runs."""
    return {
        "whole": ([40 * ratio, 0, 25 * ratio, 70 * ratio], None, None),
        "one_segment": ([150 * ratio], None, None),
        "tails_in_whole_launch": ([40 * ratio + 3, 30 * ratio + ratio - 3, 0, 65 * ratio], None, 136),
        "tokens_past_the_pack": ([135 * ratio], 140 * ratio, 140),
        "ragged": ([37 * ratio + 5, 0, ratio - 1, ratio, 97 * ratio + 1], None, None),
    }


def pack_inputs(ratio, pack):
    """(cu_seqlens, cu_seqlens_comp, tokens in kv, output rows) of ``guess_packs(ratio)[pack]``."""
    lengths, n_tok, rows = guess_packs(ratio)[pack]
    cu, comp = offsets(lengths, ratio)
    return cu, comp, n_tok or int(cu[-1]), rows or int(comp[-1])


def with_and_without(monkeypatch, module, knob, run, values=(False, True)):
    """``run(walk)`` with ``module.knob`` off and on (``values``; each compiled afresh), for grids
    of one wave and of CTAs that walk many rows (``walk``, which ``run`` turns into the grid knobs)."""
    from csa_frontend.compressor.kernels import dispatch
    results = {}
    for on in (False, True):
        monkeypatch.setattr(module, knob, values[on])
        dispatch.clear_cache()
        for walk in (False, True):
            results[on, walk] = run(walk)
    dispatch.clear_cache()
    return results


def assert_same_bits(results):
    """Every tensor ``with_and_without`` returned with the knob on: fully written (no NaN left of
    the poison) and bit-identical to the one with it off, for both grids."""
    for walk in (False, True):
        for got, want in zip(results[True, walk], results[False, walk]):
            assert not torch.isnan(got.float()).any(), "elements left unwritten"
            assert torch.equal(got, want)


@pytest.mark.L1
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("pack", ["whole", "one_segment", "tails_in_whole_launch", "tokens_past_the_pack", "ragged"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(16, 2, 256), (128, 1, 128), (64, 2, 64), (33, 2, 130),
                                               (20, 1, 96)])
def test_guessed_first_rows_give_the_unguessed_bits(online_forward_off, monkeypatch, direction, pack, ratio, coff,
                                                     head_dim):
    """The stream kernels may request each CTA's first row at ``row * ratio`` before its lookup
    answers and again where the lookup disagrees; every output (padding rows included) and every
    gradient gets the same bits as without the guess, with CTAs that walk one row or many. (The
    online forward of short windows makes no guess: off here, r16 c2 runs the pipeline.)"""
    from csa_frontend.compressor.kernels import stream_bwd, stream_fwd
    assert choose_schedule(ratio, coff, head_dim, direction).family == "stream"
    cu, comp, n_tok, rows = pack_inputs(ratio, pack)
    assert (rows * ratio == n_tok) is (pack != "ragged")
    assert rows * head_dim > schedule.serial_forward_outputs("stream")  # not the serial forward
    kv, score, ape = random_inputs(n_tok, ratio, coff, head_dim)
    grad_out = torch.randn(rows, head_dim, device="cuda").to(torch.bfloat16)

    grid = {name: getattr(schedule, name) for name in ("STREAM_FWD_GRID_SMS", "STREAM_GRID_SMS")}

    def run(walk):
        for name, value in grid.items():  # 5 SMs' worth of CTAs: each walks many rows
            monkeypatch.setattr(schedule, name, 5 if walk else value)
        if direction == "fwd":
            return (run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, rows),)
        return run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)

    module, knob = (stream_fwd, "STREAM_FWD_GUESS") if direction == "fwd" else (stream_bwd, "STREAM_BWD_GUESS")
    assert_same_bits(with_and_without(monkeypatch, module, knob, run))


def padded_forward(ratio, coff, head_dim, real_rows, pad_rows, seed):
    """(out, fp32 reference, fp64 oracle, real rows) of a ragged pack of ``real_rows`` rows whose
    first segment starts at token 0 (its row 0 pools the padding rows' window too), launched
    with ``pad_rows`` padding rows."""
    half = real_rows // 2
    cu, comp = offsets([half * ratio + ratio - 1, 0, (real_rows - half) * ratio + 1], ratio)
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv, score, ape = random_inputs(int(cu[-1]) + 3, ratio, coff, head_dim, generator=g)
    total = int(comp[-1]) + pad_rows
    out = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, total)
    ref = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=total)
    oracle = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=total, mode="fp64")
    return out, ref, oracle, int(comp[-1])


def check_padded_forward(ratio, coff, head_dim, real_rows, seed, exact):
    """``padded_forward`` with as many padding rows as real ones: every element written, the
    padding rows bit-identical to the reference, and the rest under the forward's contract
    (``exact``: the register window's one bf16 step, else the stream family's count)."""
    out, ref, oracle, n_real = padded_forward(ratio, coff, head_dim, real_rows, real_rows, seed)
    assert not serial_launch(out.shape[0], ratio, coff, head_dim)
    assert not torch.isnan(out.float()).any(), "forward left elements unwritten"
    assert torch.equal(out[n_real:], ref[n_real:]), \
        f"seed {seed}: {(out[n_real:] != ref[n_real:]).sum().item()} padding-row elements differ from the reference"
    if exact:
        assert_within_one_step(out, ref)
        assert_oracle_parity("out", out, ref, oracle)
    else:
        assert_contract("out", out, ref, oracle)


@pytest.mark.L1
@pytest.mark.parametrize("walk", [False, True])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (3, 1, 65), (16, 2, 256), (12, 1, 64),
                                               (128, 2, 512), (128, 1, 128), (33, 2, 130), (200, 1, 64)])
def test_padding_rows_carry_the_reference_bits(monkeypatch, walk, ratio, coff, head_dim):
    """Every padding row pools the same window (segment 0's first block), so a column the fast
    arithmetic rounds one bf16 step off would be off on all of them and multiply past the
    contract's count (GPU fuzz seed 20163). Each forward family computes padding rows in the
    reference's steps (``EXACT_PADDING_ROWS``): bit-identical to the reference, on launches past
    the serial forward's reach with as many padding rows as real ones, on the default grid and
    with stream CTAs that walk many rows (contiguous and interleaved runs). Several seeds: one
    launch has one padding window, whose fast result is off somewhere in only a few percent of
    launches, so one seed alone would rarely tell the fast path from the exact one."""
    fwd = choose_schedule(ratio, coff, head_dim, "fwd")
    real_rows = -(-(schedule.serial_forward_outputs(fwd.family) + 1) // (2 * head_dim)) + 8
    if walk:
        monkeypatch.setattr(schedule, "STREAM_FWD_GRID_SMS", 3)
    for seed in range(PADDING_SEEDS):
        check_padded_forward(ratio, coff, head_dim, real_rows, seed, exact=fwd.family == "window")


#: launches (seeds) per configuration of the padding-row tests
PADDING_SEEDS = 6


@pytest.mark.L1
@pytest.mark.parametrize("pack", ["whole", "ragged"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 2, 512), (128, 1, 128), (16, 2, 256)])
def test_clustered_stream_backward_gives_the_unclustered_bits(monkeypatch, pack, ratio, coff, head_dim):
    """The stream backward's column tiles launch in thread-block clusters of two
    (``STREAM_BWD_COLUMN_CLUSTER``, a launch attribute): every gradient, grad_ape included, gets
    the bits of the launch without clusters, on the default grid (short packs: the few-rows
    schedule) and with CTAs that walk many rows."""
    from csa_frontend.compressor.kernels import dispatch
    arch = dispatch.arch_of(torch.device("cuda", torch.cuda.current_device()))
    if not schedule.sm90_or_later(arch):
        pytest.skip(f"{arch} launches no clusters")
    monkeypatch.setattr(schedule, "STREAM_BWD_COLUMN_CLUSTER", 2)
    assert schedule.bwd_column_cluster(choose_schedule(ratio, coff, head_dim, "bwd"), arch) == 2
    cu, comp, n_tok, rows = pack_inputs(ratio, pack)
    kv, score, ape = random_inputs(n_tok, ratio, coff, head_dim)
    grad_out = torch.randn(rows, head_dim, device="cuda").to(torch.bfloat16)
    sms = schedule.STREAM_GRID_SMS

    def run(walk):
        monkeypatch.setattr(schedule, "STREAM_GRID_SMS", 5 if walk else sms)  # 5 SMs' worth: long walks
        return run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)

    assert_same_bits(with_and_without(monkeypatch, schedule, "STREAM_BWD_COLUMN_CLUSTER", run, values=(1, 2)))


@pytest.mark.L1
@pytest.mark.parametrize("pack", ["whole", "one_segment", "tails_in_whole_launch", "tokens_past_the_pack", "ragged"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 1, 128), (20, 1, 96), (64, 1, 512), (16, 2, 256), (33, 2, 130)])
def test_interleaved_stream_forward_walk_gives_the_contiguous_bits(online_forward_off, monkeypatch, pack, ratio, coff,
                                                                   head_dim):
    """The stream forward's CTAs may walk rows the grid's row CTAs apart instead of in one run
    (``STREAM_FWD_INTERLEAVE``, forced here onto every launch and coff): each row is still pooled
    whole by one CTA, so every output (padding rows included) has the same bits either way, on a
    one-wave grid and on 5 SMs' worth of CTAs that walk many rows. (The pipelined forward: the
    online forward of short windows, which walks no rows, is off here.)"""
    assert choose_schedule(ratio, coff, head_dim, "fwd").family == "stream"
    cu, comp, n_tok, rows = pack_inputs(ratio, pack)
    kv, score, ape = random_inputs(n_tok, ratio, coff, head_dim)
    assert not serial_launch(rows, ratio, coff, head_dim)
    sms = schedule.STREAM_FWD_GRID_SMS

    def run(walk):
        monkeypatch.setattr(schedule, "STREAM_FWD_GRID_SMS", 5 if walk else sms)
        return (run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, rows),)

    assert_same_bits(with_and_without(monkeypatch, schedule, "STREAM_FWD_INTERLEAVE", run, ("0", "1")))


@pytest.mark.L1
def test_stream_forward_interleaves_at_its_default_rule(monkeypatch):
    """A SPEC-sized coff-1 stream forward (r128 c1 d128, two segments, 140800 tokens) takes the
    interleaved walk on the default planner and gives the contiguous walk's bits (the grid is
    the default one either time: ``run`` ignores ``walk``)."""
    ratio, coff, head_dim = 128, 1, 128
    cu, comp = offsets([550 * ratio + 77, 550 * ratio - 77], ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim)
    rows = int(comp[-1])
    entry = current_kernels("fwd", ratio, coff, head_dim)
    rpc = schedule.fwd_rows_per_cta(rows, entry.sched, entry.per_sm, entry.sms)
    assert schedule.fwd_interleaved(rows, 2, coff, rpc)

    def run(walk):
        return (run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, rows),)

    assert_same_bits(with_and_without(monkeypatch, schedule, "STREAM_FWD_INTERLEAVE", run, ("0", "auto")))


@pytest.mark.L1
@pytest.mark.parametrize("pack", ["whole", "tails_in_whole_launch", "tokens_past_the_pack", "ragged"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(128, 1, 128), (20, 1, 96), (64, 1, 512), (16, 2, 256), (33, 2, 130)])
def test_interleaved_stream_backward_walk_gives_the_contiguous_gradients(monkeypatch, pack, ratio, coff, head_dim):
    """The stream backward's CTAs may walk rows ``row_groups`` apart instead of in one run
    (``STREAM_BWD_INTERLEAVE``): grad_kv and grad_score (zero-filled slots included) get the same
    bits either way; grad_ape sums the same values grouped by other CTAs, so it agrees to
    rounding and is bitwise reproducible."""
    from csa_frontend.compressor.kernels import dispatch
    assert choose_schedule(ratio, coff, head_dim, "bwd").family == "stream"
    cu, comp, n_tok, rows = pack_inputs(ratio, pack)
    kv, score, ape = random_inputs(n_tok, ratio, coff, head_dim)
    grad_out = torch.randn(rows, head_dim, device="cuda").to(torch.bfloat16)
    sms = schedule.STREAM_GRID_SMS
    results = {}
    for walk in ("0", "1"):
        monkeypatch.setattr(schedule, "STREAM_BWD_INTERLEAVE", walk)
        dispatch.clear_cache()
        for few_ctas in (False, True):  # 5 SMs' worth of CTAs: each walks many rows
            monkeypatch.setattr(schedule, "STREAM_GRID_SMS", 5 if few_ctas else sms)
            results[walk, few_ctas] = [run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)
                                       for _ in range(2)]
    dispatch.clear_cache()
    for few_ctas in (False, True):
        (gkv, gs, gape), again = results["1", few_ctas]
        want_kv, want_s, want_ape = results["0", few_ctas][0]
        for got in (gkv, gs, gape):
            assert not torch.isnan(got.float()).any(), "elements left unwritten"
        assert torch.equal(gkv, want_kv) and torch.equal(gs, want_s)
        assert all(torch.equal(a, b) for a, b in zip((gkv, gs, gape), again))
        torch.testing.assert_close(gape, want_ape, rtol=1e-5, atol=1e-5)


def _walked_backward_matches_the_contiguous_plan(monkeypatch, ratio, coff, head_dim, lengths):
    """The stream contract against the reference on the default planner, then the gradients of
    the plan of before session 57 (no coff-2 walk, the full grid): grad_kv and grad_score bit for
    bit, grad_ape to rounding (its slabs group the rows otherwise)."""
    from csa_frontend.compressor.kernels import dispatch
    cu, comp = offsets(lengths, ratio)
    rows = int(comp[-1])
    check_pack(ratio, coff, head_dim, lengths, pad_rows=0, seed=57, extra_tokens=3, fwd_exact=False,
               bwd_exact=False)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim)
    grad_out = torch.randn(rows, head_dim, device="cuda").to(torch.bfloat16)
    got = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)
    monkeypatch.setattr(schedule, "STREAM_BWD_WALK_COFFS", (1,))
    monkeypatch.setattr(schedule, "STREAM_BWD_LONG_GRID_SMS", 0)
    dispatch.clear_cache()
    try:
        want = run_backward(kv, score, ape, cu, comp, grad_out, ratio, coff, head_dim)
    finally:
        monkeypatch.undo()
        dispatch.clear_cache()
    for grads in (got, want):
        for name, g in zip(("grad_kv", "grad_score", "grad_ape"), grads):
            assert not torch.isnan(g.float()).any(), f"{name}: elements left unwritten"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5 * want[2].abs().max().item())


def _default_stream_backward(ratio, coff, head_dim, rows):
    """The default planner's kernels for ``rows`` rows, with its rows per CTA."""
    from csa_frontend.compressor.kernels import dispatch
    entry = current_kernels("bwd", ratio, coff, head_dim)
    assert entry.sched.family == "stream"
    _, _, sched, rpt = dispatch.backward_for_rows(rows, *entry, schedule.slab_bytes(ratio, coff, head_dim))
    assert sched == entry.sched  # the default kernels, not the row-count bucket's
    return entry, rpt


@pytest.mark.L1
@pytest.mark.parametrize("long_grid_sms", [0, 112])
def test_long_coff2_stream_backward_plan(monkeypatch, long_grid_sms):
    """A long two-segment r128 c2 d256 pack: its stream backward walks interleaved, on the full
    grid by default (session 60) or on the narrower long-launch grid that
    CSA_FRONTEND_STREAM_BWD_LONG_GRID_SMS=112 asks for (session 57's default, the H100's best),
    and gives the contiguous plan's gradients either way."""
    monkeypatch.setattr(schedule, "STREAM_BWD_LONG_GRID_SMS", long_grid_sms)
    ratio, coff, head_dim = 128, 2, 256
    lengths = [150 * ratio + 77, 150 * ratio - 77]
    rows = int(offsets(lengths, ratio)[1][-1])
    entry, rpt = _default_stream_backward(ratio, coff, head_dim, rows)
    full = schedule.stream_row_ctas(entry.sched, "bwd", entry.per_sm)
    narrowed = schedule.stream_bwd_row_ctas(rows, entry.sched, entry.per_sm) < full
    assert narrowed == bool(long_grid_sms)
    assert schedule.bwd_interleaved(rows, 2, ratio, coff, head_dim, entry.sched, rpt)
    _walked_backward_matches_the_contiguous_plan(monkeypatch, ratio, coff, head_dim, lengths)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,head_dim,threads", [(17, 256, 160), (37, 128, 320), (15, 256, 256)])
def test_narrow_coff2_stream_backward_walks_by_default(monkeypatch, ratio, head_dim, threads):
    """Coff-2 stream backwards of CTAs narrower than 384 threads walk interleaved too (sessions
    58-59) and give the contiguous plan's gradients: two segments of about 12 rows per row CTA."""
    coff = 2
    entry = current_kernels("bwd", ratio, coff, head_dim)
    assert entry.sched.threads == threads
    rows = 12 * schedule.stream_row_ctas(entry.sched, "bwd", entry.per_sm)
    lengths = [(rows // 2) * ratio + 5, (rows - rows // 2) * ratio - 3]
    rows = int(offsets(lengths, ratio)[1][-1])
    entry, rpt = _default_stream_backward(ratio, coff, head_dim, rows)
    assert schedule.bwd_interleaved(rows, 2, ratio, coff, head_dim, entry.sched, rpt)
    _walked_backward_matches_the_contiguous_plan(monkeypatch, ratio, coff, head_dim, lengths)


# ---- the bulk-copy forward (window_fwd_bulk): producer warp, mbarrier ring, chained blocks ----

@pytest.fixture
def bulk_forward(monkeypatch):
    """Every register-window forward with 16-byte token rows takes the bulk-copy kernel, whatever
    its ratio, coff, head_dim or row count (the planner's thresholds there are measured speed, not
    semantics). Yields the schedule module, for tests that also shrink the grid."""
    from csa_frontend.compressor.kernels import dispatch, schedule
    monkeypatch.setattr(schedule, "WINDOW_FWD_BULK_MIN_STAGES", 1)
    monkeypatch.setattr(schedule, "WINDOW_FWD_BULK_MIN_HEAD_DIM", 0)
    monkeypatch.setattr(schedule, "WINDOW_FWD_BULK_COFFS", (1, 2))
    monkeypatch.setattr(schedule, "WINDOW_FWD_BULK_RATIOS", range(1, 257))
    schedule.bulk_forward_schedule.cache_clear()
    dispatch.clear_cache()
    yield schedule
    schedule.bulk_forward_schedule.cache_clear()
    dispatch.clear_cache()


def ran_bulk_forward(ratio, coff, head_dim):
    from csa_frontend.compressor.kernels import dispatch
    return any(k[0] == "fwd" and k[2:5] == (ratio, coff, head_dim) and k[5].stages
               for k in dispatch.cache_keys())


def bulk_matrix_cases():
    """ratio {1, 2, 3, 4, 8} x coff {1, 2} x head_dim {64, 128, 512} where the forward is of the
    register-window family (r8 c2 streams its 16 positions)."""
    from csa_frontend.compressor.kernels.schedule import choose_schedule
    return [(r, c, d) for r in (1, 2, 3, 4, 8) for c in (1, 2) for d in (64, 128, 512)
            if choose_schedule(r, c, d, "fwd").family == "window"]


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", bulk_matrix_cases())
def test_bulk_forward_matrix(bulk_forward, ratio, coff, head_dim):
    check_config(ratio, coff, head_dim, edge_lengths(ratio), pad_rows=3, seed=ratio * 10 + coff + head_dim)
    assert ran_bulk_forward(ratio, coff, head_dim)


@pytest.mark.L1
@pytest.mark.parametrize("ctas", [1, 3])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 2, 64), (1, 2, 512), (4, 1, 128)])
def test_bulk_forward_long_walks(bulk_forward, monkeypatch, ctas, ratio, coff, head_dim):
    """One or three CTAs walk every stage: the ring wraps many times (full and empty barrier
    phases), a stage's first row takes its previous block from the stage before, the segment
    cursor crosses empty, short and tail-only segments, and the last CTA gets a shorter run."""
    monkeypatch.setattr(bulk_forward, "WINDOW_FWD_BULK_CTAS", ctas)
    lengths = (edge_lengths(ratio) + [0, 2 * ratio, ratio - 1 if ratio > 1 else 3]) * 9
    check_config(ratio, coff, head_dim, lengths, pad_rows=9, seed=ctas + ratio + head_dim)
    assert ran_bulk_forward(ratio, coff, head_dim)


@pytest.mark.L1
def test_bulk_forward_only_padding_rows_in_a_cta(bulk_forward, monkeypatch):
    """More padding rows than real ones: whole CTAs hold nothing but padding rows (segment 0's
    first block), one CTA holds both."""
    monkeypatch.setattr(bulk_forward, "WINDOW_FWD_BULK_CTAS", 8)
    check_config(4, 2, 512, [17, 0, 9], pad_rows=40, seed=3)
    assert ran_bulk_forward(4, 2, 512)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(2, 2, 512), (4, 1, 128)])
def test_bulk_forward_padding_rows_carry_the_reference_bits(bulk_forward, monkeypatch, ratio, coff, head_dim):
    """``test_padding_rows_carry_the_reference_bits`` for the bulk-copy forward, three CTAs
    walking every stage."""
    monkeypatch.setattr(bulk_forward, "WINDOW_FWD_BULK_CTAS", 3)
    for seed in range(PADDING_SEEDS):
        check_padded_forward(ratio, coff, head_dim, 40, seed, exact=True)
        assert ran_bulk_forward(ratio, coff, head_dim)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (2, 1, 128)])
def test_bulk_forward_cancelling_windows(bulk_forward, ratio, coff, head_dim):
    check_cancelling_forward(ratio, coff, head_dim, [4096 + 3, 0, 2 * ratio, 1000], seed=5)
    assert ran_bulk_forward(ratio, coff, head_dim)


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (1, 2, 512)])
def test_bulk_forward_back_to_back(bulk_forward, ratio, coff, head_dim):
    check_back_to_back(ratio, coff, head_dim)
    assert ran_bulk_forward(ratio, coff, head_dim)


@pytest.mark.L1
def test_bulk_forward_by_default_on_long_packs():
    """With the planner's own thresholds a long ratio-2 coff-2 head_dim-512 pack takes the
    bulk-copy forward on sm_90+, and a short one the per-thread forward; both match the reference."""
    from csa_frontend.compressor.kernels import dispatch, schedule
    if schedule.bulk_forward_schedule(2, 2, 512, dispatch.arch_of(torch.device("cuda"))) is None:
        pytest.skip("no bulk-copy forward on this GPU or with these knobs")
    check_config(2, 2, 512, [20000, 5, 3001], pad_rows=2, seed=5)
    assert ran_bulk_forward(2, 2, 512)
    rows = (20000 + 3001) // 2 + 2
    bulk = schedule.bulk_forward_schedule(2, 2, 512, dispatch.arch_of(torch.device("cuda")))
    assert schedule.bulk_forward_walk(rows, bulk) > 0 and schedule.bulk_forward_walk(2048, bulk) == 0


# ---- serial forward (small launches, every family): the reference's bits ----

def serial_pack(ratio, coff, head_dim, seed):
    """A pack of segments of 0, ratio-1, ratio, ratio+1 and longer lengths, plus padding rows,
    whose output has exactly ``serial_forward_outputs`` elements of the configuration's forward
    family or as close below as rows allow: the largest launch the serial forward takes."""
    rows = schedule.serial_forward_outputs(choose_schedule(ratio, coff, head_dim, "fwd").family) // head_dim
    lengths = []
    for n in (ratio + 1, 0, ratio - 1, ratio, 3 * ratio + 5):
        if sum(m // ratio for m in lengths) + n // ratio < rows:
            lengths.append(n)
    real = sum(n // ratio for n in lengths)
    lengths.append((rows - real) // 2 * ratio + ratio // 2)  # the rest: half rows, half padding
    real = sum(n // ratio for n in lengths)
    assert 0 < real <= rows
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu, comp = offsets(lengths, ratio)
    kv, score, ape = random_inputs(int(cu[-1]), ratio, coff, head_dim, generator=g)
    return kv, score, ape, cu, comp, rows


@pytest.fixture(params=["lean", "classic"])
def serial_variant(request, monkeypatch):
    """Both serial forwards (``schedule.SERIAL_FWD_LEAN``): the one the knob does not select is
    built into empty compile caches for the test (the knob is not part of the cache key)."""
    from csa_frontend.compressor.kernels import dispatch, serial_fwd
    lean = request.param == "lean"
    if lean != serial_fwd.SERIAL_FWD_LEAN:
        import collections

        monkeypatch.setattr(serial_fwd, "SERIAL_FWD_LEAN", lean)
        monkeypatch.setattr(dispatch, "_cache", collections.OrderedDict())
        monkeypatch.setattr(dispatch, "_by_device", {})
    return request.param


@pytest.mark.L1
@pytest.mark.parametrize("head_dim", [63, 64, 192, 512])
@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("ratio", [1, 4, 16, 128, 200, 256])
def test_serial_forward_has_reference_bits(ratio, coff, head_dim, serial_variant):
    """Launches of up to ``serial_forward_outputs`` elements run the serial forward: ``out`` equal to
    the reference bit for bit (padding rows included), at the largest such launch."""
    kv, score, ape, cu, comp, rows = serial_pack(ratio, coff, head_dim, seed=ratio * 3 + coff)
    assert serial_launch(rows, ratio, coff, head_dim)
    out = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, rows)
    ref = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=rows)
    assert torch.equal(out, ref), f"{(out != ref).sum().item()} of {out.numel()} elements differ"


def lengths_blocks(cu, ratio):
    """Blocks of the pack's last segment."""
    return (int(cu[-1]) - int(cu[-2])) // ratio


@pytest.mark.L1
@pytest.mark.parametrize("case", ["cancelling", "spread x40", "kv x1e35", "kv x1e-38", "non-finite"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 64), (128, 2, 64), (33, 1, 65)])
def test_serial_forward_extreme_inputs(ratio, coff, head_dim, case, serial_variant):
    """The serial forward on inputs where rounding and special values matter: cancelling sums,
    exponentials down to the subnormal range and zero, products near bf16's range ends, and a
    NaN score, an infinite score and an infinite kv (NaN where the reference has NaN, the
    reference's bits elsewhere)."""
    kv, score, ape, cu, comp, rows = serial_pack(ratio, coff, head_dim, seed=7)
    if case == "cancelling":
        cancel_windows(kv, score, ape, cu, comp, ratio, coff, head_dim)
    elif case == "spread x40":
        score, ape = (score.float() * 40).to(torch.bfloat16), ape * 40
    elif case.startswith("kv x"):
        kv = (kv.float() * float(case[4:])).to(torch.bfloat16)
    else:
        assert lengths_blocks(cu, ratio) >= 4, "the last segment needs 4 blocks for the special values"
        first = int(cu[-2]) + 1  # the last segment's first block (every block of it is consumed)
        own = (coff - 1) * head_dim  # first column of the own half
        score[first, 0] = float("nan")
        score[first + ratio, own + 1] = float("inf")
        kv[first + 2 * ratio, 2] = float("-inf")
    out = run_forward(kv, score, ape, cu, comp, ratio, coff, head_dim, rows)
    ref = reference_forward(kv, score, ape, cu, comp, ratio, coff, total_comp=rows)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], ref[~nan]), f"{(out[~nan] != ref[~nan]).sum().item()} elements differ"
    if case == "non-finite":
        assert nan.any()


def ragged_window_backward_case(ratio, coff, head_dim, ctas, seed):
    """(kv, score, ape, cu, comp, grad_out, rows) of a ragged pack (empty, short and tail
    segments, tokens past the pack, padding rows) long enough that every thread of a
    ``ctas``-CTA window backward walks at least 4 rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_copy = edge_lengths(ratio) + [0, 5 * ratio, max(ratio - 1, 1)]
    lanes = choose_schedule(ratio, coff, head_dim, "bwd").row_lanes
    lengths = per_copy * (1 + 4 * ctas * lanes // sum(n // ratio for n in per_copy))
    cu, comp = offsets(lengths, ratio)
    kv, score, ape = random_inputs(int(cu[-1]) + 3, ratio, coff, head_dim, generator=g)
    total = int(comp[-1]) + 5
    grad_out = torch.randn(total, head_dim, device="cuda", generator=g).to(torch.bfloat16)
    return kv, score, ape, cu, comp, grad_out, total


def run_backward_every_element(case, ratio, coff, head_dim, deterministic=True):
    """[grad_kv, grad_score, grad_ape] of ``kernels.backward`` on a case of
    ``ragged_window_backward_case``, into NaN-filled buffers, each element checked written."""
    kv, score, ape, cu, comp, grad_out, _ = case
    got = [torch.full_like(t, float("nan")) for t in (kv, score, ape)]
    kernels.backward(kv, score, ape, cu, comp, grad_out, *got, ratio=ratio, coff=coff, head_dim=head_dim,
                     deterministic=deterministic)
    for name, t in zip(("grad_kv", "grad_score", "grad_ape"), got):
        assert not torch.isnan(t).any(), f"{name}: elements left unwritten"
    return got


# ---- row stealing (WINDOW_BWD_STEAL): warps take the back rows of slower warps' runs ----

@pytest.fixture
def stealing(monkeypatch):
    """Sets row stealing for the rest of a test: ``stealing(rows, probe_us)`` (planner and compile
    caches emptied at each change and at the end, so no schedule leaks either way)."""
    from csa_frontend.compressor.kernels import dispatch
    from csa_testing import forget_plans

    def set_stealing(rows, probe_us=0):
        forget_plans()
        monkeypatch.setattr(schedule, "WINDOW_BWD_STEAL", rows)
        monkeypatch.setattr(window_bwd, "WINDOW_BWD_STEAL_PROBE_US", probe_us)
        monkeypatch.setattr(dispatch, "_steal_work", {})

    yield set_stealing
    forget_plans()


@pytest.mark.L1
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("ctas", [3, 16])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 512), (4, 2, 128), (2, 2, 64), (3, 1, 64),
                                              (1, 2, 16)])
def test_window_backward_row_stealing(stealing, monkeypatch, deterministic, ctas, ratio, coff, head_dim):
    """Row stealing with CTA 0 held back 40 us after its first claims, so that other warps take
    its back rows (counted: at least one steal): grad_kv and grad_score carry the static walk's
    bits, and so does grad_ape on the deterministic path, where the owner adds the stolen rows'
    contributions in row order; the atomic path's grad_ape agrees to fp32 rounding. Ragged packs
    with empty, short and tail segments, padding rows and tokens past the pack; contiguous
    (3 CTAs) and interleaved (16, where the rule takes it) walks."""
    from csa_frontend.compressor.kernels import dispatch
    monkeypatch.setattr(schedule, "BWD_TARGET_CTAS", ctas)
    case = ragged_window_backward_case(ratio, coff, head_dim, ctas, seed=ratio * 100 + head_dim + ctas)
    kv, score, ape, cu, comp, grad_out, total = case

    def run(det):
        return run_backward_every_element(case, ratio, coff, head_dim, deterministic=det)

    stealing(0)
    want = run(True)
    stealing(2, probe_us=40)
    sched = choose_schedule(ratio, coff, head_dim, "bwd")
    assert sched.family == "window" and sched.steal == 2
    rows = schedule.bwd_rows_per_thread(total, sched, None, schedule.slab_bytes(ratio, coff, head_dim))
    assert rows >= 3, f"runs of {rows} rows leave nothing to steal"
    got = run(deterministic)
    work = dispatch._steal_work[torch.cuda.current_device()]
    assert int(work[-1]) > 0, "no row was stolen"
    assert not work[:-1].any(), "the launch left claim words or flags set"
    assert torch.equal(got[0], want[0]), f"grad_kv differs in {(got[0] != want[0]).sum().item()} elements"
    assert torch.equal(got[1], want[1]), f"grad_score differs in {(got[1] != want[1]).sum().item()} elements"
    if deterministic:
        assert torch.equal(got[2], want[2]), f"grad_ape differs in {(got[2] != want[2]).sum().item()} elements"
    else:
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5 * want[2].abs().max().item())
    rkv, rs, rape = reference_backward(kv, score, ape, cu, comp, grad_out, ratio, coff)
    assert torch.equal(got[0], rkv) and torch.equal(got[1], rs)
    torch.testing.assert_close(got[2], rape, rtol=1e-5, atol=1e-5 * rape.abs().max().item())
    # and again: the workspace the first launch left zeroed serves the next one
    again = run(deterministic)
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])
    if deterministic:
        assert torch.equal(again[2], want[2])


# ---- L2 prefetch ahead (WINDOW_BWD_L2_AHEAD): a hint, so the bits of the default kernel ----

@pytest.mark.L1
@pytest.mark.parametrize("ahead", [2, 5])
@pytest.mark.parametrize("ctas", [3, 16])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 512), (4, 1, 512), (4, 2, 128), (3, 1, 64), (1, 2, 16)])
def test_window_backward_l2_prefetch_ahead(monkeypatch, ahead, ctas, ratio, coff, head_dim):
    """The backward with per-step L2 prefetches ``ahead`` steps ahead gives the default kernel's
    bits, and the reference's, on ragged packs (empty, short and tail segments, so prefetched
    rows cross segments and the pack's ends), with tokens past the pack and padding rows;
    contiguous (3 CTAs) and interleaved (16) walks."""
    from csa_testing import forget_plans
    monkeypatch.setattr(schedule, "BWD_TARGET_CTAS", ctas)
    case = ragged_window_backward_case(ratio, coff, head_dim, ctas, seed=ratio * 100 + head_dim + ctas + ahead)
    kv, score, ape, cu, comp, grad_out, _ = case

    def run(distance):
        forget_plans()
        monkeypatch.setattr(window_bwd, "WINDOW_BWD_L2_AHEAD", distance)
        return run_backward_every_element(case, ratio, coff, head_dim)

    try:
        want = run(0)
        got = run(ahead)
    finally:
        forget_plans()
    for name, a, b in zip(("grad_kv", "grad_score", "grad_ape"), got, want):
        assert torch.equal(a, b), f"{name} differs in {(a != b).sum().item()} elements"
    rkv, rs, rape = reference_backward(kv, score, ape, cu, comp, grad_out, ratio, coff)
    assert torch.equal(got[0], rkv) and torch.equal(got[1], rs)
    torch.testing.assert_close(got[2], rape, rtol=1e-5, atol=1e-5 * rape.abs().max().item())
