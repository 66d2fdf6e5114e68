"""CPU model: how many bf16 gradients of the stream backward differ from the fp32 reference.

The stream backward re-associates the window sums (den, T) and, by default, uses approximate
``exp`` and ``p = e * (1/den)``. Each perturbation of an fp32 intermediate can move a bf16
rounding; this counts how often, on the SPEC input distribution, against the 0.1% budget of the
numerics contract. The approximate ``exp`` is modelled as uniform noise of up to ``n`` ulp.

    python benchmark/csa/model_bwd_rounding.py [--rows 256] [--window 256] [--cols 256]
"""
import argparse

import torch


def ulp_noise(x: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``x`` moved by a uniform integer number of ulp in [-n, n]."""
    _, exp = torch.frexp(x)
    ulp = torch.ldexp(torch.ones_like(x), exp - 24)
    return x + torch.randint(-n, n + 1, x.shape, generator=gen).float() * ulp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--cols", type=int, default=256)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    shape = (args.rows, args.window, args.cols)
    kv = torch.randn(shape, generator=gen).bfloat16().float()
    s = (2 * torch.randn(shape, generator=gen)).bfloat16().float() + 0.5 * torch.randn(
        1, args.window, args.cols, generator=gen)
    g = torch.randn(args.rows, 1, args.cols, generator=gen).bfloat16().float()

    # the fp32 reference: torch.softmax and its autograd formula
    p = torch.softmax(s, dim=1)
    dp = g * kv
    ref_gkv = (g * p).bfloat16()
    ref_gs = ((dp - (dp * p).sum(1, keepdim=True)) * p).bfloat16()

    m = s.amax(1, keepdim=True)
    print("exp error (ulp)  weights        grad_kv differ  grad_score differ")
    for n_ulp, exact_weights in ((0, True), (2, False), (8, False)):
        e = ulp_noise(torch.exp(s - m), n_ulp, gen)
        den = e.sum(1, keepdim=True)
        w = e / den if exact_weights else e * (1.0 / den)
        big_s = (e * dp).sum(1, keepdim=True) / den
        gkv = (g * w).bfloat16()
        gs = ((dp - big_s) * w).bfloat16()
        print(f"{n_ulp:15d}  {'e / den' if exact_weights else 'e * (1/den)':13s}"
              f"  {100 * (gkv != ref_gkv).float().mean().item():13.4f}%"
              f"  {100 * (gs != ref_gs).float().mean().item():16.4f}%")


if __name__ == "__main__":
    main()
