"""CPU model: could a fast stream forward certify its own bf16 rounding and fall back rarely?

The stream forward computes ``sum kv e / sum e`` by chunk partials; the reference rounds
``e / den`` and each product and adds left to right. Both are within a few ``W * u`` of the
exact value (relative to ``S1 = sum |kv| p``), so where the fast value ``v`` lies farther than
the two error bounds from a bf16 rounding midpoint, ``bf16(v)`` is the reference's bf16 for
certain; only the rest ("in doubt") would need the reference's sequential order. This counts,
on the SPEC input distribution, the elements that actually round differently (the measured
flip rate) and the fraction in doubt under a worst-case bound ``(4 W + 8) u S1``: both sums'
rounding, the division, the products and exponentials of 2 ulp on each side.

    python benchmark/csa/model_fwd_doubt.py [--windows 8,32,256] [--elements 32768]
"""
import argparse

import torch

U = 2.0 ** -24  # fp32 unit roundoff


def in_order_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 left to right, as the reference adds."""
    total = x[:, 0].clone()
    for k in range(1, x.shape[1]):
        total = total + x[:, k]
    return total


def model(window: int, elements: int, chunk: int, gen: torch.Generator):
    """(flip fraction, doubt fraction, median S1/|out|) for one window width."""
    rows, cols = max(1, elements // 64), 64
    shape = (rows, window, cols)
    kv = torch.randn(shape, generator=gen).bfloat16().float()
    s = (2 * torch.randn(shape, generator=gen)).bfloat16().float() + 0.5 * torch.randn(
        1, window, cols, generator=gen)
    e = torch.exp(s - s.amax(1, keepdim=True))
    p = e / in_order_sum(e)[:, None]
    ref = in_order_sum(kv * p)
    # the stream forward's shape of computation: per-chunk sums, merged in chunk order, one division
    a = torch.zeros(rows, cols)
    d = torch.zeros(rows, cols)
    for c in range(0, window, chunk):
        a = a + (kv[:, c:c + chunk] * e[:, c:c + chunk]).sum(1)
        d = d + e[:, c:c + chunk].sum(1)
    v = a / d
    flips = (v.bfloat16() != ref.bfloat16()).float().mean().item()
    s1 = (kv.abs() * p).sum(1)
    bound = (4 * window + 8) * U * s1
    doubt = ((v - bound).bfloat16() != (v + bound).bfloat16()).float().mean().item()
    return flips, doubt, (s1 / ref.abs()).median().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", default="8,32,256", help="comma list of window widths (coff * ratio)")
    ap.add_argument("--elements", type=int, default=1 << 15, help="output elements per window width")
    ap.add_argument("--chunk", type=int, default=16, help="positions per chunk partial")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"{'window':>8}{'differing':>12}{'in doubt':>12}{'S1/|out|':>12}")
    for w in (int(x) for x in args.windows.split(",")):
        flips, doubt, spread = model(w, args.elements, min(args.chunk, w), gen)
        print(f"{w:>8}{flips:>12.2e}{doubt:>12.3f}{spread:>12.1f}")


if __name__ == "__main__":
    main()
