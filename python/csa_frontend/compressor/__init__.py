"""The CSA compressor gated pooling: API classes, wrappers, the differentiable op, references."""
from .api import (
    CSACompressorBackward,
    CSACompressorForward,
    OpResult,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
    determinism_guard,
)
from .op import csa_compress
from .reference import reference_backward, reference_forward

__all__ = [
    "CSACompressorForward",
    "CSACompressorBackward",
    "OpResult",
    "csa_compressor_forward_wrapper",
    "csa_compressor_backward_wrapper",
    "csa_compress",
    "determinism_guard",
    "reference_forward",
    "reference_backward",
]
