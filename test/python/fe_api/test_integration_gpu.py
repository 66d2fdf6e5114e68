"""Framework integration on CUDA (issue 5): ``torch.compile(fullgraph=True)`` of ``csa_compress``,
CUDA-graph capture of a training step, explicit streams with inputs freed while a kernel is
pending, no host synchronisation per call, and the determinism guard. Skipped without CUDA.

Bit-exactness: ``csa_compress`` runs the same fused kernels eagerly (autograd.Function) and
compiled (custom op), so whatever feeds the kernels identical bits gets identical bits back.
"""
import math

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import csa_frontend.compressor.api as api
from csa_frontend import (CSACompressorBackward, csa_compress,
                          csa_compressor_backward_wrapper, csa_compressor_forward_wrapper)
from csa_testing import execute_backward, execute_forward, leaves, make_pack, offsets, sentinel_like

pytestmark = pytest.mark.gpu

RATIO, COFF, HEAD_DIM = 4, 2, 128

# (segment lengths, spare tokens, padding rows). Within a pack the token count T, B+1 and the row
# count all differ, and none equals a static extent (ratio 4, head_dim 128, coff*head_dim 256)
# or is 0/1, so dynamo's duck sizing and 0/1 specialisation cannot tie a dynamic size to a
# constant or to another size: a recompile would mean the op itself is not dynamic.
PACKS = (([37, 90], 5, 2), ([200, 13, 0, 61, 30], 5, 2), ([515, 77, 9, 44, 100, 3], 5, 2))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _pack(i):
    lengths, spare, padding = PACKS[i]
    return make_pack(lengths, RATIO, COFF, HEAD_DIM, extra_tokens=spare, extra_rows=padding, seed=i, device="cuda")


def _leaves(pack):
    return leaves(pack.kv, pack.score, pack.ape)


# -- torch.compile ---------------------------------------------------------------------------------

def _pool(kv, score, ape, cu_seqlens, cu_seqlens_comp, weight):
    """``csa_compress`` alone; the row count is the static capacity ``weight.shape[0]``."""
    return csa_compress(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=RATIO, coff=COFF,
                        total_comp=weight.shape[0])


def _step(kv, score, ape, cu_seqlens, cu_seqlens_comp, weight):
    """``csa_compress`` between other ops, as in a model: returns (out, loss)."""
    out = _pool(kv, score, ape, cu_seqlens, cu_seqlens_comp, weight)
    return out, (torch.tanh(out.float()) * weight.float()).sum()


def _run(fn, pack, mark_dynamic=False):
    """(out, loss, grad_kv, grad_score, grad_ape) of ``fn``; loss is None for ``_pool``, whose
    backward is fed ``pack.grad_out`` directly."""
    kv, score, ape = _leaves(pack)
    args = (kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp, pack.grad_out)
    if mark_dynamic:
        for t in (kv, score, pack.cu_seqlens, pack.cu_seqlens_comp, pack.grad_out):
            torch._dynamo.mark_dynamic(t, 0)
    result = fn(*args)
    if isinstance(result, tuple):
        out, loss = result
        loss.backward()
    else:
        out, loss = result, None
        out.backward(pack.grad_out)
    return out.detach(), loss if loss is None else loss.detach(), kv.grad, score.grad, ape.grad


def _assert_no_graph_break(fn):
    pack = _pack(0)
    explained = torch._dynamo.explain(fn)(*_leaves(pack), pack.cu_seqlens, pack.cu_seqlens_comp, pack.grad_out)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.L0
@pytest.mark.parametrize("dynamic", ["dynamic=True", "mark_dynamic"])
def test_compile_fullgraph_equals_eager_without_recompiles(dynamic):
    """aot_eager traces what inductor gets (dynamo graph, AOT autograd with the fake kernels) and
    runs the traced ops eagerly, so every output, the loss included, is bit-exact."""
    counter = CompileCounterWithBackend("aot_eager")
    by_flag = dynamic == "dynamic=True"
    compiled = torch.compile(_step, backend=counter, fullgraph=True, dynamic=True if by_flag else None)
    for i in range(len(PACKS)):
        for got, want in zip(_run(compiled, _pack(i), mark_dynamic=not by_flag), _run(_step, _pack(i))):
            assert torch.equal(got, want)
    assert counter.frame_count == 1, "a new token / segment / row count recompiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_no_graph_break(_step)


@pytest.mark.L1
def test_inductor_around_the_op_alone_is_bit_exact():
    """Inductor has nothing to fuse when the graph is the custom op: forward and backward bits
    equal eager's for every pack, with one compile."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_pool, backend=counter, fullgraph=True, dynamic=True)
    for i in range(len(PACKS)):
        for got, want in zip(_run(compiled, _pack(i)), _run(_pool, _pack(i))):
            assert got is None and want is None or torch.equal(got, want)
    assert counter.frame_count == 1 and not counters["graph_break"]


@pytest.mark.L1
def test_inductor_with_surrounding_ops():
    """``out`` is bit-exact (its inputs are). Inductor generates its own tanh, multiply and sum
    (Triton, other rounding and reduction order), so the loss and the gradient flowing into the
    backward kernel may differ from eager's in the last bits; after the bf16 rounding of that
    gradient a value may move by one bf16 step (2**-8 relative), which the kernels carry through
    linearly: 2e-2 relative, and 1e-2 of the largest value absolute where gradients cancel."""
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_step, backend=counter, fullgraph=True, dynamic=True)
    for i in range(len(PACKS)):
        got, want = _run(compiled, _pack(i)), _run(_step, _pack(i))
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[1:], want[1:]):
            w = w.float()
            torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=1e-2 * float(w.abs().max()))
    assert counter.frame_count == 1 and not counters["graph_break"]


# -- CUDA graphs -----------------------------------------------------------------------------------

class _Compressor(torch.nn.Module):
    """Projects hidden states to kv and score and pools them, as the DeepSeek-V4 Compressor does."""

    def __init__(self, hidden):
        super().__init__()
        cols = COFF * HEAD_DIM
        self.to_kv = torch.nn.Linear(hidden, cols, bias=False, device="cuda", dtype=torch.bfloat16)
        self.to_score = torch.nn.Linear(hidden, cols, bias=False, device="cuda", dtype=torch.bfloat16)
        self.ape = torch.nn.Parameter(0.5 * torch.randn(RATIO, cols, device="cuda"))

    def forward(self, x, cu_seqlens, cu_seqlens_comp, capacity):
        kv, score = self.to_kv(x), self.to_score(x)
        out = csa_compress(kv, score, self.ape, cu_seqlens, cu_seqlens_comp, ratio=RATIO, coff=COFF,
                           total_comp=capacity)
        return kv, score, out


@pytest.mark.L1
def test_training_step_captures_and_replays_in_a_cuda_graph():
    """Forward and backward of a model step are captured after one warm-up; replays with new
    hidden states, new loss weights and new segment boundaries (same B and T, rows within the
    static capacity) equal eager ``csa_compress`` on the replay's own kv and score."""
    tokens, hidden = 1000, 64
    boundaries = ([300, 77, 600], [500, 0, 490], [1, 999, 0], [250, 250, 250])
    capacity = max(sum(n // RATIO for n in lengths) for lengths in boundaries) + 3
    model = _Compressor(hidden)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    weight = torch.randn(capacity, HEAD_DIM, device="cuda")
    cu, comp = (t.cuda() for t in offsets(boundaries[0], RATIO))

    def step():
        kv, score, out = model(x, cu, comp, capacity)
        loss = (out.float() * weight).sum()
        loss.backward()
        return kv, score, out, loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the one warm-up: compiles and initialises everything the capture needs
    torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad = None  # the captured backward allocates its gradients in the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv, score, out, loss = step()

    for i, lengths in enumerate(boundaries):
        x.copy_(torch.randn(tokens, hidden, device="cuda"))
        weight.copy_(torch.randn(capacity, HEAD_DIM, device="cuda"))
        new_cu, new_comp = offsets(lengths, RATIO)
        cu.copy_(new_cu)
        comp.copy_(new_comp)
        graph.replay()
        torch.cuda.synchronize()
        copies = leaves(kv, score, model.ape)
        want = csa_compress(*copies, cu, comp, ratio=RATIO, coff=COFF, total_comp=capacity)
        want_loss = (want.float() * weight).sum()
        want_loss.backward()
        assert torch.equal(out, want) and torch.equal(loss, want_loss), f"replay {i}"
        assert torch.equal(model.ape.grad, copies[2].grad), f"replay {i}"
        with torch.no_grad():  # the Linear layers: cuBLAS in both, compared with bf16 tolerance
            torch.testing.assert_close(kv, model.to_kv(x), rtol=1.6e-2, atol=1e-2)
            for layer, grad in ((model.to_kv, copies[0].grad), (model.to_score, copies[1].grad)):
                w = grad.t() @ x
                torch.testing.assert_close(layer.weight.grad, w, rtol=1.6e-2,
                                           atol=1e-2 * float(w.float().abs().max()))


# -- explicit streams: inputs freed while the kernel is pending ------------------------------------

#: Cycles the side stream sleeps before the kernel: ~0.1 s at H200 clocks, far longer than the
#: host needs to free the inputs and overwrite their memory.
SLEEP_CYCLES = 200_000_000


def _stream_inputs():
    """Fresh tensors whose only references are in the returned dict, and total_comp."""
    pack = make_pack([300, 0, 77, 1024], RATIO, COFF, HEAD_DIM, extra_tokens=3, extra_rows=2, seed=11, device="cuda")
    names = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp", "grad_out")
    return {name: getattr(pack, name) for name in names}, pack.total_comp


def _forward_wrapper(t, total, stream):
    return (csa_compressor_forward_wrapper(t["kv"], t["score"], t["ape"], t["cu_seqlens"], t["cu_seqlens_comp"],
                                           ratio=RATIO, total_comp=total, stream=stream)["out"],)


def _backward_wrapper(t, total, stream):
    return tuple(csa_compressor_backward_wrapper(t["kv"], t["score"], t["ape"], t["cu_seqlens"],
                                                 t["cu_seqlens_comp"], t["grad_out"], ratio=RATIO, stream=stream))


def _forward_class(t, total, stream):
    inputs = (t["kv"], t["score"], t["ape"], t["cu_seqlens"], t["cu_seqlens_comp"])
    out = torch.empty(total, HEAD_DIM, dtype=torch.bfloat16, device=t["kv"].device)
    return (execute_forward(inputs, out, RATIO, COFF, stream),)


def _backward_class(t, total, stream):
    inputs = (t["kv"], t["score"], t["ape"], t["cu_seqlens"], t["cu_seqlens_comp"])
    grads = [torch.empty_like(t[name]) for name in ("kv", "score", "ape")]
    return tuple(execute_backward(inputs, t["grad_out"], grads, RATIO, COFF, stream))


FORWARD_ROUTES = (_forward_wrapper, _forward_class)


def _overwrite_freed(sizes):
    """Allocate on the current stream what was just freed (a few of each size, so equal-sized free
    blocks elsewhere cannot absorb them all) and overwrite it: NaN in data, zeros in offsets
    (harmless to a kernel that reads them: every segment empty, every row padding)."""
    junk = []
    for shape, dtype in sizes:
        for _ in range(4):
            junk.append(torch.full(shape, math.nan if dtype.is_floating_point else 0, dtype=dtype, device="cuda"))
    return junk


def _spans(tensors):
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def _run_while_the_side_stream_sleeps(route):
    """``route`` on the current stream (the expected result), then on a sleeping side stream whose
    inputs are freed and overwritten before the kernel can start. Returns (expected, result,
    pending: the side stream had not finished when the memory was overwritten, reused: some
    overwriting tensor landed in memory the inputs had held)."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    tensors, total = _stream_inputs()
    if route in FORWARD_ROUTES:
        del tensors["grad_out"]  # the forward never reads it, so nothing protects its memory
    expected = route(tensors, total, None)  # also compiles
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
    result = route(tensors, total, side)
    sizes = [(t.shape, t.dtype) for t in tensors.values()]
    freed = _spans(tensors.values())
    tensors.clear()  # the last references: the caching allocator gets the blocks back now
    junk = _overwrite_freed(sizes)
    pending = not side.query()
    reused = any(a < y and x < b for a, b in freed for x, y in _spans(junk))
    main.wait_stream(side)
    torch.cuda.synchronize()
    return expected, result, pending, reused


@pytest.mark.L0
@pytest.mark.parametrize("route", [_forward_wrapper, _backward_wrapper, _forward_class, _backward_class],
                         ids=lambda r: r.__name__.strip("_"))
def test_inputs_freed_while_the_kernel_is_pending_on_a_side_stream(route):
    """record_stream keeps the freed inputs' memory away from new allocations until the side
    stream has passed the kernel, so the result is right."""
    expected, result, pending, reused = _run_while_the_side_stream_sleeps(route)
    assert pending, "premise: the side stream finished before the inputs were freed; raise SLEEP_CYCLES"
    assert not reused, "memory of inputs still in use by the side stream was handed out again"
    for got, want in zip(result, expected):
        assert torch.equal(got, want)


@pytest.mark.L1
def test_without_record_stream_the_freed_inputs_are_overwritten(monkeypatch):
    """The test above can fail: with record_stream switched off, the same sequence hands the
    inputs' memory to the overwriting tensors before the kernel reads it."""
    monkeypatch.setattr(api, "_record_on", lambda *args: None)
    expected, result, pending, reused = _run_while_the_side_stream_sleeps(_forward_wrapper)
    assert pending and reused
    assert not torch.equal(result[0], expected[0])


# -- no host synchronisation -------------------------------------------------------------------------

def _every_call(pack, side):
    """Each public entry point once, total_comp given; also on a side stream."""
    csa_compressor_forward_wrapper(*pack.inputs, ratio=RATIO, total_comp=pack.total_comp)
    csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=RATIO)
    side.wait_stream(torch.cuda.current_stream())
    csa_compressor_forward_wrapper(*pack.inputs, ratio=RATIO, total_comp=pack.total_comp, stream=side)
    csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=RATIO, stream=side)
    torch.cuda.current_stream().wait_stream(side)
    execute_forward(pack.inputs, torch.empty(pack.total_comp, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                    RATIO, COFF)
    execute_backward(pack.inputs, pack.grad_out, [torch.empty_like(t) for t in pack.inputs[:3]], RATIO, COFF)
    pooled = csa_compress(*_leaves(pack), pack.cu_seqlens, pack.cu_seqlens_comp, total_comp=pack.total_comp)
    (pooled.float() * pack.grad_out.float()).sum().backward()


@pytest.mark.L0
def test_calls_with_total_comp_given_never_synchronise():
    pack, side = _pack(1), torch.cuda.Stream()
    _every_call(pack, side)  # warm-up: compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _every_call(pack, side)
        # the check is live: the documented synchronising calls do trip it
        with pytest.raises(RuntimeError, match="synchroniz"):
            csa_compressor_forward_wrapper(*pack.inputs, ratio=RATIO)
        with pytest.raises(RuntimeError, match="synchroniz"):
            csa_compressor_forward_wrapper(*pack.inputs, ratio=RATIO, total_comp=pack.total_comp, validate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- determinism guard -----------------------------------------------------------------------------

@pytest.mark.L0
def test_nondeterministic_backward_raises_under_deterministic_algorithms():
    pack = _pack(1)
    grads = [sentinel_like(t) for t in (pack.kv, pack.score, pack.ape)]
    before = [g.clone() for g in grads]
    op = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, ratio=RATIO, coff=COFF, deterministic=False)
    op.compile()
    kv, score, ape = _leaves(pack)
    pooled = csa_compress(kv, score, ape, pack.cu_seqlens, pack.cu_seqlens_comp, total_comp=pack.total_comp,
                          deterministic=False)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic=False"):
        csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=RATIO, deterministic=False)
    with pytest.raises(RuntimeError, match="deterministic=False"):
        op.execute(*pack.inputs, pack.grad_out, *grads)
    assert all(torch.equal(g, b) for g, b in zip(grads, before)), "gradients written before the error"
    with pytest.raises(RuntimeError, match="deterministic=False"):
        pooled.backward(pack.grad_out)
    csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=RATIO)  # the default path runs


@pytest.mark.L0
def test_nondeterministic_backward_warns_and_runs_in_warn_only_mode():
    pack = _pack(1)
    exact = csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, ratio=RATIO)
    grads = [torch.empty_like(t) for t in (pack.kv, pack.score, pack.ape)]
    op = CSACompressorBackward(*pack.inputs, pack.grad_out, *grads, ratio=RATIO, coff=COFF, deterministic=False)
    op.compile()
    leaves = _leaves(pack)
    pooled = csa_compress(*leaves, pack.cu_seqlens, pack.cu_seqlens_comp, total_comp=pack.total_comp,
                          deterministic=False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match="deterministic=False"):
        op.execute(*pack.inputs, pack.grad_out, *grads)
    with pytest.warns(UserWarning, match="deterministic=False"):
        pooled.backward(pack.grad_out)
    for result in (grads, [t.grad for t in leaves]):
        assert torch.equal(result[0], exact["grad_kv"]) and torch.equal(result[1], exact["grad_score"])
        torch.testing.assert_close(result[2], exact["grad_ape"], rtol=1e-5,
                                   atol=1e-5 * float(exact["grad_ape"].abs().max()))
