"""The GPU fuzz test's case generator (``packs.draw_fuzz_case``), on the CPU."""
import threading
import time

import pytest

from csa_frontend.compressor.kernels.schedule import choose_schedule
from gpu.packs import (BIG_CASE_SLOTS, COLD_CONFIGS, FUZZ_CASES, LONG_ROWS, SHORT_BUDGET, big_case_slot,
                       draw_fuzz_case, fuzz_seeds)


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


@pytest.mark.L0
def test_fuzz_seed_range_from_env(monkeypatch):
    monkeypatch.delenv("CSA_FRONTEND_FUZZ_SEEDS", raising=False)
    assert fuzz_seeds() == range(FUZZ_CASES)
    monkeypatch.setenv("CSA_FRONTEND_FUZZ_SEEDS", "48-447")
    assert fuzz_seeds() == range(48, 448)
    for bad in ("48", "x-9", "9-3", "-5"):
        monkeypatch.setenv("CSA_FRONTEND_FUZZ_SEEDS", bad)
        with pytest.raises(ValueError, match="CSA_FRONTEND_FUZZ_SEEDS"):
            fuzz_seeds()


@pytest.mark.L0
def test_draws_are_packs_the_operator_accepts():
    """The GPU fuzz calls the kernels directly, past the operator's checks, so the generator must
    not draw what ``check_support`` rejects: padding rows in a pack of fewer than ``ratio`` tokens
    (they pool tokens 0..ratio-1) read past kv. Seeds 289 and 283 once drew such packs."""
    for seed in range(2000):
        ratio, _, _, lengths, pad_rows, extra_tokens = draw_fuzz_case(seed)
        assert pad_rows == 0 or sum(lengths) + extra_tokens >= ratio, seed


@pytest.mark.L0
def test_big_cases_share_a_few_slots_and_small_ones_never_wait():
    """At most BIG_CASE_SLOTS big cases hold a slot at once (the locks are per open file, so
    threads contend as xdist workers do); a small case runs while every slot is held."""
    inside, most, lock, release = [0], [0], threading.Lock(), threading.Event()

    def big_case():
        with big_case_slot(SHORT_BUDGET + 1):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            release.wait(30)
            with lock:
                inside[0] -= 1

    def small_case():
        with big_case_slot(SHORT_BUDGET):
            pass

    threads = [threading.Thread(target=big_case) for _ in range(BIG_CASE_SLOTS + 2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while inside[0] < BIG_CASE_SLOTS and time.monotonic() < deadline:
        time.sleep(0.01)
    small = threading.Thread(target=small_case)
    small.start()
    small.join(30)
    held_while_small_ran = inside[0]
    release.set()
    for t in threads:
        t.join(30)
    assert not small.is_alive() and held_while_small_ran == BIG_CASE_SLOTS
    assert most[0] == BIG_CASE_SLOTS and inside[0] == 0
