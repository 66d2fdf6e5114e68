"""Shared lifecycle of every csa_frontend operator: describe -> check_support -> compile -> execute.

An operator object is built from *sample* tensors. It keeps only their descriptors (shape,
dtype, device, strides, alignment), never the tensors, so samples may be ``meta`` tensors and a
framework can plan before it allocates. ``check_support`` raises ``ValueError`` (a malformed
argument) or ``RuntimeError`` (no implementation for this machine) naming the argument and the
expected value; ``compile`` is idempotent and logged with its duration; ``execute`` is thin.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

logger = logging.getLogger("csa_frontend")

#: Every pointer handed to a kernel must be a multiple of this many bytes (128-bit accesses).
POINTER_ALIGNMENT = 16


def _misalignment(data_ptr: Optional[int]) -> int:
    """Bytes past the last 16-byte boundary, or 0 when unknown (meta tensors)."""
    return 0 if data_ptr is None else data_ptr % POINTER_ALIGNMENT


@dataclass(frozen=True)
class TensorDesc:
    """What an operator remembers of a sample tensor; mirrors the ``torch.Tensor`` accessors the
    validation code uses, so descriptors and tensors can be checked by the same functions."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    strides: Tuple[int, ...]
    data_ptr_value: Optional[int]  # None when unknown (meta tensors have no storage)

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorDesc":
        ptr = None if t.device.type == "meta" else t.data_ptr()
        return cls(tuple(t.shape), t.dtype, t.device, tuple(t.stride()), ptr)

    def dim(self) -> int:
        return len(self.shape)

    def stride(self) -> Tuple[int, ...]:
        return self.strides

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_contiguous(self) -> bool:
        # Row-major with unit innermost stride; extents of 1 (and empty tensors) place no
        # constraint on their stride, as in torch.
        if self.numel() == 0:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def data_ptr(self) -> Optional[int]:
        return self.data_ptr_value

    @property
    def misalignment(self) -> int:
        return _misalignment(self.data_ptr_value)


def tensor_misalignment(t) -> int:
    """Bytes by which ``t`` (a tensor or a TensorDesc) misses 16-byte alignment; 0 if unknown."""
    if isinstance(t, torch.Tensor):
        return 0 if t.is_meta else t.data_ptr() % POINTER_ALIGNMENT
    return t.misalignment


class APIBase:
    """Base of the operator classes. Subclasses implement ``_check_support``, ``_compile``,
    ``execute`` and ``_describe`` (a short string naming the configuration for logs)."""

    def __init__(self) -> None:
        self._support_checked = False
        self._compiled = False
        self._lock = threading.Lock()

    # -- check helpers ---------------------------------------------------------------------
    @staticmethod
    def _value_error_if(cond: bool, msg: str) -> None:
        if cond:
            raise ValueError(msg)

    @staticmethod
    def _runtime_error_if(cond: bool, msg: str) -> None:
        if cond:
            raise RuntimeError(msg)

    # -- lifecycle -------------------------------------------------------------------------
    def check_support(self) -> bool:
        """Validate the sample descriptors and the machine; raise if unsupported."""
        self._check_support()
        self._support_checked = True
        logger.debug("check_support passed: %s", self._describe())
        return True

    def compile(self) -> None:
        """JIT (or look up) what ``execute`` needs. Idempotent and thread-safe."""
        if self._compiled:
            return
        with self._lock:
            if self._compiled:
                return
            if not self._support_checked:
                self.check_support()
            start = time.perf_counter()
            self._compile()
            elapsed_ms = (time.perf_counter() - start) * 1e3
            self._compiled = True
        logger.info("compiled %s in %.3f ms", self._describe(), elapsed_ms)

    def _require_compiled(self) -> None:
        self._runtime_error_if(
            not self._compiled,
            f"{type(self).__name__}.execute: call compile() first (lifecycle is "
            "check_support() -> compile() -> execute())",
        )

    # -- to implement ----------------------------------------------------------------------
    def _check_support(self) -> None:
        raise NotImplementedError

    def _compile(self) -> None:
        raise NotImplementedError

    def _describe(self) -> str:
        return type(self).__name__

    def execute(self, *args, **kwargs):
        raise NotImplementedError
