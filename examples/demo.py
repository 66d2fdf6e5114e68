"""Pool a ragged THD pack with csa_frontend, run backward, and report accuracy against the fp64 oracle.

On a machine with CUDA the public API runs the fused kernels; on CPU it runs the fp32 reference.
Upstream eager (bf16 softmax weights, what Megatron-LM runs today) is shown for comparison.

    python3 examples/demo.py
    python3 examples/demo.py --ratio 128 --coff 1 --head-dim 512 --lengths 4096,300,0,1031
"""
import argparse

import torch

from csa_frontend import csa_compress, csa_compressor_backward_wrapper
from csa_frontend.compressor.reference import reference_backward, reference_forward


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--coff", type=int, default=2, choices=(1, 2))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--lengths", default="1000,0,37,517,3", help="segment lengths of the pack")
    p.add_argument("--pad-rows", type=int, default=2, help="static capacity beyond cu_seqlens_comp[-1]")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ratio, coff, d = args.ratio, args.coff, args.head_dim
    lengths = [int(n) for n in args.lengths.split(",") if n]
    torch.manual_seed(args.seed)

    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    comp = torch.tensor([0] + [n // ratio for n in lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    total_comp = int(comp[-1]) + args.pad_rows
    num_tokens = int(cu[-1])
    kv = torch.randn(num_tokens, coff * d).bfloat16()
    score = (2 * torch.randn(num_tokens, coff * d)).bfloat16()
    ape = 0.5 * torch.randn(ratio, coff * d)
    grad_out = torch.randn(total_comp, d).bfloat16()
    kv, score, ape, cu, comp, grad_out = (t.to(device) for t in (kv, score, ape, cu, comp, grad_out))

    path = "fused CuTe kernels" if device == "cuda" else "fp32 reference (no CUDA device)"
    print(f"csa_frontend demo on {device}: {path}")
    print(f"  pack: {len(lengths)} segments {lengths}, T={num_tokens}, ratio={ratio}, coff={coff}, "
          f"head_dim={d}, rows={int(comp[-1])} (+{args.pad_rows} padding)")

    leaves = [t.clone().requires_grad_() for t in (kv, score, ape)]
    out = csa_compress(*leaves, cu, comp, ratio=ratio, coff=coff, total_comp=total_comp)
    (out.float() * grad_out.float()).sum().backward()
    ours = (out.detach(), *(t.grad for t in leaves))
    # The backward wrapper gives the same gradients without autograd.
    direct = csa_compressor_backward_wrapper(kv, score, ape, cu, comp, grad_out, ratio=ratio, coff=coff)
    assert all(torch.equal(a, b) for a, b in zip(ours[1:], direct))

    inputs = (kv, score, ape, cu, comp)
    oracle = (reference_forward(*inputs, ratio, coff, total_comp, mode="fp64"),
              *reference_backward(*inputs, grad_out, ratio, coff, mode="fp64"))
    upstream = (reference_forward(*inputs, ratio, coff, total_comp, mode="upstream"),
                *reference_backward(*inputs, grad_out, ratio, coff, mode="upstream"))

    def err(t, ref):
        return float((t.double() - ref).abs().max()) if t.numel() else 0.0

    print(f"  {'tensor':<11} {'shape':<14} {'max|err| vs fp64':>17} {'upstream eager':>15}")
    for name, mine, up, exact in zip(("out", "grad_kv", "grad_score", "grad_ape"), ours, upstream, oracle):
        print(f"  {name:<11} {str(tuple(mine.shape)):<14} {err(mine, exact):>17.3e} {err(up, exact):>15.3e}")
    finite = all(bool(torch.isfinite(t.float()).all()) for t in ours)
    print(f"  all outputs finite: {finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
