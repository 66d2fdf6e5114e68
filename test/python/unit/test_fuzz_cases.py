"""The GPU fuzz test's case generator (``packs.draw_fuzz_case``), on the CPU."""
import pytest

from csa_frontend.compressor.kernels.schedule import choose_schedule
from gpu.packs import COLD_CONFIGS, FUZZ_CASES, LONG_ROWS, draw_fuzz_case


@pytest.mark.L0
def test_draws_are_pure_and_cover_the_surface():
    """CPU check of the generator: a seed always draws the same case, and the cases together
    reach both families in both directions, odd head_dims, empty segments and long packs."""
    cases = [draw_fuzz_case(s) for s in range(FUZZ_CASES)]
    assert cases == [draw_fuzz_case(s) for s in range(FUZZ_CASES)]
    fams = {(choose_schedule(r, c, d, "fwd").family, choose_schedule(r, c, d, "bwd").family)
            for r, c, d, *_ in cases}
    assert ("window", "window") in fams and ("stream", "stream") in fams
    assert any(d % 2 for _, _, d, *_ in cases)
    assert any(0 in lengths for *_, lengths, _, _ in cases)
    assert any(sum(n // r for n in lengths) >= LONG_ROWS[0] for r, _, _, lengths, _, _ in cases)
    assert all(1 <= r <= 256 and c in (1, 2) and 1 <= d <= 4096 for r, c, d, *_ in cases)
    assert not any((r, c, d) in COLD_CONFIGS for r, c, d, *_ in cases)
