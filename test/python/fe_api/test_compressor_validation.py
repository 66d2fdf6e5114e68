"""Malformed inputs: each raises ValueError/RuntimeError naming the argument and the expected
value, before any work runs, through every route that takes the argument; outputs stay untouched.

A case mutates a valid call. The routes follow from what it mutates: inputs reach both wrappers
and both classes' ``execute``; ``out`` the forward class; ``grad_out`` the backward wrapper and
class; scalars the wrappers and the class constructors (raised by ``check_support``).
"""
import pytest
import torch

from csa_frontend import (CSACompressorBackward, CSACompressorForward, csa_compressor_backward_wrapper,
                          csa_compressor_forward_wrapper)
from csa_testing import make_pack, sentinel_like

RATIO, COFF, HEAD_DIM = 4, 2, 64
INPUTS = ("kv", "score", "ape", "cu_seqlens", "cu_seqlens_comp")
GRADS = ("grad_kv", "grad_score", "grad_ape")
SCALARS = ("ratio", "coff", "head_dim", "validate")


def valid_call():
    pack = make_pack([9, 0, 6, 13], RATIO, COFF, HEAD_DIM, extra_tokens=2, extra_rows=1, seed=1)
    call = dict(zip(INPUTS, pack.inputs), ratio=RATIO, coff=COFF, head_dim=None, total_comp=pack.total_comp,
                grad_out=pack.grad_out)
    call["out"] = sentinel_like(torch.empty(pack.total_comp, HEAD_DIM, dtype=torch.bfloat16))
    for name, like in zip(GRADS, (pack.kv, pack.score, pack.ape)):
        call[name] = sentinel_like(like)
    return call


# -- ways to break a tensor --------------------------------------------------------------------

def non_contiguous(t):
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def misaligned(t):
    """Same values, data_ptr one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 16, dtype=t.dtype)
    view = flat[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def retyped(dtype):
    return lambda t: t.to(dtype)


def set_item(index, value):
    def edit(t):
        t = t.clone()
        t[index] = value
        return t
    return edit


def case(id, key, edit, exc, *needles, routes=None):
    """``edit`` maps the valid value of ``key`` to the malformed one; ``needles`` must all
    appear in the message (the first one names the argument)."""
    return pytest.param(key, edit, exc, needles, routes, id=id)


CASES = [
    # dtypes
    case("kv-float32", "kv", retyped(torch.float32), ValueError, "kv: expected dtype torch.bfloat16, got torch.float32"),
    case("kv-float16", "kv", retyped(torch.float16), ValueError, "kv: expected dtype torch.bfloat16"),
    case("score-float32", "score", retyped(torch.float32), ValueError, "score: expected dtype torch.bfloat16"),
    case("ape-bfloat16", "ape", retyped(torch.bfloat16), ValueError, "ape: expected dtype torch.float32"),
    case("ape-float64", "ape", retyped(torch.float64), ValueError, "ape: expected dtype torch.float32"),
    case("cu_seqlens-int64", "cu_seqlens", retyped(torch.int64), ValueError, "cu_seqlens: expected dtype torch.int32"),
    case("cu_seqlens_comp-int64", "cu_seqlens_comp", retyped(torch.int64), ValueError,
         "cu_seqlens_comp: expected dtype torch.int32"),
    case("grad_out-float32", "grad_out", retyped(torch.float32), ValueError, "grad_out: expected dtype torch.bfloat16"),
    case("out-float32", "out", retyped(torch.float32), ValueError, "out: expected dtype torch.bfloat16"),
    case("grad_kv-float32", "grad_kv", retyped(torch.float32), ValueError, "grad_kv: expected dtype torch.bfloat16"),
    case("grad_score-float16", "grad_score", retyped(torch.float16), ValueError, "grad_score: expected dtype"),
    case("grad_ape-bfloat16", "grad_ape", retyped(torch.bfloat16), ValueError, "grad_ape: expected dtype torch.float32"),
    # ranks and shapes
    case("kv-1d", "kv", lambda t: t.flatten(), ValueError, "kv: expected a 2-D tensor"),
    case("kv-3d", "kv", lambda t: t.reshape(t.shape[0], 2, -1), ValueError, "kv: expected a 2-D tensor"),
    case("score-rows", "score", lambda t: torch.cat([t, t[:1]]), ValueError, "score: expected shape (T, coff*head_dim)"),
    case("score-cols", "score", lambda t: t[:, :-8].contiguous(), ValueError, "score: expected shape", "128"),
    case("ape-rows", "ape", lambda t: t[:-1].contiguous(), ValueError,
         "ape: expected shape (ratio, coff*head_dim) = (4, 128)"),
    case("ape-cols", "ape", lambda t: torch.cat([t, t], 1), ValueError, "ape: expected shape", "(4, 128)"),
    case("ape-1d", "ape", lambda t: t.flatten(), ValueError, "ape: expected a 2-D tensor"),
    case("cu_seqlens-2d", "cu_seqlens", lambda t: t[None], ValueError, "cu_seqlens: expected a 1-D tensor"),
    case("cu_seqlens-empty", "cu_seqlens", lambda t: t[:0], ValueError, "cu_seqlens: expected at least 1 element"),
    case("cu_seqlens_comp-length", "cu_seqlens_comp", lambda t: t[:-1], ValueError,
         "cu_seqlens_comp: expected shape (len(cu_seqlens),) = (5,), got (4,)"),
    case("grad_out-cols", "grad_out", lambda t: t[:, :-1].contiguous(), ValueError,
         "grad_out: expected shape (total_comp, head_dim)", "64"),
    case("out-cols", "out", lambda t: torch.cat([t, t], 1), ValueError, "out: expected shape (total_comp, head_dim)"),
    case("grad_kv-rows", "grad_kv", lambda t: t[1:].contiguous(), ValueError, "grad_kv: expected shape"),
    case("grad_ape-rows", "grad_ape", lambda t: torch.cat([t, t]), ValueError, "grad_ape: expected shape (ratio"),
    # layout
    case("kv-strided", "kv", non_contiguous, ValueError, "kv: expected a contiguous"),
    case("score-strided", "score", non_contiguous, ValueError, "score: expected a contiguous"),
    case("ape-strided", "ape", non_contiguous, ValueError, "ape: expected a contiguous"),
    case("cu_seqlens-strided", "cu_seqlens", lambda t: torch.stack([t, t], 1)[:, 0], ValueError,
         "cu_seqlens: expected a contiguous"),
    case("grad_out-strided", "grad_out", non_contiguous, ValueError, "grad_out: expected a contiguous"),
    case("out-strided", "out", non_contiguous, ValueError, "out: expected a contiguous"),
    case("grad_score-strided", "grad_score", non_contiguous, ValueError, "grad_score: expected a contiguous"),
    case("kv-misaligned", "kv", misaligned, ValueError, "kv: expected data_ptr aligned to 16 bytes", "2 bytes"),
    case("score-misaligned", "score", misaligned, ValueError, "score: expected data_ptr aligned to 16 bytes"),
    case("ape-misaligned", "ape", misaligned, ValueError, "ape: expected data_ptr aligned to 16 bytes", "4 bytes"),
    case("cu_seqlens_comp-misaligned", "cu_seqlens_comp", misaligned, ValueError,
         "cu_seqlens_comp: expected data_ptr aligned"),
    case("grad_out-misaligned", "grad_out", misaligned, ValueError, "grad_out: expected data_ptr aligned"),
    case("out-misaligned", "out", misaligned, ValueError, "out: expected data_ptr aligned"),
    case("grad_ape-misaligned", "grad_ape", misaligned, ValueError, "grad_ape: expected data_ptr aligned"),
    # types and devices
    case("kv-list", "kv", lambda t: t.tolist(), ValueError, "kv: expected a torch.Tensor, got list"),
    case("ape-none", "ape", lambda t: None, ValueError, "ape: expected a torch.Tensor, got NoneType"),
    case("score-meta", "score", lambda t: t.to("meta"), ValueError, "score: expected device cpu", "got meta"),
    case("grad_out-meta", "grad_out", lambda t: t.to("meta"), ValueError, "grad_out: expected device cpu"),
    # offset contents
    case("cu_seqlens-start", "cu_seqlens", set_item(0, 1), ValueError, "cu_seqlens: expected cu_seqlens[0] == 0, got 1"),
    case("cu_seqlens-decreasing", "cu_seqlens", set_item(2, 3), ValueError,
         "cu_seqlens: expected non-decreasing offsets, got cu_seqlens[2] = 3 < cu_seqlens[1] = 9"),
    case("cu_seqlens-beyond-T", "cu_seqlens", set_item(4, 31), ValueError,
         "cu_seqlens: expected cu_seqlens[4] <= T = kv.shape[0] = 30", "got 31"),
    case("cu_seqlens_comp-start", "cu_seqlens_comp", set_item(0, 1), ValueError,
         "cu_seqlens_comp: expected cu_seqlens_comp[0] == 0"),
    case("cu_seqlens_comp-mismatch", "cu_seqlens_comp", set_item(3, 4), ValueError,
         "cu_seqlens_comp: expected cu_seqlens_comp[3] == 3", "got 4"),
    case("total_comp-too-small", "total_comp", lambda v: v - 2, ValueError,
         "total_comp: expected total_comp >= cu_seqlens_comp[-1] = 6, got 5"),
    case("out-too-few-rows", "out", lambda t: t[:4], ValueError,
         "out.shape[0]: expected total_comp >= cu_seqlens_comp[-1] = 6, got 4"),
    case("grad_out-too-few-rows", "grad_out", lambda t: t[:3], ValueError,
         "grad_out.shape[0]: expected total_comp >= cu_seqlens_comp[-1] = 6, got 3"),
    case("total_comp-negative", "total_comp", lambda v: -1, ValueError, "total_comp: expected an int in [0,"),
    case("total_comp-bool", "total_comp", lambda v: True, ValueError, "total_comp: expected an int", "True"),
    case("total_comp-float", "total_comp", lambda v: 6.0, ValueError, "total_comp: expected an int", "6.0"),
    case("total_comp-int32", "total_comp", lambda v: 2**31 // HEAD_DIM, ValueError,
         "total_comp: expected total_comp*head_dim < 2**31"),
    # scalar envelope
    case("ratio-zero", "ratio", lambda v: 0, ValueError, "ratio: expected an int in [1, 256], got 0"),
    case("ratio-257", "ratio", lambda v: 257, ValueError, "ratio: expected an int in [1, 256], got 257"),
    case("ratio-bool", "ratio", lambda v: True, ValueError, "ratio: expected an int in [1, 256], got True"),
    case("ratio-float", "ratio", lambda v: 4.0, ValueError, "ratio: expected an int", "4.0"),
    case("coff-3", "coff", lambda v: 3, ValueError, "coff: expected 1 or 2, got 3"),
    case("coff-0", "coff", lambda v: 0, ValueError, "coff: expected 1 or 2, got 0"),
    case("coff-bool", "coff", lambda v: True, ValueError, "coff: expected 1 or 2, got True"),
    case("head_dim-zero", "head_dim", lambda v: 0, ValueError, "head_dim: expected an int in [1, 4096], got 0"),
    case("head_dim-4097", "head_dim", lambda v: 4097, ValueError, "head_dim: expected an int in [1, 4096], got 4097"),
    case("head_dim-mismatch", "head_dim", lambda v: 63, ValueError,
         "kv: expected shape (T, coff*head_dim) = (T, 126), got (30, 128)"),
    case("validate-string", "validate", lambda v: "yes", ValueError, "validate: expected True or False"),
    case("deterministic-int", "deterministic", lambda v: 0, ValueError, "deterministic: expected True or False"),
    case("stream-string", "stream", lambda v: "default", ValueError,
         "stream: expected a torch.cuda.Stream or None, got str"),
]


def _routes(key):
    if key in INPUTS or key == "stream":
        return ("fwd_wrapper", "bwd_wrapper", "fwd_class", "bwd_class")
    if key in SCALARS:
        return ("fwd_wrapper", "bwd_wrapper", "fwd_init", "bwd_init")
    return {"out": ("fwd_class",), "grad_out": ("bwd_wrapper", "bwd_class"), "total_comp": ("fwd_wrapper",),
            "deterministic": ("bwd_wrapper", "bwd_init")}.get(key, ("bwd_class",))


def _run(route, call, good):
    """Run one route with ``call``'s arguments; class routes are planned from the valid call."""
    inputs = [call[k] for k in INPUTS]
    scalars = {k: call[k] for k in ("ratio", "coff", "head_dim") if k in call}
    extra = {k: call[k] for k in ("validate",) if k in call}
    if route == "fwd_wrapper":
        csa_compressor_forward_wrapper(*inputs, total_comp=call["total_comp"], stream=call.get("stream"),
                                       **scalars, **extra)
    elif route == "bwd_wrapper":
        csa_compressor_backward_wrapper(*inputs, call["grad_out"], stream=call.get("stream"),
                                        deterministic=call.get("deterministic", True), **scalars, **extra)
    elif route.endswith("_init"):
        samples = [good[k] for k in INPUTS]
        kw = dict(scalars, **extra)
        if route == "fwd_init":
            CSACompressorForward(*samples, good["out"], **kw).check_support()
        else:
            kw["deterministic"] = call.get("deterministic", True)
            CSACompressorBackward(*samples, good["grad_out"], *[good[k] for k in GRADS], **kw).check_support()
    elif route == "fwd_class":
        op = CSACompressorForward(*[good[k] for k in INPUTS], good["out"], ratio=RATIO, coff=COFF)
        op.compile()
        op.execute(*inputs, call["out"], current_stream=call.get("stream"))
    else:
        op = CSACompressorBackward(*[good[k] for k in INPUTS], good["grad_out"], *[good[k] for k in GRADS],
                                   ratio=RATIO, coff=COFF)
        op.compile()
        op.execute(*inputs, call["grad_out"], *[call[k] for k in GRADS], current_stream=call.get("stream"))


@pytest.mark.L0
@pytest.mark.parametrize("key,edit,exc,needles,routes", CASES)
def test_malformed_input_is_rejected(key, edit, exc, needles, routes):
    good = valid_call()
    bad = valid_call()
    bad[key] = edit(bad.get(key))
    outputs = {k: bad[k] for k in ("out", *GRADS) if isinstance(bad[k], torch.Tensor) and bad[k].device.type == "cpu"}
    before = {k: v.clone() for k, v in outputs.items()}
    for route in routes or _routes(key):
        with pytest.raises(exc) as info:
            _run(route, bad, good)
        message = str(info.value)
        for needle in needles:
            assert needle in message, f"{route}: {needle!r} not in {message!r}"
        for name, t in outputs.items():
            assert torch.equal(t, before[name]), f"{route}: {name} was written before the rejection"


@pytest.mark.L0
def test_case_count():
    assert len(CASES) >= 40


@pytest.mark.L0
def test_inferred_head_dim_needs_a_multiple_of_coff():
    call = valid_call()
    kv = torch.randn(30, 129).bfloat16()
    with pytest.raises(ValueError, match=r"head_dim: expected an int in \[1, 4096\] inferred as kv.shape\[1\] // coff"):
        csa_compressor_forward_wrapper(kv, kv, call["ape"], call["cu_seqlens"], call["cu_seqlens_comp"], ratio=RATIO)


@pytest.mark.L0
def test_int32_token_extent_is_checked_on_meta_samples():
    """T*coff*head_dim >= 2**31 is rejected from descriptors alone, before anything is allocated."""
    tokens = 2**31 // 128 + 1
    kv = torch.empty(tokens, 128, dtype=torch.bfloat16, device="meta")
    ape = torch.empty(4, 128, device="meta")
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    out = torch.empty(tokens // 4, 64, dtype=torch.bfloat16, device="meta")
    op = CSACompressorForward(kv, kv, ape, cu, cu, out, ratio=4, coff=2)
    with pytest.raises(ValueError, match=r"kv: expected T\*coff\*head_dim < 2\*\*31 \(int32 offsets\), got 2147483776"):
        op.check_support()
    with pytest.raises(ValueError, match=r"kv: expected T\*coff\*head_dim < 2\*\*31"):
        csa_compressor_forward_wrapper(kv, kv, ape, cu, cu, ratio=4, total_comp=1)


@pytest.mark.L0
def test_too_few_tokens_for_padding_rows():
    pack = make_pack([3], 4, 2, 8)
    with pytest.raises(ValueError, match=r"kv: expected at least ratio=4 tokens when total_comp=1 > 0"):
        csa_compressor_forward_wrapper(*pack.inputs, ratio=4, total_comp=1)
    # With no rows at all, a pack shorter than ratio is fine.
    assert csa_compressor_forward_wrapper(*pack.inputs, ratio=4)["out"].shape == (0, 8)


@pytest.mark.L0
def test_execute_checks_tensors_against_the_plan():
    call = valid_call()
    op = CSACompressorForward(*[call[k] for k in INPUTS], call["out"], ratio=RATIO, coff=COFF)
    op.compile()
    other = make_pack([9, 6], RATIO, 1, 2 * HEAD_DIM)  # same kv width, other coff/head_dim
    out = sentinel_like(torch.empty(other.total_comp, 2 * HEAD_DIM, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out: expected shape \(total_comp, head_dim\) = \(total_comp, 64\)"):
        op.execute(*other.inputs, out)
    assert bool((out == -7).all())
    # A planned ratio is static too: ape rows.
    small = make_pack([9, 6], 2, COFF, HEAD_DIM)
    with pytest.raises(ValueError, match=r"ape: expected shape \(ratio, coff\*head_dim\) = \(4, 128\)"):
        op.execute(*small.inputs, torch.empty(small.total_comp, HEAD_DIM, dtype=torch.bfloat16))


@pytest.mark.L0
def test_execute_rejects_tensors_on_another_device_than_planned():
    call = valid_call()
    op = CSACompressorForward(*[call[k] for k in INPUTS], call["out"], ratio=RATIO, coff=COFF)
    op.compile()
    meta = [call[k].to("meta") for k in INPUTS]
    with pytest.raises(ValueError, match=r"kv: expected device cpu \(the device this operator was planned for\), "
                                         r"got meta"):
        op.execute(*meta, call["out"].to("meta"))


@pytest.mark.L0
def test_device_request_must_match_real_samples():
    call = valid_call()
    with pytest.raises(ValueError, match=r"device: expected None or cpu \(the samples' device\), got meta"):
        CSACompressorForward(*[call[k] for k in INPUTS], call["out"], device="meta").check_support()


@pytest.mark.L0
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_meta_samples_planned_for_cuda_without_cuda():
    call = valid_call()
    samples = [call[k].to("meta") for k in (*INPUTS, "out")]
    with pytest.raises(RuntimeError, match="device: expected an available CUDA device"):
        CSACompressorForward(*samples, device="cuda").check_support()
