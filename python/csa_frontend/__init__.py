"""csa_frontend: fused CSA compressor pooling for DeepSeek-V4-style KV compression, behind a
cuDNN-frontend-style operator API (see docs/csa_compressor.md)."""
import logging

from .compressor import (
    CSACompressorBackward,
    CSACompressorForward,
    csa_compress,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
)

__version__ = "0.1.0"

logging.getLogger("csa_frontend").addHandler(logging.NullHandler())

__all__ = [
    "CSACompressorForward",
    "CSACompressorBackward",
    "csa_compressor_forward_wrapper",
    "csa_compressor_backward_wrapper",
    "csa_compress",
    "__version__",
]
