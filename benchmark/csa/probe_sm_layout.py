"""How the device places CTAs and whether its SMs stream at the same speed (session 50).

Three probes, kernels that do nothing but record where and when their CTAs ran:

* ``clusters``: CTAs launched in thread-block clusters of 1-16, held one or two per SM by shared
  memory, each spinning 200 us. The CTAs that start in the first 100 us are the clusters that
  fit at once (what a one-wave grid of that shape could use); CTAs of one cluster share a GPC,
  so joining them over a few launches maps the SMs into GPCs.
* ``stream``: every CTA moves the same bytes of its own region (two 16-byte reads and two writes
  per step, like the window backward's row walk) and records its SM and duration; grouped by
  that GPC map, this shows whether some SMs or GPCs stream slower.
* ``chase``: one warp per SM follows chains of dependent loads through 1 GiB (latency only),
  grouped the same way: whether some SMs wait longer for DRAM.

    python probe_sm_layout.py clusters
    python probe_sm_layout.py stream
    python probe_sm_layout.py chase

The analysis helpers are plain Python (unit-tested on the CPU); running the probes needs a GPU.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Dict, Iterable, List, Sequence, Tuple

import torch
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.runtime import from_dlpack
from cutlass.memory import SmemAllocator

#: A CTA counts as started in the first wave if it started within this long of the first one
#: (the cluster probe's CTAs spin twice as long).
FIRST_WAVE_NS = 100_000
SPIN_NS = 200_000
#: The kernels record the global timer's low 31 bits (it wraps every ~2.1 s).
TIMER_WRAP = 1 << 31


def timer_delta(later: int, earlier: int) -> int:
    """Signed nanoseconds between two recorded timer values (within +-1 s), across a wrap."""
    return (later - earlier + TIMER_WRAP // 2) % TIMER_WRAP - TIMER_WRAP // 2


def first_wave(starts: Sequence[int], window_ns: int = FIRST_WAVE_NS) -> int:
    """CTAs that started within ``window_ns`` of the earliest start: those resident at once."""
    if not starts:
        return 0
    rel = [timer_delta(s, starts[0]) for s in starts]
    t0 = min(rel)
    return sum(1 for r in rel if r - t0 < window_ns)


def co_located_groups(n_sms: int, launches: Iterable[Sequence[Tuple[int, int]]]) -> List[List[int]]:
    """SMs joined whenever one cluster ran on both (``launches``: per launch, (smid, cluster id)
    per CTA), as sorted groups, largest first. SMs never in a multi-CTA cluster stay alone."""
    parent = list(range(n_sms))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for ctas in launches:
        members: Dict[int, List[int]] = {}
        for smid, cluster in ctas:
            members.setdefault(cluster, []).append(smid)
        for sms in members.values():
            for sm in sms[1:]:
                parent[root(sm)] = root(sms[0])
    groups: Dict[int, List[int]] = {}
    for sm in range(n_sms):
        groups.setdefault(root(sm), []).append(sm)
    return sorted(groups.values(), key=lambda g: (-len(g), g))


def durations_by_group(records: Sequence[Tuple[int, int, int]], groups: Sequence[Sequence[int]]
                       ) -> List[Tuple[int, int, float, float]]:
    """(group index, CTAs, mean us, max us) of CTA durations (``records``: smid, start ns, end
    ns), per SM group; SMs in no group count as group -1."""
    group_of = {sm: g for g, members in enumerate(groups) for sm in members}
    by_group: Dict[int, List[float]] = {}
    for smid, start, end in records:
        by_group.setdefault(group_of.get(smid, -1), []).append(timer_delta(end, start) / 1000)
    return [(g, len(v), statistics.mean(v), max(v)) for g, v in sorted(by_group.items())]


@cute.jit
def record_cta(rec: cute.Tensor, bx: Int32, t0: Int64):
    """Once every thread of the CTA is done, thread 0 writes its (SM, start, end) row of ``rec``."""
    cute.arch.sync_threads()
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        rec[bx, 0] = cute.arch.smid()
        rec[bx, 1] = Int32(t0 & 0x7FFFFFFF)
        rec[bx, 2] = Int32(cute.arch.globaltimer() & 0x7FFFFFFF)


class ClusterProbe:
    """Thread 0 of each CTA records (SM, cluster, start) and spins; the shared memory it holds
    sets how many CTAs fit per SM."""

    def __init__(self, cluster: int, smem_bytes: int, threads: int):
        self.cluster, self.smem_bytes, self.threads = cluster, smem_bytes, threads

    @cute.kernel
    def kernel(self, rec: cute.Tensor, spin: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        # unused but allocated: its size sets the CTAs per SM
        hold = SmemAllocator().allocate_tensor(Int32, cute.make_layout((self.smem_bytes // 4,)), 16)
        if tidx == 0:
            t0 = cute.arch.globaltimer()
            hold[0] = Int32(0)
            cx, _, _ = cute.arch.cluster_idx()
            rec[bx, 0] = cute.arch.smid()
            rec[bx, 1] = cx
            t = t0
            while t - t0 < spin:
                t = cute.arch.globaltimer()
            rec[bx, 2] = Int32(t0 & 0x7FFFFFFF) + hold[0]
        cute.arch.sync_threads()

    @cute.jit
    def __call__(self, rec: cute.Tensor, spin: Int64, n: Int32):
        self.kernel(rec, spin).launch(grid=(n, 1, 1), block=(self.threads, 1, 1), cluster=(self.cluster, 1, 1))


class StreamProbe:
    """Each CTA copies its own ``steps * threads`` 16-byte vectors of two arrays into two others
    and records (SM, start, end)."""

    def __init__(self, threads: int, steps: int):
        self.threads, self.steps = threads, steps

    @cute.kernel
    def kernel(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, d: cute.Tensor, rec: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        gA, gB, gC, gD = (cute.zipped_divide(t, (4,)) for t in (a, b, c, d))
        t0 = cute.arch.globaltimer()
        base = bx * self.steps * self.threads + tidx
        for i in cutlass.range(self.steps, unroll=4):
            j = base + i * self.threads
            x = gA[(None, j)].load()
            y = gB[(None, j)].load()
            gC[(None, j)].store(x)
            gD[(None, j)].store(y)
        record_cta(rec, bx, t0)

    @cute.jit
    def __call__(self, a, b, c, d, rec, n: Int32):
        self.kernel(a, b, c, d, rec).launch(grid=(n, 1, 1), block=(self.threads, 1, 1))


class ChaseProbe:
    """Each thread follows its own chain of dependent loads through a random cycle (one load in
    flight per thread: latency, not bandwidth) and thread 0 records (SM, start, end)."""

    def __init__(self, threads: int, hops: int):
        self.threads, self.hops = threads, hops

    @cute.kernel
    def kernel(self, nxt: cute.Tensor, sink: cute.Tensor, rec: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        i = (bx * self.threads + tidx) * 4099 % nxt.shape[0]
        t0 = cute.arch.globaltimer()
        for _ in cutlass.range(self.hops, unroll=1):
            i = nxt[i]
        sink[bx * self.threads + tidx] = i
        record_cta(rec, bx, t0)

    @cute.jit
    def __call__(self, nxt, sink, rec, n: Int32):
        self.kernel(nxt, sink, rec).launch(grid=(n, 1, 1), block=(self.threads, 1, 1))


def _cluster_launch(cluster: int, per_sm: int, n: int):
    smem = {1: 160 << 10, 2: 100 << 10}[per_sm]
    rec = torch.full((n, 3), -1, dtype=torch.int32, device="cuda")
    fn = cute.compile(ClusterProbe(cluster, smem, 256), from_dlpack(rec), Int64(0), Int32(n))
    fn(from_dlpack(rec), Int64(SPIN_NS), Int32(n))
    torch.cuda.synchronize()
    return rec.cpu().tolist()


def map_gpcs(n_sms: int) -> List[List[int]]:
    """SM groups sharing a GPC, from a few launches of clusters of 16, 8, 4 and 2."""
    launches = []
    for cluster in (16, 8, 4, 2):
        for _ in range(3):
            rows = _cluster_launch(cluster, 1, (n_sms // cluster) * cluster)
            launches.append([(r[0], r[1]) for r in rows])
    return co_located_groups(n_sms, launches)


def run_clusters(n_sms: int) -> None:
    for per_sm in (1, 2):
        for cluster in (1, 2, 4, 8, 16):
            n = (n_sms * per_sm // cluster) * cluster
            rows = _cluster_launch(cluster, per_sm, n)
            first = first_wave([r[2] for r in rows])
            print(f"clusters of {cluster:2d}, {per_sm} CTA(s) per SM, {n} CTAs: {first} start at once "
                  f"({first // cluster} clusters) on {len({r[0] for r in rows})} SMs")
    print("SMs sharing a GPC:", map_gpcs(n_sms))


def run_stream(n_sms: int) -> None:
    groups = map_gpcs(n_sms)
    print("SMs sharing a GPC:", groups)
    for ctas, threads in ((256, 256), (2 * n_sms, 256), (128, 512)):
        steps = 192 * 256 // threads  # 768 KB of each of the four arrays per CTA
        per_cta = steps * threads * 4
        a, b = (torch.randint(0, 100, (ctas * per_cta,), dtype=torch.int32, device="cuda") for _ in range(2))
        c, d = torch.empty_like(a), torch.empty_like(b)
        rec = torch.zeros((ctas, 3), dtype=torch.int32, device="cuda")
        args = [from_dlpack(t) for t in (a, b, c, d, rec)]
        fn = cute.compile(StreamProbe(threads, steps), *args, Int32(ctas))
        for _ in range(3):
            fn(*args, Int32(ctas))
            torch.cuda.synchronize()
            rows = [tuple(r) for r in rec.cpu().tolist()]
            total_us = max(timer_delta(r[2], rows[0][1]) for r in rows) / 1000 \
                - min(timer_delta(r[1], rows[0][1]) for r in rows) / 1000
            rate = 4 * ctas * per_cta * 4 / total_us / 1e3
            print(f"{ctas} CTAs of {threads}: {total_us:.1f} us ({rate:.0f} GB/s); CTA us per GPC group "
                  "(CTAs, mean, max): " + "; ".join(f"g{g} {n} {m:.1f} {x:.1f}"
                                                   for g, n, m, x in durations_by_group(rows, groups)))


def run_chase(n_sms: int) -> None:
    """Dependent-load latency per CTA (one CTA of one warp per SM), grouped like ``stream``."""
    groups = map_gpcs(n_sms)
    n = 1 << 28  # 1 GiB of int32: far past the L2
    perm = torch.randperm(n, device="cuda", dtype=torch.int64)
    nxt = torch.empty(n, dtype=torch.int32, device="cuda")
    nxt[perm] = torch.roll(perm, -1).to(torch.int32)  # one cycle through every element
    del perm
    hops, threads = 2000, 32
    sink = torch.empty(n_sms * threads, dtype=torch.int32, device="cuda")
    rec = torch.zeros((n_sms, 3), dtype=torch.int32, device="cuda")
    args = [from_dlpack(t) for t in (nxt, sink, rec)]
    fn = cute.compile(ChaseProbe(threads, hops), *args, Int32(n_sms))
    for _ in range(3):
        fn(*args, Int32(n_sms))
        torch.cuda.synchronize()
        rows = [tuple(r) for r in rec.cpu().tolist()]
        print(f"{n_sms} CTAs of one warp, {hops} dependent loads per thread; ns per load per GPC group "
              "(CTAs, mean, max): " + "; ".join(f"g{g} {k} {1000 * m / hops:.0f} {1000 * x / hops:.0f}"
                                                for g, k, m, x in durations_by_group(rows, groups)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probe", choices=["clusters", "stream", "chase"])
    args = ap.parse_args()
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {n_sms} SMs")
    {"clusters": run_clusters, "stream": run_stream, "chase": run_chase}[args.probe](n_sms)


if __name__ == "__main__":
    main()
