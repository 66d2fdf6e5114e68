"""The operator API on CUDA tensors: classes, wrappers, streams, on-device validation, CUDA graphs
and ``csa_compress``, against the fp32 reference run on the same GPU (kernel-level numerics live
in ``test/python/gpu``). A configuration the fused kernels do not serve must be refused by
``check_support`` with a RuntimeError; such cases assert that and skip."""
import pytest
import torch

from csa_frontend import (CSACompressorBackward, CSACompressorForward, csa_compress,
                          csa_compressor_backward_wrapper, csa_compressor_forward_wrapper)
from csa_frontend.compressor.reference import reference_backward, reference_forward
from csa_testing import BF16_STEP, make_kind, make_pack, max_abs_err

pytestmark = pytest.mark.gpu


def _supported_or_skip(pack):
    """Plan the forward; a refused configuration must say why, then the test skips."""
    out = torch.empty(pack.total_comp, pack.head_dim, dtype=torch.bfloat16, device="cuda")
    op = CSACompressorForward(*pack.inputs, out, ratio=pack.ratio, coff=pack.coff)
    try:
        op.check_support()
    except RuntimeError as err:
        assert "no fused kernel" in str(err)
        pytest.skip(str(err))
    return op


def _assert_matches_reference(pack, out, grads):
    ref = reference_forward(*pack.inputs, pack.ratio, pack.coff, pack.total_comp)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= BF16_STEP * ref.float().abs()).all()), "out beyond one bf16 step"
    ref_grads = reference_backward(*pack.inputs, pack.grad_out, pack.ratio, pack.coff)
    oracle = reference_backward(*pack.inputs, pack.grad_out, pack.ratio, pack.coff, mode="fp64")
    for name, got, want, exact in zip(("grad_kv", "grad_score"), grads, ref_grads, oracle):
        assert max_abs_err(got, exact) <= max_abs_err(want, exact) * (1 + 1e-6) + 1e-4, name
        assert int((got != want).sum()) <= max(1, got.numel() // 1000), name
    torch.testing.assert_close(grads[2], ref_grads[2], rtol=1e-5, atol=1e-5 * float(ref_grads[2].abs().max()))


@pytest.mark.L0
@pytest.mark.parametrize("ratio,coff,head_dim,kind", [(4, 2, 128, "ragged"), (4, 1, 64, "padding"),
                                                      (3, 2, 65, "short"), (128, 2, 128, "empty"),
                                                      (16, 2, 256, "padding")])
def test_class_and_wrapper_on_cuda(ratio, coff, head_dim, kind):
    pack = make_kind(kind, ratio, coff, head_dim, seed=ratio, device="cuda")
    fwd = _supported_or_skip(pack)
    fwd.compile()
    out = torch.full((pack.total_comp, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    fwd.execute(*pack.inputs, out)
    grads = [torch.full_like(t, float("nan")) for t in (pack.kv, pack.score, pack.ape)]
    bwd = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, ratio=ratio, coff=coff)
    bwd.compile()
    bwd.execute(*pack.inputs, pack.grad_out, *grads)
    _assert_matches_reference(pack, out, grads)

    wrapped = csa_compressor_forward_wrapper(*pack.inputs, ratio=ratio, coff=coff, total_comp=pack.total_comp)
    assert torch.equal(wrapped["out"], out)
    for got, want in zip(csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=ratio, coff=coff), grads):
        assert torch.equal(got, want)


@pytest.mark.L0
def test_side_stream_and_meta_planning():
    pack = make_pack([300, 0, 77, 1024], 4, 2, 128, extra_rows=2, device="cuda")
    _supported_or_skip(pack)
    out = torch.empty(pack.total_comp, 128, dtype=torch.bfloat16, device="cuda")
    meta = [t.to("meta") for t in (*pack.inputs, out)]
    op = CSACompressorForward(*meta, ratio=4, coff=2)  # plans for the current CUDA device
    op.compile()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    op.execute(*pack.inputs, out, current_stream=side)
    torch.cuda.current_stream().wait_stream(side)
    expected = csa_compressor_forward_wrapper(*pack.inputs, ratio=4, total_comp=pack.total_comp)["out"]
    assert torch.equal(out, expected)


@pytest.mark.L0
def test_validate_checks_offsets_on_device(monkeypatch):
    pack = make_pack([9, 6, 13], 4, 2, 64, device="cuda")
    _supported_or_skip(pack)
    bad = pack.cu_seqlens_comp.clone()
    bad[2] += 1
    args = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, bad)
    with pytest.raises(ValueError, match=r"cu_seqlens_comp: expected cu_seqlens_comp\[2\] == 3"):
        csa_compressor_forward_wrapper(*args, ratio=4, total_comp=pack.total_comp + 1, validate=True)
    monkeypatch.setenv("CSA_FRONTEND_VALIDATE", "1")
    with pytest.raises(ValueError, match="cu_seqlens_comp"):
        csa_compressor_forward_wrapper(*args, ratio=4, total_comp=pack.total_comp + 1)


@pytest.mark.L0
def test_mixed_devices_are_rejected():
    pack = make_pack([9, 6], 4, 2, 64, device="cuda")
    with pytest.raises(ValueError, match=r"ape: expected device cuda:\d \(the device of kv\), got cpu"):
        csa_compressor_forward_wrapper(pack.kv, pack.score, pack.ape.cpu(), pack.cu_seqlens, pack.cu_seqlens_comp)


@pytest.mark.L0
def test_csa_compress_autograd_on_cuda():
    pack = make_pack([517, 1000, 33], 4, 2, 128, extra_rows=1, device="cuda")
    _supported_or_skip(pack)
    leaves = [t.clone().requires_grad_() for t in (pack.kv, pack.score, pack.ape)]
    out = csa_compress(*leaves, pack.cu_seqlens, pack.cu_seqlens_comp, total_comp=pack.total_comp)
    (out.float() * pack.grad_out.float()).sum().backward()
    grads = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4)
    for leaf, want in zip(leaves, grads):
        assert torch.equal(leaf.grad, want)


@pytest.mark.L1
def test_wrappers_capture_in_a_cuda_graph():
    pack = make_pack([300, 77, 1024], 4, 2, 128, extra_rows=3, device="cuda")
    _supported_or_skip(pack)
    expected = csa_compressor_forward_wrapper(*pack.inputs, ratio=4, total_comp=pack.total_comp)["out"]  # warm-up
    csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = csa_compressor_forward_wrapper(*pack.inputs, ratio=4, total_comp=pack.total_comp)["out"]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.L1
def test_compile_under_capture_is_a_clear_error():
    pack = make_pack([50], 5, 1, 96, device="cuda")
    _supported_or_skip(pack)
    out = torch.empty(pack.total_comp, 96, dtype=torch.bfloat16, device="cuda")
    op = CSACompressorForward(*pack.inputs, out, ratio=5, coff=1)
    op.check_support()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph):
            op.compile()


@pytest.mark.L1
def test_atomic_grad_ape_path_under_warn_only_determinism():
    pack = make_pack([517, 1000, 33], 4, 2, 128, device="cuda")
    _supported_or_skip(pack)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="deterministic=False"):
        fast = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, deterministic=False)
    exact = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4)
    assert torch.equal(fast["grad_kv"], exact["grad_kv"]) and torch.equal(fast["grad_score"], exact["grad_score"])
    torch.testing.assert_close(fast["grad_ape"], exact["grad_ape"], rtol=1e-5, atol=1e-4)


@pytest.mark.L0
@pytest.mark.parametrize("ratio", [4, 64])
def test_wrapper_fast_path_gives_the_same_bits_and_falls_back_to_the_named_errors(ratio, monkeypatch):
    """After one checked call the wrappers skip the named checks; inputs the plan does not cover
    still get the checked path's precise errors, and validation via the environment still runs."""
    import csa_frontend.compressor.api as api

    api.clear_op_cache()
    pack = make_kind("ragged", ratio, 2, 128, seed=5, device="cuda")
    kw = dict(ratio=ratio, coff=2)
    out = csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"]
    grads = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw)
    _assert_matches_reference(pack, out, list(grads))
    assert len(api._fast_plans) == 2
    import tvm_ffi
    from csa_frontend.compressor.kernels import dispatch
    fwd, sched, _, bulk, serial, _, one_segment = dispatch._kernels_for("fwd", pack.kv.device, ratio, 2, 128)
    main, reduce, sched, _, few = dispatch._kernels_for("bwd", pack.kv.device, ratio, 2, 128)
    # launches skip the DSL's keyword wrapper (the backward's few-rows kernels too)
    entries = ((fwd, main, reduce) + (few[:2] if few is not None else ())
               + tuple(v[0] for v in (bulk, serial, one_segment) if v is not None))
    assert all(isinstance(f, tvm_ffi.Function) for f in entries)
    assert (few is None) == (ratio == 4)

    def no_checks(*args, **kwargs):
        raise AssertionError("the fast path ran the named checks")

    with monkeypatch.context() as m:
        m.setattr(api, "_checked_inputs", no_checks)
        for _ in range(3):
            again = csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"]
            assert torch.equal(again, out)
            for got, want in zip(csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw), grads):
                assert torch.equal(got, want)

    kv, score, ape, cu, comp = pack.inputs
    strided_kv = torch.empty(kv.shape[1], kv.shape[0], dtype=kv.dtype, device="cuda").t()
    strided_kv.copy_(kv)
    misaligned_kv = torch.empty(kv.numel() + 1, dtype=kv.dtype, device="cuda")[1:].view(kv.shape)
    misaligned_kv.copy_(kv)
    # each refused by the compiled entry point (or the fast path's own checks) before any launch
    wrong = [((kv, score.float(), ape, cu, comp), "score"),
             ((strided_kv, score, ape, cu, comp), "kv"),
             ((misaligned_kv, score, ape, cu, comp), "kv"),
             ((kv, score[:-1], ape, cu, comp), "score"),
             ((kv, score, ape[:-1], cu, comp), "ape"),
             ((kv, score, ape.double(), cu, comp), "ape"),
             ((kv, score, ape, cu.long(), comp), "cu_seqlens"),
             ((kv, score, ape, cu.to(torch.uint32), comp), "cu_seqlens"),
             ((kv, score, ape, cu.cpu(), comp), "cu_seqlens"),
             ((kv, score, ape, cu, comp[:-1]), "cu_seqlens_comp")]
    for inputs, name in wrong:
        with pytest.raises(ValueError, match=name):
            csa_compressor_forward_wrapper(*inputs, total_comp=pack.total_comp, **kw)
        with pytest.raises(ValueError, match=name):
            csa_compressor_forward_wrapper(*inputs, total_comp=0, **kw)
        with pytest.raises(ValueError, match=name):
            csa_compressor_backward_wrapper(*inputs, pack.grad_out, **kw)
    grad_strided = torch.empty(pack.grad_out.shape[1], pack.grad_out.shape[0], dtype=torch.bfloat16,
                               device="cuda").t()
    with pytest.raises(ValueError, match="grad_out"):
        csa_compressor_backward_wrapper(*pack.inputs, grad_strided, **kw)
    with pytest.raises(ValueError, match="grad_out"):
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out.float(), **kw)
    with pytest.raises(ValueError, match="total_comp"):
        csa_compressor_forward_wrapper(*pack.inputs, total_comp=-1, **kw)
    with pytest.raises(ValueError, match="grad_out"):
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out[:, :64].contiguous(), **kw)

    bad_comp = comp.clone()
    bad_comp[1] += 1
    monkeypatch.setenv("CSA_FRONTEND_VALIDATE", "1")
    with pytest.raises(ValueError, match="cu_seqlens_comp"):
        csa_compressor_forward_wrapper(kv, score, ape, cu, bad_comp, total_comp=pack.total_comp, **kw)
    monkeypatch.delenv("CSA_FRONTEND_VALIDATE")
    assert torch.equal(csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"], out)


@pytest.mark.L0
@pytest.mark.parametrize("ratio", [4, 64])
def test_class_execute_refuses_what_its_plan_does_not_cover_and_leaves_outputs_untouched(ratio):
    """``execute`` launches straight away when the compiled entry point accepts the tensors;
    whatever it refuses gets the named check's error, with every output as it was."""
    pack = make_kind("ragged", ratio, 2, 128, seed=9, device="cuda")
    kv, score, ape, cu, comp = pack.inputs
    out = torch.full((pack.total_comp, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    fwd = CSACompressorForward(*pack.inputs, out, ratio=ratio, coff=2)
    fwd.compile()
    grads = [torch.full_like(t, float("nan")) for t in (kv, score, ape)]
    bwd = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, ratio=ratio, coff=2)
    bwd.compile()
    fwd.execute(*pack.inputs, out)
    bwd.execute(*pack.inputs, pack.grad_out, *grads)
    _assert_matches_reference(pack, out, grads)
    kept = [t.clone() for t in [out] + grads]

    def assert_untouched():
        for now, before in zip([out] + grads, kept):
            assert torch.equal(now, before)

    strided_out = torch.empty(128, pack.total_comp, dtype=torch.bfloat16, device="cuda").t()
    for args, name in [((kv, score.float(), ape, cu, comp, out), "score"),
                       ((kv, score, ape, cu, comp[:-1], out), "cu_seqlens_comp"),
                       ((kv, score, ape, cu, comp, out[:, :64]), "out"),
                       ((kv, score, ape, cu, comp, strided_out), "out"),
                       ((kv, score, ape, cu, comp, out.float()), "out")]:
        with pytest.raises(ValueError, match=name):
            fwd.execute(*args)
    transposed_ape = torch.empty(ape.shape[1], ape.shape[0], device="cuda")
    for args, name in [((kv, score, ape, cu, comp, pack.grad_out, grads[0], grads[1], transposed_ape), "grad_ape"),
                       ((kv, score, ape, cu, comp, pack.grad_out, grads[0], grads[1][:-1], grads[2]), "grad_score"),
                       ((kv, score, ape, cu, comp, pack.grad_out, grads[0].float(), grads[1], grads[2]), "grad_kv"),
                       ((kv, score, ape, cu, comp, pack.grad_out[:, :64], *grads), "grad_out")]:
        with pytest.raises(ValueError, match=name):
            bwd.execute(*args)
    assert_untouched()


@pytest.mark.L0
@pytest.mark.parametrize("ratio,coff,head_dim,kind,deterministic",
                         [(4, 2, 128, "ragged", True), (4, 1, 512, "padding", True), (128, 2, 128, "empty", True),
                          (16, 2, 256, "padding", True), (4, 2, 128, "short", False), (128, 1, 128, "ragged", False)])
def test_frozen_ape_backward_writes_the_same_grad_kv_and_grad_score(ratio, coff, head_dim, kind, deterministic):
    """grad_ape not wanted (``grad_ape=None``, ``compute_grad_ape=False``, an ape that needs no
    gradient): the backward skips its reduction, and grad_kv / grad_score keep every bit and
    every zero-filled slot of the full backward (NaN-poisoned buffers)."""
    pack = make_kind(kind, ratio, coff, head_dim, seed=ratio + coff, device="cuda")
    _supported_or_skip(pack)
    kw = dict(ratio=ratio, coff=coff, deterministic=deterministic)
    full = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw)
    grads = [torch.full_like(t, float("nan")) for t in (pack.kv, pack.score)]
    bwd = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, None, **kw)
    bwd.compile()
    for _ in range(2):  # the checked first call, then the prepared launch
        for g in grads:
            g.fill_(float("nan"))
        bwd.execute(*pack.inputs, pack.grad_out, *grads, None)
        assert torch.equal(grads[0], full["grad_kv"]) and torch.equal(grads[1], full["grad_score"])
    for _ in range(2):  # the wrapper: checked, then its fast path
        frozen = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, compute_grad_ape=False, **kw)
        assert frozen["grad_ape"] is None
        assert torch.equal(frozen["grad_kv"], full["grad_kv"]) and torch.equal(frozen["grad_score"], full["grad_score"])
    kv, score = (t.clone().requires_grad_() for t in (pack.kv, pack.score))
    out = csa_compress(kv, score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp, ratio=ratio, coff=coff,
                       total_comp=pack.total_comp, deterministic=deterministic)
    (out.float() * pack.grad_out.float()).sum().backward()
    assert torch.equal(kv.grad, full["grad_kv"]) and torch.equal(score.grad, full["grad_score"])


@pytest.mark.L1
def test_frozen_ape_backward_captures_in_a_cuda_graph():
    pack = make_pack([300, 77, 1024], 4, 2, 128, extra_rows=3, device="cuda")
    _supported_or_skip(pack)
    expected = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, compute_grad_ape=False)
    grad_out = pack.grad_out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = csa_compressor_backward_wrapper(*pack.inputs, grad_out, ratio=4, compute_grad_ape=False)
    fresh = torch.randn(grad_out.shape, device="cuda").to(torch.bfloat16)
    grad_out.copy_(fresh)  # new data, copied in place
    graph.replay()
    torch.cuda.synchronize()
    want = csa_compressor_backward_wrapper(*pack.inputs, fresh, ratio=4)
    assert grads["grad_ape"] is None and not torch.equal(want["grad_kv"], expected["grad_kv"])
    assert torch.equal(grads["grad_kv"], want["grad_kv"]) and torch.equal(grads["grad_score"], want["grad_score"])
