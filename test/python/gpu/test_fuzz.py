"""Seeded random configurations through both directions, against the reference.

The matrix tests pin the configurations we tune and the edges we know of; these draw the ones
nobody picked (``packs.draw_fuzz_case``): any ratio 1..256, coff 1 or 2, any head_dim up to 4096
(odd ones too), ragged packs of empty, short, exact and tail segments, padding rows and tokens
past the last segment, and now and then a pack long enough for the schedules only long
launches take (bulk-copy forward, interleaved backward rows, many rows per stream CTA). Every
case runs on the default planner, under its family's contract per direction (``check_pack``),
its backward again atomically and without grad_ape (``check_backward_variants``), and both
directions through ``csa_compress``, which must carry the kernel launches' bits.
A case is a pure function of its seed, so a failure reruns alone with ``-k "seed17-"``;
``CSA_FRONTEND_FUZZ_SEEDS=48-447`` runs a deeper campaign (``packs.fuzz_seeds``).
"""
from __future__ import annotations

import pytest
import torch

from csa_frontend.compressor.kernels.schedule import choose_schedule

from .packs import big_case_slot, draw_fuzz_case, fuzz_seeds
from .test_fused_kernels import check_pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def case_id(seed: int) -> str:
    ratio, coff, head_dim, lengths, _, _ = draw_fuzz_case(seed)
    return f"seed{seed}-r{ratio}c{coff}d{head_dim}-{len(lengths)}seg-{sum(lengths)}tok"


@pytest.mark.L1
@pytest.mark.parametrize("seed", fuzz_seeds(), ids=case_id)
def test_fuzz(seed):
    ratio, coff, head_dim, lengths, pad_rows, extra_tokens = draw_fuzz_case(seed)
    with big_case_slot((sum(lengths) + extra_tokens) * coff * head_dim):
        check_pack(ratio, coff, head_dim, lengths, pad_rows=pad_rows, seed=seed, extra_tokens=extra_tokens,
                   fwd_exact=choose_schedule(ratio, coff, head_dim, "fwd").family == "window",
                   bwd_exact=choose_schedule(ratio, coff, head_dim, "bwd").family == "window", variants=True)
