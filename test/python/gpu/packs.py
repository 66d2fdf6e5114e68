"""Pack builders shared by the GPU tests and the benchmark: offsets from segment lengths, random
inputs, and the fuzz test's seeded random cases."""
from __future__ import annotations

import contextlib
import fcntl
import os
import random
import tempfile
import time
from typing import List, Sequence

import torch


def offsets(lengths: Sequence[int], ratio: int, device="cuda"):
    """``cu_seqlens``, ``cu_seqlens_comp`` (int32) for segments of the given lengths."""
    cu = [0]
    comp = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        comp.append(comp[-1] + n // ratio)
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)
    return as_i32(cu), as_i32(comp)


def edge_lengths(ratio: int) -> List[int]:
    """Ragged pack with tails, an empty segment and segments shorter than ratio."""
    return [3 * ratio + 1, 0, max(ratio - 1, 0), 5 * ratio, 1, 2 * ratio + ratio // 2 + 1, ratio]


def random_inputs(n_tok: int, ratio: int, coff: int, head_dim: int, device="cuda", generator=None):
    """Fresh random kv, score (bf16) and ape (fp32); never zeros."""
    cols = coff * head_dim
    kv = torch.randn(n_tok, cols, device=device, generator=generator).to(torch.bfloat16)
    score = (2 * torch.randn(n_tok, cols, device=device, generator=generator)).to(torch.bfloat16)
    ape = 0.5 * torch.randn(ratio, cols, device=device, generator=generator)
    return kv, score, ape


def cancel_windows(kv, score, ape, cu, comp, ratio: int, coff: int, head_dim: int):
    """In place: each window's last own kv element (per column) set so that the window's
    softmax-weighted sum nearly cancels (exactly in fp64 before the bf16 rounding of that one
    element, clamped to +-8). Outputs then sit near zero, where the forward's fast pooling
    cannot bound its error and must pool exactly."""
    d = head_dim
    s64 = score.double()
    for seg in range(cu.numel() - 1):
        t0, n = int(cu[seg]), int(comp[seg + 1] - comp[seg])
        if n == 0:
            continue
        own = t0 + ratio * torch.arange(n, device=kv.device)[:, None] + torch.arange(ratio, device=kv.device)
        kv64 = kv.double()
        if coff == 1:
            k, s, cols = kv64[own][..., :d], s64[own][..., :d] + ape[:, :d], slice(0, d)
        else:
            prev = (own - ratio).clamp(min=0)
            kp, sp = kv64[prev][..., :d].clone(), s64[prev][..., :d] + ape[:, :d]
            kp[0], sp[0] = 0.0, float("-inf")  # a segment's first block has no previous block
            k = torch.cat([kp, kv64[own][..., d:]], 1)
            s = torch.cat([sp, s64[own][..., d:] + ape[:, d:]], 1)
            cols = slice(d, 2 * d)
        p = torch.softmax(s, dim=1)
        rest = (k[:, :-1] * p[:, :-1]).sum(1)
        kv[own[:, -1], cols] = (-rest / p[:, -1]).clamp(-8, 8).to(kv.dtype)


#: (ratio, coff, head_dim) of the tests that need a configuration not yet compiled in their
#: process (compile under capture); no other test may use them.
COLD_CONFIG_CAPTURE = (96, 2, 128)
COLD_CONFIG_RAISE = (5, 1, 96)
COLD_CONFIGS = (COLD_CONFIG_CAPTURE, COLD_CONFIG_RAISE)

#: seeds the GPU fuzz test draws
FUZZ_CASES = 48

#: kv elements (tokens x coff*head_dim) a short case may allocate; the fp64 oracle multiplies it
SHORT_BUDGET = 6_000_000
#: rows of a long case: enough for the long-launch schedules (bulk-copy forward, interleaved backward)
LONG_ROWS = (4300, 6500)


def fuzz_seeds() -> range:
    """The seeds the GPU fuzz test runs: ``range(FUZZ_CASES)``, or a deeper campaign on the
    device from ``CSA_FRONTEND_FUZZ_SEEDS=first-last`` (inclusive), e.g. ``48-447``."""
    spec = os.environ.get("CSA_FRONTEND_FUZZ_SEEDS", "")
    if not spec:
        return range(FUZZ_CASES)
    first, sep, last = spec.partition("-")
    if not (sep and first.isdigit() and last.isdigit() and int(first) <= int(last)):
        raise ValueError(f"CSA_FRONTEND_FUZZ_SEEDS: expected 'first-last' (e.g. 48-447), got {spec!r}")
    return range(int(first), int(last) + 1)


def draw_fuzz_case(seed: int):
    """(ratio, coff, head_dim, lengths, pad_rows, extra_tokens) of one seed."""
    rng = random.Random(seed)
    if rng.random() < 0.2:
        return _draw_long_fuzz_case(rng)
    while True:
        ratio = rng.choice([rng.randint(1, 8), rng.randint(9, 64), rng.randint(65, 256), 4, 128])
        coff = rng.choice([1, 2])
        head_dim = rng.choice([rng.randrange(2, 258, 2), rng.randrange(258, 1026, 2), rng.randint(1, 300), 512,
                               rng.randrange(1026, 4098, 2)])
        if (ratio, coff, head_dim) not in COLD_CONFIGS:
            break
    edges = [0, max(ratio - 1, 0), ratio, ratio + 1]
    lengths = []
    for _ in range(rng.randint(1, 12)):
        if rng.random() < 0.5:
            lengths.append(rng.choice(edges))
        else:
            lengths.append(rng.randint(0, rng.choice([6, 40]) * ratio + 7))
    # keep the pack (and the oracle's float64 copies) small: drop segments from the end
    cols = coff * head_dim
    while len(lengths) > 1 and sum(lengths) * cols > SHORT_BUDGET:
        lengths.pop()
    lengths[0] = min(lengths[0], SHORT_BUDGET // cols)
    pad_rows, extra_tokens = rng.choice([0, 0, 1, 3]), rng.choice([0, 1, 5])
    if sum(lengths) + extra_tokens < ratio:
        # padding rows pool tokens 0..ratio-1: the operator rejects them in a shorter pack
        # (``plan.check_rows``), and the kernels are never launched on one
        pad_rows = 0
    return ratio, coff, head_dim, lengths, pad_rows, extra_tokens


def _draw_long_fuzz_case(rng: random.Random):
    """Many rows of a small ratio at a wide head_dim (register-window family), in segments of
    mixed lengths, so the long-launch schedules run across segment boundaries."""
    ratio = rng.choice([1, 2, 3, 4, 4])
    coff = rng.choice([1, 2, 2])
    head_dim = rng.choice([512, 520, 768, 1024])
    rows = rng.randint(*LONG_ROWS)
    lengths = []
    while sum(n // ratio for n in lengths) < rows:
        lengths.append(rng.choice([0, ratio - 1, rng.randint(ratio, 64 * ratio + 3), rng.randint(ratio, 2048 * ratio)]))
    return ratio, coff, head_dim, lengths, rng.choice([0, 2]), rng.choice([0, 3])


#: big cases that may run at once, one per lock file: two of them plus fifteen workers' cached
#: blocks ran an 80 GB card out of memory (session 56); three with the caches handed back fit
BIG_CASE_SLOTS = 3


@contextlib.contextmanager
def big_case_slot(kv_elements: int):
    """Holds one of BIG_CASE_SLOTS file locks (shared by the xdist workers) while a case of more
    than SHORT_BUDGET kv elements runs, since its float64 oracle takes gigabytes; every case
    hands its cached blocks back after, so that idle workers do not hoard what big ones need."""
    with _first_free_lock() if kv_elements > SHORT_BUDGET else contextlib.nullcontext():
        try:
            yield
        finally:
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _first_free_lock():
    paths = [os.path.join(tempfile.gettempdir(), f"csa_frontend_fuzz_big_case.{os.getuid()}.{k}.lock")
             for k in range(BIG_CASE_SLOTS)]
    while True:
        for path in paths:
            with open(path, "a") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                yield  # the lock goes with the file's closing
                return
        time.sleep(0.05)
