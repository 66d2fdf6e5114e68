"""The operator API on CPU: class lifecycle vs wrappers, results, meta samples, logging, the
operator cache, determinism guard and thread safety. CPU tensors run the fp32 reference, so
every result here must equal it bit for bit."""
import itertools
import threading
import warnings

import pytest
import torch

import csa_frontend.compressor.api as api
from csa_frontend import (CSACompressorBackward, CSACompressorForward, csa_compressor_backward_wrapper,
                          csa_compressor_forward_wrapper)
from csa_frontend.compressor import plan
from csa_frontend.compressor.reference import reference_backward, reference_forward
from csa_testing import COFFS, PACK_KINDS, leveled, make_kind, make_pack, sentinel_like

API_MATRIX = list(itertools.product((1, 3, 4, 16, 128), COFFS, (1, 65, 128), PACK_KINDS))


def _api_smoke(ratio, coff, head_dim, kind):
    return ratio == 4 and head_dim == 65 and kind in ("ragged", "padding")


def _forward_op(pack, out, **kw):
    return CSACompressorForward(*pack.inputs, out, ratio=pack.ratio, coff=pack.coff, **kw)


def _backward_op(pack, grads, **kw):
    return CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, ratio=pack.ratio, coff=pack.coff, **kw)


def _uninitialised_grads(pack):
    return [sentinel_like(t) for t in (pack.kv, pack.score, pack.ape)]


@pytest.mark.parametrize("ratio,coff,head_dim,kind", leveled(API_MATRIX, _api_smoke))
def test_class_lifecycle_and_wrappers_equal_the_reference(ratio, coff, head_dim, kind):
    pack = make_kind(kind, ratio, coff, head_dim, seed=ratio * 31 + head_dim)
    expected_out = reference_forward(*pack.inputs, ratio, coff, pack.total_comp)
    expected_grads = reference_backward(*pack.inputs, pack.grad_out, ratio, coff)

    out = sentinel_like(expected_out)
    fwd = _forward_op(pack, out)
    assert fwd.check_support()
    fwd.compile()
    fwd.execute(*pack.inputs, out)
    assert torch.equal(out, expected_out)

    grads = _uninitialised_grads(pack)
    bwd = _backward_op(pack, grads)
    bwd.check_support()
    bwd.compile()
    bwd.execute(*pack.inputs, pack.grad_out, *grads)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)

    wrapped = csa_compressor_forward_wrapper(*pack.inputs, ratio=ratio, coff=coff, total_comp=pack.total_comp)
    assert torch.equal(wrapped["out"], expected_out)
    wrapped_grads = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=ratio, coff=coff)
    for got, want in zip(wrapped_grads, expected_grads):
        assert torch.equal(got, want)


@pytest.mark.L0
def test_results_index_like_a_dict_and_unpack_like_a_tuple():
    pack = make_pack([9, 5], 4, 2, 8, extra_rows=1)
    fwd = csa_compressor_forward_wrapper(*pack.inputs, ratio=4, total_comp=pack.total_comp)
    (out,) = fwd
    assert isinstance(fwd, dict) and list(fwd.keys()) == ["out"]
    assert out is fwd["out"] is fwd[0]
    res = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4)
    assert list(res.keys()) == ["grad_kv", "grad_score", "grad_ape"]
    grad_kv, grad_score, grad_ape = res
    assert grad_kv is res["grad_kv"] and grad_score is res[1] and grad_ape is res[-1]
    assert res[0:2] == (grad_kv, grad_score)
    assert dict(res).keys() == res.keys() and len(res) == 3
    assert {**res}["grad_ape"] is grad_ape
    assert grad_kv.dtype == torch.bfloat16 and grad_ape.dtype == torch.float32


@pytest.mark.L0
@pytest.mark.parametrize("extra_rows", [0, 2])
def test_backward_without_grad_ape(extra_rows):
    """A frozen ape: ``grad_ape=None`` to ``execute``, ``compute_grad_ape=False`` to the wrapper;
    grad_kv and grad_score as the full backward's, every element written."""
    pack = make_pack([9, 0, 13, 2], 4, 2, 8, extra_tokens=3, extra_rows=extra_rows, seed=extra_rows)
    want = reference_backward(*pack.inputs, pack.grad_out, 4, 2)
    grads = _uninitialised_grads(pack)[:2]
    op = _backward_op(pack, [*grads, None])
    op.compile()
    op.execute(*pack.inputs, pack.grad_out, *grads, None)
    assert torch.equal(grads[0], want[0]) and torch.equal(grads[1], want[1])
    res = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, compute_grad_ape=False)
    assert list(res.keys()) == ["grad_kv", "grad_score", "grad_ape"] and res["grad_ape"] is None
    assert torch.equal(res["grad_kv"], want[0]) and torch.equal(res["grad_score"], want[1])
    with pytest.raises(ValueError, match="compute_grad_ape: expected True or False, got 0"):
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, compute_grad_ape=0)
    empty = make_pack([3, 2], 4, 2, 8)  # no rows: zeros, and nothing for grad_ape
    grads = _uninitialised_grads(empty)[:2]
    op = _backward_op(empty, [*grads, None])
    op.compile()
    op.execute(*empty.inputs, empty.grad_out, *grads, None)
    assert not any(g.any() for g in grads)


@pytest.mark.L0
def test_default_total_comp_reads_the_offsets():
    pack = make_pack([9, 0, 7], 4, 2, 8, extra_rows=2)
    out = csa_compressor_forward_wrapper(*pack.inputs, ratio=4)["out"]
    assert out.shape == (pack.used_rows, 8)
    padded = csa_compressor_forward_wrapper(*pack.inputs, ratio=4, total_comp=pack.total_comp)["out"]
    assert torch.equal(padded[:pack.used_rows], out)


@pytest.mark.L0
def test_zero_rows_launch_nothing_and_give_zero_gradients():
    pack = make_pack([3, 2], 4, 2, 8)  # every segment shorter than ratio
    assert csa_compressor_forward_wrapper(*pack.inputs, ratio=4)["out"].shape == (0, 8)
    grads = _uninitialised_grads(pack)
    op = _backward_op(pack, grads)
    op.compile()
    op.execute(*pack.inputs, pack.grad_out, *grads)
    for g in grads:
        assert not g.any() and not torch.signbit(g.float()).any()


@pytest.mark.L0
def test_meta_samples_plan_a_cpu_operator():
    pack = make_pack([9, 6, 13], 4, 2, 32, extra_rows=1)
    out = torch.empty(pack.total_comp, 32, dtype=torch.bfloat16)
    meta = [t.to("meta") for t in (*pack.inputs, out)]
    op = CSACompressorForward(*meta, ratio=4, coff=2, device="cpu")
    assert op.check_support()
    op.compile()
    assert op.device == torch.device("cpu")
    op.execute(*pack.inputs, out)
    assert torch.equal(out, reference_forward(*pack.inputs, 4, 2, pack.total_comp))

    grads = [torch.empty_like(t, device="meta") for t in (pack.kv, pack.score, pack.ape)]
    bwd = CSACompressorBackward(*meta[:5], pack.grad_out.to("meta"), *grads, ratio=4, coff=2)
    bwd.check_support()  # device defaults to CUDA when present, else CPU
    assert bwd.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.L0
def test_token_and_segment_counts_are_dynamic():
    first = make_pack([9, 6], 4, 2, 16)
    out = torch.empty(first.total_comp, 16, dtype=torch.bfloat16)
    op = _forward_op(first, out)
    op.compile()
    for lengths in ([9, 6], [40, 0, 3, 17, 8], [4]):
        pack = make_pack(lengths, 4, 2, 16, extra_rows=1, seed=len(lengths))
        out = torch.empty(pack.total_comp, 16, dtype=torch.bfloat16)
        op.execute(*pack.inputs, out)
        assert torch.equal(out, reference_forward(*pack.inputs, 4, 2, pack.total_comp))


@pytest.mark.L0
def test_execute_before_compile_is_an_error():
    pack = make_pack([9], 4, 2, 8)
    out = torch.empty(pack.total_comp, 8, dtype=torch.bfloat16)
    op = _forward_op(pack, out)
    op.check_support()
    with pytest.raises(RuntimeError, match=r"call compile\(\) first"):
        op.execute(*pack.inputs, out)


@pytest.mark.L0
def test_compile_is_idempotent_and_logged_with_its_duration(csa_log):
    pack = make_pack([9], 4, 2, 8)
    op = _forward_op(pack, torch.empty(pack.total_comp, 8, dtype=torch.bfloat16))
    op.compile()  # runs check_support itself
    op.compile()
    compiled = [r for r in csa_log.records if r.getMessage().startswith("compiled ")]
    assert len(compiled) == 1
    message = compiled[0].getMessage()
    assert "CSACompressorForward(ratio=4, coff=2, head_dim=8, device=cpu: cpu reference)" in message
    assert message.endswith(" ms") and compiled[0].name == "csa_frontend"
    assert any("check_support passed" in r.getMessage() for r in csa_log.records)


@pytest.mark.L0
def test_wrappers_reuse_one_operator_per_configuration(csa_log):
    for lengths in ([9, 6], [13], [8, 8, 8]):
        pack = make_pack(lengths, 4, 2, 8)
        csa_compressor_forward_wrapper(*pack.inputs, ratio=4)
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4)
    compiled = [r.getMessage() for r in csa_log.records if r.getMessage().startswith("compiled ")]
    assert len(compiled) == 2, compiled
    assert len(api._op_cache) == 2


@pytest.mark.L0
def test_operator_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(api, "OP_CACHE_SIZE", 2)
    for head_dim in (8, 16, 24):
        pack = make_pack([9], 4, 2, head_dim)
        csa_compressor_forward_wrapper(*pack.inputs, ratio=4)
    keys = list(api._op_cache)
    assert len(keys) == 2 and [k[2].head_dim for k in keys] == [16, 24]


@pytest.mark.L0
def test_determinism_guard_raises_under_deterministic_algorithms():
    pack = make_pack([9, 6], 4, 2, 8)
    grads = _uninitialised_grads(pack)
    before = [g.clone() for g in grads]
    op = _backward_op(pack, grads, deterministic=False)
    op.compile()
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic=False"):
        op.execute(*pack.inputs, pack.grad_out, *grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, before))
    with pytest.raises(RuntimeError, match="torch.use_deterministic_algorithms"):
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, deterministic=False)
    # The default (deterministic) path is always allowed.
    csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4)


@pytest.mark.L0
def test_determinism_guard_warns_in_warn_only_mode():
    pack = make_pack([9, 6], 4, 2, 8)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="deterministic=False"):
        res = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, deterministic=False)
    for got, want in zip(res, reference_backward(*pack.inputs, pack.grad_out, 4, 2)):
        assert torch.equal(got, want)
    torch.use_deterministic_algorithms(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4, deterministic=False)


@pytest.mark.L0
@pytest.mark.parametrize("value,expected", [(None, False), ("0", False), ("1", True), ("true", True),
                                            ("off", False)])
def test_validate_env_var(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv(plan.VALIDATE_ENV, value)
    assert plan.validate_requested(None) is expected
    assert plan.validate_requested(True) is True


@pytest.mark.L0
@pytest.mark.parametrize("capability,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), "sm_80"),
                                             ((8, 6), "sm_80"), ((8, 9), "sm_80"), ((12, 0), "sm_120")])
def test_arch_names(capability, arch):
    assert plan.arch_from_capability(capability) == arch


@pytest.mark.L0
def test_concurrent_wrapper_calls_compile_once(csa_log):
    packs = [make_pack([9 + i, 6, 4 * i], 4, 2, 16, seed=i) for i in range(8)]
    results = [None] * len(packs)
    barrier = threading.Barrier(len(packs))

    def work(i):
        barrier.wait()
        results[i] = csa_compressor_forward_wrapper(*packs[i].inputs, ratio=4)["out"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(packs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pack, out in zip(packs, results):
        assert torch.equal(out, reference_forward(*pack.inputs, 4, 2))
    assert len(api._op_cache) == 1
    assert len([r for r in csa_log.records if r.getMessage().startswith("compiled ")]) == 1


def _fast_plan_of_a_small_pack():
    """A checked r4 c2 d8 CPU plan wrapped as the wrappers' fast path would (no launcher)."""
    pack = make_pack([9, 6], 4, 2, 8)
    out = torch.empty(pack.total_comp, 8, dtype=torch.bfloat16)
    op = CSACompressorForward(*pack.inputs, out, ratio=4, coff=2)
    op.check_support()
    return pack, api._FastPlan(op, launch=None)


@pytest.mark.L0
def test_fast_plan_checks_what_the_compiled_entry_point_cannot():
    """The wrappers' fast path (CUDA only) leaves dtype/extent/stride/alignment/device checks to
    the compiled entry point, except for zero-row calls (``matches``); the rest is checked here."""
    pack, fp = _fast_plan_of_a_small_pack()
    kv, score, ape, cu, comp = pack.inputs
    assert fp.matches(*pack.inputs)
    strided = torch.empty(kv.shape[1], kv.shape[0], dtype=kv.dtype).t()
    misaligned = torch.empty(kv.numel() + 1, dtype=kv.dtype)[1:].view(kv.shape)
    for bad in [(kv.float(), score, ape, cu, comp), (kv, score.float(), ape, cu, comp),
                (kv, score, ape.double(), cu, comp), (kv, score, ape, cu, comp[:-1]),
                (kv[:, :8], score[:, :8], ape, cu, comp), (strided, score, ape, cu, comp),
                (kv, score[:-1], ape, cu, comp), (kv, score, ape[:3], cu, comp),
                (kv, score, ape, cu.view(1, -1), comp.view(1, -1)), (misaligned, score, ape, cu, comp)]:
        assert not fp.matches(*bad)
    rows = pack.total_comp
    assert fp.beyond_entry_checks(kv, cu, comp, rows) and fp.beyond_entry_checks(kv, cu, comp, 0)
    assert fp.beyond_entry_checks(kv, cu, comp, fp.max_rows)
    for bad_rows in (-1, 3.0, fp.max_rows + 1, True):
        assert not fp.beyond_entry_checks(kv, cu, comp, bad_rows)
    assert not fp.beyond_entry_checks(kv, cu.long(), comp, rows)
    assert not fp.beyond_entry_checks(kv, cu, comp.to(torch.uint32), rows)
    assert not fp.beyond_entry_checks(kv, cu[:0], comp[:0], rows)
    assert not fp.beyond_entry_checks(kv[:3], cu, comp, rows)
    assert fp.beyond_entry_checks(kv[:3], cu, comp, 0)


@pytest.mark.L0
def test_fast_path_respects_the_validation_switch(monkeypatch):
    pack, fp = _fast_plan_of_a_small_pack()
    kv, _, _, cu, comp = pack.inputs
    for value, on in (("1", True), ("off", False), ("yes", True), ("0", False)):
        monkeypatch.setenv("CSA_FRONTEND_VALIDATE", value)
        assert fp.beyond_entry_checks(kv, cu, comp, pack.total_comp) is (not on)
    monkeypatch.delenv("CSA_FRONTEND_VALIDATE")
    assert fp.beyond_entry_checks(kv, cu, comp, pack.total_comp)
