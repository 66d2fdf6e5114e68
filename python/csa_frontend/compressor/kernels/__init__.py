"""Fused CuTe DSL kernels for the CSA compressor pooling, behind a small torch-facing contract.

The API layer (``compressor/api.py``) validates every argument before it calls in here; these
functions trust their inputs. All CuTe imports are lazy so the package imports (and the CPU
reference path works) on machines without CUDA or without ``nvidia-cutlass-dsl``.

Contract used by the API layer:

- ``unsupported_reason(ratio, coff, head_dim, arch) -> str | None``: why no fused kernel serves
  this configuration (``None`` when one does). Pure Python, no compilation.
- ``compile_forward(ratio=, coff=, head_dim=, arch=None)`` / ``compile_backward(...)``: JIT every
  schedule bucket of that configuration once (idempotent, thread-safe, process-wide cache).
- ``forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio=, coff=, head_dim=,
  stream=None)``: writes all ``out.shape[0]`` rows; launches nothing when that is 0.
- ``backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
  grad_ape, ratio=, coff=, head_dim=, deterministic=True, stream=None)``: writes every element
  of ``grad_kv``/``grad_score`` (never-consumed slots get exact zeros) and overwrites
  ``grad_ape``.
- ``prepared_forward(device, ratio, coff, head_dim)`` / ``prepared_backward(..., deterministic)``:
  launch callables with the lookups done once, for the wrappers' fast path (same launches).
"""
from __future__ import annotations

from .dispatch import (
    backward,
    compile_backward,
    compile_forward,
    forward,
    prepared_backward,
    prepared_forward,
    unsupported_reason,
)

__all__ = ["unsupported_reason", "compile_forward", "compile_backward", "forward", "backward",
           "prepared_forward", "prepared_backward"]
