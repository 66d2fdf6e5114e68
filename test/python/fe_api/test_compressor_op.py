"""``csa_compress``: autograd against the wrappers, the eager fast path vs the custom op, and
``torch.compile(fullgraph=True)`` without graph breaks or recompiles for new token counts."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import csa_frontend.compressor.op as op_module
from csa_frontend import csa_compress, csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
from csa_testing import make_pack

# Token and segment counts vary; B+1 is kept apart from ratio (4) so duck sizing cannot tie
# cu_seqlens' length to ape's rows and force a recompile that says nothing about the op.
PACKS = ([9, 13], [17, 0, 5, 40, 11], [8, 30, 3, 12, 16, 7])


def _leaves(pack):
    return [t.clone().requires_grad_() for t in (pack.kv, pack.score, pack.ape)]


def _loss(out, weight):
    """A downstream consumer whose gradient w.r.t. out is ``weight``."""
    return (out.float() * weight.float()).sum()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.L0
@pytest.mark.parametrize("ratio,coff,extra_rows", [(4, 2, 2), (3, 1, 0), (1, 2, 1)])
def test_autograd_equals_the_wrappers(ratio, coff, extra_rows):
    pack = make_pack([4 * ratio + 1, 0, 2 * ratio], ratio, coff, 24, extra_tokens=3, extra_rows=extra_rows)
    kv, score, ape = _leaves(pack)
    out = csa_compress(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp, ratio=ratio, coff=coff,
                       total_comp=pack.total_comp)
    expected = csa_compressor_forward_wrapper(*pack.inputs, ratio=ratio, coff=coff, total_comp=pack.total_comp)
    assert torch.equal(out, expected["out"])
    _loss(out, pack.grad_out).backward()
    grads = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=ratio, coff=coff)
    for leaf, want in zip((kv, score, ape), grads):
        assert torch.equal(leaf.grad, want)


@pytest.mark.L0
def test_expanded_incoming_gradient_is_accepted():
    pack = make_pack([9, 13], 4, 2, 16, extra_rows=1)
    kv, score, ape = _leaves(pack)
    csa_compress(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp).sum().backward()  # grad: expanded ones
    ones = torch.ones(pack.total_comp, 16, dtype=torch.bfloat16)
    expected = csa_compressor_backward_wrapper(*pack.inputs, ones, ratio=4)
    assert torch.equal(kv.grad, expected["grad_kv"]) and torch.equal(ape.grad, expected["grad_ape"])


@pytest.mark.L0
def test_eager_calls_skip_the_dispatcher(monkeypatch):
    def fail(*args):
        raise AssertionError("eager csa_compress went through torch.library dispatch")

    monkeypatch.setattr(op_module, "compress_fwd", fail)
    pack = make_pack([9, 13], 4, 2, 16)
    kv, score, ape = _leaves(pack)
    out = csa_compress(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    assert out.requires_grad
    with torch.no_grad():
        plain = csa_compress(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    assert not plain.requires_grad and torch.equal(plain, out.detach())


@pytest.mark.L0
def test_custom_op_route_equals_the_eager_route():
    pack = make_pack([9, 0, 13], 4, 2, 16, extra_rows=2)
    routes = []
    for call in (lambda *a: op_module.compress_fwd(*a, 4, 2, pack.total_comp, True),
                 lambda *a: csa_compress(*a, ratio=4, coff=2, total_comp=pack.total_comp)):
        kv, score, ape = _leaves(pack)
        out = call(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp)
        _loss(out, pack.grad_out).backward()
        routes.append((out, kv.grad, score.grad, ape.grad))
    for a, b in zip(*routes):
        assert torch.equal(a, b)


@pytest.mark.L0
@pytest.mark.parametrize("total_comp", ["explicit", "derived"])
def test_opcheck(total_comp):
    pack = make_pack([9, 13], 4, 2, 16, extra_rows=1)
    rows = pack.total_comp if total_comp == "explicit" else -1
    torch.library.opcheck(op_module.compress_fwd, (*_leaves(pack), pack.cu_seqlens, pack.cu_seqlens_comp, 4, 2,
                                                   rows, True))
    for compute_grad_ape in (True, False):
        torch.library.opcheck(op_module.compress_bwd, (*pack.inputs, pack.grad_out, 4, 2, True, compute_grad_ape))


@pytest.mark.L0
@pytest.mark.parametrize("compiled", [False, True])
def test_frozen_ape_skips_grad_ape(compiled, monkeypatch):
    """An ape that needs no gradient: the backward is asked for none (so it skips its reduction),
    ape.grad stays None, and kv / score get the full backward's gradients."""
    pack = make_pack([9, 0, 13], 4, 2, 16, extra_rows=1)
    asked = []
    wrapper = op_module.csa_compressor_backward_wrapper

    def spy(*args, **kwargs):
        asked.append(kwargs["compute_grad_ape"])
        return wrapper(*args, **kwargs)

    monkeypatch.setattr(op_module, "csa_compressor_backward_wrapper", spy)
    step = torch.compile(_step, fullgraph=True, dynamic=True) if compiled else _step
    for ape_trains in (True, False):
        kv, score, ape = _leaves(pack)
        ape.requires_grad_(ape_trains)
        step(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp, pack.total_comp, pack.grad_out).backward()
        assert (ape.grad is not None) == ape_trains and asked[-1] == ape_trains
        if ape_trains:
            want = (kv.grad, score.grad, ape.grad)
        else:
            assert torch.equal(kv.grad, want[0]) and torch.equal(score.grad, want[1])


def _step(kv, score, ape, cu_seqlens, cu_seqlens_comp, total_comp, weight):
    out = csa_compress(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, coff=2, total_comp=total_comp)
    return _loss(torch.tanh(out.float()) * 2, weight)


def _run_step(fn, pack):
    kv, score, ape = _leaves(pack)
    loss = fn(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp, pack.total_comp, pack.grad_out)
    loss.backward()
    return loss.detach(), kv.grad, score.grad, ape.grad


def _assert_compiled_matches_eager(compiled, packs, exact=True):
    for lengths in packs:
        pack = make_pack(lengths, 4, 2, 16, extra_rows=1, seed=len(lengths))
        for got, want in zip(_run_step(compiled, pack), _run_step(_step, pack)):
            if exact:
                assert torch.equal(got, want)
            else:  # inductor fuses the surrounding tanh/mul/sum, so their bits may differ
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.L0
def test_torch_compile_fullgraph_without_recompiles():
    # aot_eager traces exactly what inductor would (dynamo graph + AOT autograd with the fake
    # kernels) without minutes of C++ compilation in CI; inductor itself runs in an L1 test.
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_step, backend=counter, fullgraph=True, dynamic=True)
    _assert_compiled_matches_eager(compiled, PACKS)
    assert counter.frame_count == 1, "a new token/segment count recompiled"
    pack = make_pack(PACKS[0], 4, 2, 16, extra_rows=1)
    explained = torch._dynamo.explain(_step)(*_leaves(pack), pack.cu_seqlens, pack.cu_seqlens_comp,
                                             pack.total_comp, pack.grad_out)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.L0
def test_torch_compile_with_derived_total_comp():
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def pooled(kv, score, ape, cu_seqlens, cu_seqlens_comp):
        return csa_compress(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=4, coff=2)  # unbacked rows

    for lengths in PACKS:
        pack = make_pack(lengths, 4, 2, 16)
        kv, score, ape = _leaves(pack)
        out = pooled(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp)
        assert torch.equal(out, csa_compressor_forward_wrapper(*pack.inputs, ratio=4)["out"])
        _loss(out, pack.grad_out[:out.shape[0]]).backward()
        want = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=4)
        assert torch.equal(kv.grad, want["grad_kv"])
    assert counter.frame_count == 1


@pytest.mark.L1
def test_torch_compile_inductor():
    compiled = torch.compile(_step, fullgraph=True, dynamic=True)
    _assert_compiled_matches_eager(compiled, PACKS[:2], exact=False)


@pytest.mark.L0
def test_deterministic_flag_reaches_backward():
    pack = make_pack([9, 13], 4, 2, 16)
    kv, score, ape = _leaves(pack)
    out = csa_compress(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp, deterministic=False)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic=False"):
        out.float().sum().backward()


@pytest.mark.L0
@pytest.mark.parametrize("route", ["eager", "custom_op", "compiled"])
def test_double_backward_is_an_error_not_a_dropped_term(route):
    """A gradient penalty differentiates the gradients again. The kernels have no second
    derivative: every route must raise instead of silently leaving that term out."""
    pack = make_pack([9, 13], 4, 2, 16, extra_rows=1)
    pooled = {
        "eager": lambda *a: csa_compress(*a, total_comp=pack.total_comp),
        "custom_op": lambda *a: op_module.compress_fwd(*a, 4, 2, pack.total_comp, True),
        "compiled": torch.compile(lambda *a: csa_compress(*a, total_comp=pack.total_comp), fullgraph=True),
    }[route]
    kv, score, ape = _leaves(pack)
    out = pooled(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    (grad_kv,) = torch.autograd.grad(_loss(out, pack.grad_out), (kv,), create_graph=True)
    penalty = (grad_kv.float() ** 2).sum() + (kv.float() ** 2).sum()
    with pytest.raises(RuntimeError, match="csa_compress has no double backward|no autograd formula|double backward"):
        penalty.backward()


@pytest.mark.L0
@pytest.mark.parametrize("flag", [1, None, "yes"])
def test_bad_deterministic_flag_is_refused_before_the_forward(flag, monkeypatch):
    def fail(*args):
        raise AssertionError("the forward ran before the flag was checked")

    monkeypatch.setattr(op_module, "_forward", fail)
    pack = make_pack([9, 13], 4, 2, 16)
    with pytest.raises(ValueError, match=f"deterministic: expected True or False, got {flag!r}"):
        csa_compress(*_leaves(pack), pack.cu_seqlens, pack.cu_seqlens_comp, deterministic=flag)
