"""Reliability on CPU (issue 6): int32 extent limits planned from ``meta`` samples, offset
content errors naming the first bad index, and concurrent calls of mixed configurations.
The CUDA side of each lives in ``test_reliability_gpu.py``."""
from collections import Counter

import pytest
import torch

import csa_frontend.compressor.api as api
from csa_frontend import CSACompressorBackward, CSACompressorForward
from csa_frontend.compressor.plan import INT32_LIMIT
from csa_testing import (BAD_OFFSETS, THREAD_CONFIGS, assert_like_reference, assert_offsets_rejected,
                         bad_offset_pack, compile_log_descriptions, concurrent_wrapper_calls)


def _meta_op(direction, tokens, rows, ratio, coff, head_dim):
    """An operator planned from meta samples: nothing is allocated, whatever the extents."""
    cols = coff * head_dim
    kv = torch.empty(tokens, cols, dtype=torch.bfloat16, device="meta")
    ape = torch.empty(ratio, cols, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    rows_t = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="meta")
    if direction == "forward":
        return CSACompressorForward(kv, kv, ape, cu, cu, rows_t, ratio=ratio, coff=coff)
    return CSACompressorBackward(kv, kv, ape, cu, cu, rows_t, kv, kv, ape, ratio=ratio, coff=coff)


@pytest.mark.L0
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("ratio,coff,head_dim", [(4, 2, 128), (128, 1, 512), (3, 2, 65)])
def test_token_extent_at_the_int32_limit(direction, ratio, coff, head_dim):
    """T*coff*head_dim = 2**31 - coff*head_dim is accepted; the next token count is the clear error."""
    cols = coff * head_dim
    below = INT32_LIMIT // cols - (1 if INT32_LIMIT % cols == 0 else 0)
    assert below * cols < INT32_LIMIT <= (below + 1) * cols
    assert _meta_op(direction, below, below // ratio, ratio, coff, head_dim).check_support()
    with pytest.raises(ValueError, match=rf"kv: expected T\*coff\*head_dim < 2\*\*31 \(int32 offsets\), "
                                         rf"got {(below + 1) * cols}"):
        _meta_op(direction, below + 1, 16, ratio, coff, head_dim).check_support()


@pytest.mark.L0
@pytest.mark.parametrize("direction,name", [("forward", "out"), ("backward", "grad_out")])
def test_row_extent_at_the_int32_limit(direction, name):
    """total_comp*head_dim = 2**31 - head_dim is accepted; one more row is the clear error."""
    head_dim = 128
    below = INT32_LIMIT // head_dim - 1
    assert _meta_op(direction, 64, below, 4, 2, head_dim).check_support()
    with pytest.raises(ValueError, match=rf"{name}\.shape\[0\]: expected total_comp\*head_dim < 2\*\*31 "
                                         rf"\(int32 offsets\), got {INT32_LIMIT}"):
        _meta_op(direction, 64, below + 1, 4, 2, head_dim).check_support()


@pytest.mark.L0
@pytest.mark.parametrize("cu_edits,comp_edits,total_comp,message", BAD_OFFSETS)
def test_bad_offsets_name_the_first_bad_index(cu_edits, comp_edits, total_comp, message):
    """CPU tensors always have their offsets checked, through every route that reads them."""
    assert_offsets_rejected(bad_offset_pack(cu_edits, comp_edits, total_comp, "cpu"), None, message)


@pytest.mark.L0
def test_concurrent_mixed_configurations_build_each_operator_once(csa_log):
    for pack, out, grads in concurrent_wrapper_calls("cpu"):
        assert_like_reference(pack, out, grads)
    built = Counter(compile_log_descriptions(csa_log.records))
    assert len(built) == 2 * len(THREAD_CONFIGS) and set(built.values()) == {1}, built
    assert len(api._op_cache) == 2 * len(THREAD_CONFIGS)


@pytest.mark.L0
def test_kernel_cache_is_bounded_and_least_recently_used_goes_first(monkeypatch):
    """The compiled-kernel cache keeps KERNEL_CACHE_SIZE entries; a hit refreshes an entry."""
    from csa_frontend.compressor.kernels import dispatch

    monkeypatch.setattr(dispatch, "KERNEL_CACHE_SIZE", 2)
    dispatch.clear_cache()
    builds = Counter()

    def get(name):
        def build():
            builds[name] += 1
            return lambda: name
        return dispatch._compiled(("fwd", "sm_90a", name), build)

    try:
        get("a"), get("b"), get("a"), get("c")  # the hit on "a" makes "b" the oldest
        assert [k[2] for k in dispatch.cache_keys()] == ["a", "c"]
        get("a"), get("b")
        assert builds == Counter(a=1, b=2, c=1)
    finally:
        dispatch.clear_cache()
