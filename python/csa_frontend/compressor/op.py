"""``csa_compress``: the differentiable pooling, usable eagerly and under ``torch.compile``.

Two routes to the same wrappers, with the same values:

- eager: a ``torch.autograd.Function`` (or the bare forward wrapper when no gradient is
  needed). Going through the ``torch.library`` dispatcher costs tens of microseconds per call,
  which eager training loops feel, so eager calls skip it.
- traced (``torch.compiler.is_compiling()``): the custom ops ``csa_frontend::compress_fwd`` /
  ``csa_frontend::compress_bwd`` with fake (meta) kernels and a registered autograd formula, so
  ``torch.compile(fullgraph=True)`` captures the call without a graph break. Token and segment
  counts may be dynamic; ``total_comp=None`` becomes a data-dependent (unbacked) size there.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .api import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
from .plan import check_flag
from ..api_base import POINTER_ALIGNMENT


def _forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int, coff: int, total_comp: Optional[int]):
    return csa_compressor_forward_wrapper(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=ratio, coff=coff,
                                          total_comp=total_comp)["out"]


def _backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio: int, coff: int, deterministic: bool,
              compute_grad_ape: bool = True):
    # Autograd hands over whatever layout the consumer produced (often an expanded view): the
    # kernels need a dense, 16-byte aligned buffer.
    if not grad_out.is_contiguous() or grad_out.data_ptr() % POINTER_ALIGNMENT:
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    return tuple(csa_compressor_backward_wrapper(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out,
                                                 ratio=ratio, coff=coff, deterministic=deterministic,
                                                 compute_grad_ape=compute_grad_ape))


# -- traced route: torch.library custom ops ----------------------------------------------------

@torch.library.custom_op("csa_frontend::compress_fwd", mutates_args=())
def compress_fwd(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor,
                 cu_seqlens_comp: torch.Tensor, ratio: int, coff: int, total_comp: int,
                 deterministic: bool) -> torch.Tensor:
    """``total_comp < 0`` means "read cu_seqlens_comp[-1]"; ``deterministic`` is for backward."""
    return _forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                    None if total_comp < 0 else total_comp)


@compress_fwd.register_fake
def _compress_fwd_fake(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, deterministic):
    rows = torch.library.get_ctx().new_dynamic_size() if total_comp < 0 else total_comp
    return kv.new_empty((rows, kv.shape[1] // coff))


@torch.library.custom_op("csa_frontend::compress_bwd", mutates_args=())
def compress_bwd(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor,
                 cu_seqlens_comp: torch.Tensor, grad_out: torch.Tensor, ratio: int, coff: int,
                 deterministic: bool, compute_grad_ape: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``compute_grad_ape=False`` (ape needs no gradient) returns an empty third tensor: the schema
    has no optional outputs. The default keeps backward graphs compiled before the argument
    existed working: torch's AOTAutograd cache is keyed on the forward graph, so a warm cache
    can replay an older backward's call of this op."""
    grad_kv, grad_score, grad_ape = _backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff,
                                              deterministic, compute_grad_ape)
    return grad_kv, grad_score, ape.new_empty((0,)) if grad_ape is None else grad_ape


@compress_bwd.register_fake
def _compress_bwd_fake(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, deterministic,
                       compute_grad_ape=True):
    return torch.empty_like(kv), torch.empty_like(score), ape.new_empty(ape.shape if compute_grad_ape else (0,))


def _setup_context(ctx, inputs, output) -> None:
    kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, _, deterministic = inputs
    ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
    ctx.static = (ratio, coff, deterministic)


def _custom_op_backward(ctx, grad_out):
    need_ape = ctx.needs_input_grad[2]
    grad_kv, grad_score, grad_ape = compress_bwd(*ctx.saved_tensors, grad_out.contiguous(), *ctx.static, need_ape)
    return grad_kv, grad_score, grad_ape if need_ape else None, None, None, None, None, None, None


compress_fwd.register_autograd(_custom_op_backward, setup_context=_setup_context)


# -- eager route -------------------------------------------------------------------------------

class _CompressFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp, deterministic):
        ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp)
        ctx.static = (ratio, coff, deterministic)
        return _forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        with torch.no_grad():
            # a frozen ape (no gradient wanted) skips the grad_ape reduction
            grads = _backward(*saved, grad_out, *ctx.static, ctx.needs_input_grad[2])
        return (*_differentiable_once(grads, (grad_out, *saved[:3])), None, None, None, None, None, None)


def _differentiable_once(grads, depends_on):
    """The gradients, made to raise if anything differentiates them again (a gradient penalty
    under ``create_graph=True``): the kernels have no second derivative, and without this the
    term would be silently left out. ``torch.autograd.function.once_differentiable`` looks at
    grad_out alone, so a loss linear in ``out`` (constant grad_out) slipped past it; here the
    saved inputs count too."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in depends_on):
        return grads
    fail = torch._C._functions.DelayedError(
        b"csa_compress has no double backward: its gradients cannot be differentiated again", len(grads))
    return fail(*[None if g is None else g.detach().requires_grad_() for g in grads])


def csa_compress(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, cu_seqlens: torch.Tensor,
                 cu_seqlens_comp: torch.Tensor, ratio: int = 4, coff: int = 2, total_comp: Optional[int] = None,
                 *, deterministic: bool = True) -> torch.Tensor:
    """Differentiable pooling ``out (total_comp, head_dim)`` of a THD pack (SPEC section 2);
    gradients flow to ``kv``, ``score`` and ``ape``. ``total_comp=None`` reads
    ``cu_seqlens_comp[-1]`` (a sync on CUDA; an unbacked size under ``torch.compile``)."""
    if type(deterministic) is not bool:  # else only the backward would find out, after the forward ran
        check_flag("deterministic", deterministic)
    if torch.compiler.is_compiling():
        return compress_fwd(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff,
                            -1 if total_comp is None else total_comp, deterministic)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (kv, score, ape)):
        return _CompressFunction.apply(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp,
                                       deterministic)
    return _forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, total_comp)
