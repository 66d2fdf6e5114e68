"""Operator classes and wrapper functions of the CSA compressor pooling (SPEC section 4).

CUDA tensors go to the fused CuTe kernels (``kernels/``, imported lazily so CPU-only use never
loads CUTLASS); CPU tensors run the fp32 reference (``reference.py``) through the same checks.
"""
from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Callable, Hashable, Optional

import torch

from ..api_base import APIBase, TensorDesc
from . import plan
from .reference import reference_backward, reference_forward

#: Operator objects the wrappers keep, least recently used evicted first.
OP_CACHE_SIZE = 64

_PLANNED_DEVICE = "the device this operator was planned for"
_KV_DEVICE = "the device of kv"


class OpResult(dict):
    """Named outputs that also behave like a tuple: ``r["out"]`` or ``r[0]``, and iterating
    (hence unpacking) yields the values in order: ``grad_kv, grad_score, grad_ape = r``."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return tuple(self.values())[key]
        return super().__getitem__(key)


def _sample(t):
    """Descriptor of a sample tensor; anything else is kept so check_support can name it."""
    return TensorDesc.of(t) if isinstance(t, torch.Tensor) else t


def _kernels():
    from . import kernels  # lazy: pulls in CUTLASS only for CUDA work
    return kernels


def _check_stream(stream, device: torch.device) -> None:
    """``stream``: None, or a torch.cuda.Stream of the device the tensors are on."""
    if stream is None:
        return
    if not isinstance(stream, torch.cuda.Stream):
        raise ValueError(f"stream: expected a torch.cuda.Stream or None, got {type(stream).__name__}")
    if device.type == "cuda" and stream.device != device:
        raise ValueError(f"stream: expected a stream of {device} (the device of kv), got one of {stream.device}")


def _record_on(stream, device: torch.device, tensors) -> None:
    """Tell the caching allocator these tensors are used on a stream other than the current one."""
    if stream is not None and stream != torch.cuda.current_stream(device):
        for t in tensors:
            t.record_stream(stream)


def determinism_guard(deterministic: bool) -> None:
    """SPEC section 3: the atomic grad_ape path (``deterministic=False``) is non-deterministic,
    so under ``torch.use_deterministic_algorithms(True)`` it raises, or warns in warn-only mode."""
    if deterministic or not torch.are_deterministic_algorithms_enabled():
        return
    msg = ("csa_compressor backward with deterministic=False accumulates grad_ape with atomics, "
           "which is not deterministic; torch.use_deterministic_algorithms(True) is set, so pass "
           "deterministic=True")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(msg, UserWarning, stacklevel=3)
        return
    raise RuntimeError(msg)


class _CompressorOp(APIBase):
    """What both directions share: configuration, device resolution, support, compile."""

    _direction = ""

    def __init__(self, samples, *, ratio, coff, head_dim, validate, device) -> None:
        super().__init__()
        self._samples = [_sample(t) for t in samples]
        self._scalars = (ratio, coff, head_dim)
        self._device_request = device
        self._validate = plan.validate_requested(validate)
        self.config: Optional[plan.CompressorConfig] = None
        self.device: Optional[torch.device] = None
        self.arch: Optional[str] = None
        self._fast: Optional[_FastPlan] = None  # set by compile() for CUDA plans without validation

    # -- support ---------------------------------------------------------------------------
    def _resolve_device(self, sample_device: torch.device) -> torch.device:
        request = self._device_request
        if request is None:
            if sample_device.type != "meta":
                return sample_device
            request = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(request)
        if sample_device.type != "meta" and device != sample_device:
            raise ValueError(f"device: expected None or {sample_device} (the samples' device), got {device}")
        if device.type == "cuda":
            self._runtime_error_if(not torch.cuda.is_available(), "device: expected an available CUDA device, "
                                   "but torch.cuda.is_available() is False")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self._value_error_if(device.type not in ("cuda", "cpu"),
                             f"device: expected a cuda or cpu device, got {device}")
        return device

    def _check_support(self) -> None:
        kv = self._samples[0]
        self.config = plan.make_config(kv, *self._scalars)
        plan.check_is_tensor("kv", kv)
        self._check_samples(self.config, kv.device)
        self.device = self._resolve_device(kv.device)
        if self.device.type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
            self.arch = plan.arch_from_capability(capability)
            cfg = self.config
            reason = _kernels().unsupported_reason(cfg.ratio, cfg.coff, cfg.head_dim, self.arch)
            self._runtime_error_if(
                reason is not None,
                f"{type(self).__name__}: no fused kernel for ratio={cfg.ratio}, coff={cfg.coff}, "
                f"head_dim={cfg.head_dim} on {self.arch}: {reason}",
            )

    def _check_samples(self, cfg: plan.CompressorConfig, device: torch.device) -> None:
        raise NotImplementedError

    @property
    def _checks_contents(self) -> bool:
        return self.device.type == "cpu" or self._validate

    # -- compile ---------------------------------------------------------------------------
    def _compile(self) -> None:
        if self.device.type != "cuda":
            return  # the reference needs nothing compiled
        self._runtime_error_if(
            torch.cuda.is_current_stream_capturing(),
            f"{type(self).__name__}.compile: cannot JIT while a CUDA graph is being captured; "
            "run one call (or compile()) before capture",
        )
        cfg = self.config
        compile_fn = getattr(_kernels(), f"compile_{self._direction}")
        compile_fn(ratio=cfg.ratio, coff=cfg.coff, head_dim=cfg.head_dim, arch=self.arch,
                   **self._compile_kwargs())
        if not self._validate:
            prepare = getattr(_kernels(), f"prepared_{self._direction}")
            self._fast = _FastPlan(self, prepare(self.device, cfg.ratio, cfg.coff, cfg.head_dim,
                                                 **self._compile_kwargs()))

    def _compile_kwargs(self) -> dict:
        """Static choices beyond the configuration that select a compiled variant."""
        return {}

    def _describe(self) -> str:
        cfg = self.config
        where = f"{self.arch} fused kernels" if self.device is not None and self.device.type == "cuda" \
            else "cpu reference"
        if cfg is None:
            return f"{type(self).__name__}(unchecked)"
        return (f"{type(self).__name__}(ratio={cfg.ratio}, coff={cfg.coff}, head_dim={cfg.head_dim}, "
                f"device={self.device}: {where})")

    def _kernel_kwargs(self) -> dict:
        cfg = self.config
        return {"ratio": cfg.ratio, "coff": cfg.coff, "head_dim": cfg.head_dim}


class CSACompressorForward(_CompressorOp):
    """``out = pool(kv, score, ape)`` over a THD pack; ``total_comp = sample_out.shape[0]``.

    Samples only describe shape/dtype/device (``meta`` tensors work; then ``device=`` names
    where ``execute`` will run, default the current CUDA device if any, else CPU)."""

    _direction = "forward"

    def __init__(self, sample_kv, sample_score, sample_ape, sample_cu_seqlens, sample_cu_seqlens_comp,
                 sample_out, *, ratio: int = 4, coff: int = 2, head_dim: Optional[int] = None,
                 validate: Optional[bool] = None, device=None) -> None:
        super().__init__((sample_kv, sample_score, sample_ape, sample_cu_seqlens, sample_cu_seqlens_comp,
                          sample_out), ratio=ratio, coff=coff, head_dim=head_dim, validate=validate,
                         device=device)

    def _check_samples(self, cfg, device) -> None:
        plan.check_forward(*self._samples, cfg, device, _KV_DEVICE)

    def execute(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, current_stream=None) -> None:
        """Write ``out``; checks every tensor against the plan first (outputs untouched on error)."""
        self._require_compiled()
        fast = self._fast
        if fast is not None and current_stream is None:
            try:  # the compiled entry point checks the tensors (see the wrappers' fast path)
                if fast.serves_operator(kv, cu_seqlens, cu_seqlens_comp, out.shape[0]):
                    fast.launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, out)
                    return
            except Exception:  # refused before launching: the named checks below say why
                pass
        plan.check_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, self.config, self.device,
                           _PLANNED_DEVICE)
        _check_stream(current_stream, self.device)
        self._run(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, current_stream, "out.shape[0]")

    def _run(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, rows_name: str) -> None:
        """Structure already checked."""
        cfg = self.config
        total_comp = out.shape[0]
        if self._checks_contents:
            plan.check_offsets(cu_seqlens, cu_seqlens_comp, kv.shape[0], cfg.ratio, total_comp, rows_name)
        if total_comp == 0:
            return
        if self.device.type == "cpu":
            with torch.no_grad():
                out.copy_(reference_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, cfg.ratio, cfg.coff,
                                            total_comp))
            return
        _record_on(stream, self.device, (kv, score, ape, cu_seqlens, cu_seqlens_comp, out))
        _kernels().forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream=stream,
                           **self._kernel_kwargs())


class CSACompressorBackward(_CompressorOp):
    """Gradients of the pooling w.r.t. kv, score and ape, recomputed from the inputs.

    ``grad_kv``/``grad_score`` may be uninitialised: every element is written (never-consumed
    slots get +0.0); ``grad_ape`` is overwritten, or not computed where it is None (a frozen
    ape: the backward then skips its grad_ape reduction launch). ``deterministic=False`` allows
    an atomic grad_ape reduction (see ``determinism_guard``)."""

    _direction = "backward"

    def __init__(self, sample_kv, sample_score, sample_ape, sample_cu_seqlens, sample_cu_seqlens_comp,
                 sample_grad_out, sample_grad_kv, sample_grad_score, sample_grad_ape, *, ratio: int = 4,
                 coff: int = 2, head_dim: Optional[int] = None, deterministic: bool = True,
                 validate: Optional[bool] = None, device=None) -> None:
        super().__init__((sample_kv, sample_score, sample_ape, sample_cu_seqlens, sample_cu_seqlens_comp,
                          sample_grad_out, sample_grad_kv, sample_grad_score, sample_grad_ape), ratio=ratio,
                         coff=coff, head_dim=head_dim, validate=validate, device=device)
        self.deterministic = plan.check_flag("deterministic", deterministic)

    def _compile_kwargs(self) -> dict:
        return {"deterministic": self.deterministic}

    def _check_samples(self, cfg, device) -> None:
        plan.check_backward(*self._samples, cfg, device, _KV_DEVICE)

    def execute(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape,
                current_stream=None) -> None:
        """Write the three gradients (``grad_ape`` None: the first two only); checks every tensor
        against the plan first."""
        self._require_compiled()
        fast = self._fast
        if fast is not None and current_stream is None and self._fast_backward_ok(
                kv, cu_seqlens, cu_seqlens_comp, grad_out, grad_ape):
            determinism_guard(self.deterministic)
            try:  # the compiled entry points check the other tensors (see the wrappers' fast path)
                fast.launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape)
                return
            except Exception:  # refused before launching: the named checks below say why
                pass
        plan.check_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
                            grad_ape, self.config, self.device, _PLANNED_DEVICE)
        _check_stream(current_stream, self.device)
        self._run(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape,
                  current_stream, "grad_out.shape[0]")

    def _fast_backward_ok(self, kv, cu_seqlens, cu_seqlens_comp, grad_out, grad_ape) -> bool:
        """grad_ape reaches the atomic backward's kernel as a view, so its shape is checked here."""
        fast = self._fast
        try:
            return ((grad_ape is None or (grad_ape.dtype is _F32 and grad_ape.shape == fast.ape_shape
                                          and grad_ape.is_contiguous() and grad_ape.device == fast.dev))
                    and fast.serves_operator(kv, cu_seqlens, cu_seqlens_comp, grad_out.shape[0]))
        except Exception:
            return False

    def _run(self, kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape,
             stream, rows_name: str) -> None:
        cfg = self.config
        total_comp = grad_out.shape[0]
        determinism_guard(self.deterministic)
        if self._checks_contents:
            plan.check_offsets(cu_seqlens, cu_seqlens_comp, kv.shape[0], cfg.ratio, total_comp, rows_name)
        wanted = (grad_kv, grad_score) if grad_ape is None else (grad_kv, grad_score, grad_ape)
        if total_comp == 0:
            for t in wanted:
                t.zero_()
            return
        if self.device.type == "cpu":
            with torch.no_grad():
                grads = reference_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, cfg.ratio,
                                           cfg.coff)
                for dst, src in zip(wanted, grads):
                    dst.copy_(src)
            return
        _record_on(stream, self.device, (kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *wanted))
        _kernels().backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape,
                            deterministic=self.deterministic, stream=stream, **self._kernel_kwargs())


# -- wrappers ------------------------------------------------------------------------------------

_op_cache: "OrderedDict[Hashable, _CompressorOp]" = OrderedDict()
_op_cache_lock = threading.Lock()
_op_build_lock = threading.Lock()


def _cached_op(key: Hashable, build: Callable[[], _CompressorOp]) -> _CompressorOp:
    """LRU lookup of a compiled operator. Misses build under a second lock, so concurrent first
    calls of one configuration compile it once while hits never wait for a compile."""
    with _op_cache_lock:
        op = _op_cache.get(key)
        if op is not None:
            _op_cache.move_to_end(key)
            return op
    with _op_build_lock:
        op = _op_cache.get(key)
        if op is None:
            op = build()
            op.compile()
    with _op_cache_lock:
        _op_cache[key] = op
        _op_cache.move_to_end(key)
        while len(_op_cache) > OP_CACHE_SIZE:
            _op_cache.popitem(last=False)
    return op


def clear_op_cache() -> None:
    with _op_cache_lock:
        _op_cache.clear()
        _fast_plans.clear()


# -- the wrappers' fast path -------------------------------------------------------------------
#
# Eager training loops call the wrappers thousands of times per step with tensors that look the
# same every time. After one fully checked call on a CUDA device, later calls with the default
# stream and no validation go straight to a prepared launch. The compiled TVM-FFI entry point
# checks every tensor argument itself, in C, before it launches anything: dtype, rank, static
# extents, equal symbolic extents (score like kv, both offset arrays alike), contiguity,
# 16-byte alignment, device type and one device for all. Python adds only what that cannot
# see (the int32 element extent of kv, row counts, int32 rather than uint32 offsets, the
# environment's validation switch). Anything refused falls through to the named checks, which
# raise the precise error; the checked path itself is unchanged. Content checks are not skipped:
# without validation the CUDA path never reads the offsets on the host anyway.

#: (direction, device, ratio, coff, head_dim as passed[, deterministic]) -> _FastPlan
_fast_plans: dict = {}
_BF16, _F32, _I32 = torch.bfloat16, torch.float32, torch.int32


class _FastPlan:
    """A fully checked CUDA operator with its static facts and a prepared kernel launch."""

    __slots__ = ("op", "dev", "cols", "head_dim", "ratio", "ape_shape", "max_rows", "launch")

    def __init__(self, op, launch) -> None:
        cfg = op.config
        self.op, self.dev, self.launch = op, op.device, launch
        self.cols, self.head_dim, self.ratio = cfg.coff * cfg.head_dim, cfg.head_dim, cfg.ratio
        self.ape_shape = (cfg.ratio, self.cols)
        self.max_rows = (plan.INT32_LIMIT - 1) // cfg.head_dim

    def matches(self, kv, score, ape, cu_seqlens, cu_seqlens_comp) -> bool:
        """Everything the compiled entry point would check, in Python: for calls that launch
        nothing (zero output rows), which must refuse bad inputs all the same."""
        dev = self.dev
        return (kv.dtype is _BF16 and score.dtype is _BF16 and ape.dtype is _F32
                and kv.dim() == 2 and kv.shape[1] == self.cols and score.shape == kv.shape
                and ape.shape == self.ape_shape and cu_seqlens.dim() == 1
                and cu_seqlens_comp.shape == cu_seqlens.shape
                and kv.device == dev and score.device == dev and ape.device == dev
                and cu_seqlens.device == dev and cu_seqlens_comp.device == dev
                and kv.is_contiguous() and score.is_contiguous() and ape.is_contiguous()
                and cu_seqlens.is_contiguous() and cu_seqlens_comp.is_contiguous()
                and not (kv.data_ptr() | score.data_ptr() | ape.data_ptr()) & 15)

    def serves_operator(self, kv, cu_seqlens, cu_seqlens_comp, rows) -> bool:
        """An operator object's ``execute`` may launch directly: unlike the wrappers' lookup,
        nothing keyed the plan by kv's device, so it is compared here, and a call without rows
        launches nothing, so only the named checks can vet its tensors."""
        return kv.device == self.dev and rows > 0 and self.beyond_entry_checks(kv, cu_seqlens, cu_seqlens_comp, rows)

    def beyond_entry_checks(self, kv, cu_seqlens, cu_seqlens_comp, rows) -> bool:
        """What the compiled entry point does not check (see the comment above)."""
        return (type(rows) is int and 0 <= rows <= self.max_rows and kv.numel() < plan.INT32_LIMIT
                and (rows == 0 or kv.shape[0] >= self.ratio)
                and cu_seqlens.dtype is _I32 and cu_seqlens_comp.dtype is _I32
                and cu_seqlens.shape[0] >= 1 and not plan.validate_env_on())


def _fast_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, total_comp):
    """``out`` by the fast path, or None to take the checked path."""
    try:
        fp = _fast_plans.get(("forward", kv.device, ratio, coff, head_dim))
        if fp is None or not fp.beyond_entry_checks(kv, cu_seqlens, cu_seqlens_comp, total_comp):
            return None
        if total_comp == 0:
            if not fp.matches(kv, score, ape, cu_seqlens, cu_seqlens_comp):
                return None
            return kv.new_empty((0, fp.head_dim))
        out = kv.new_empty((total_comp, fp.head_dim))
        fp.launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, out)
    except Exception:  # refused by the entry point's checks (nothing launched): the checked path names it
        return None
    return out


def _fast_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim, deterministic,
                   compute_grad_ape=True):
    """``(grad_kv, grad_score, grad_ape)`` by the fast path, or None to take the checked path.
    The backward always launches (it zero-fills never-consumed slots), so the entry point's
    checks cover grad_out and the inputs even without rows."""
    try:
        fp = _fast_plans.get(("backward", kv.device, ratio, coff, head_dim, deterministic))
        if fp is None or not fp.beyond_entry_checks(kv, cu_seqlens, cu_seqlens_comp, grad_out.shape[0]):
            return None
    except Exception:  # anything odd: the checked path names it
        return None
    determinism_guard(deterministic)
    try:
        grads = (torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape) if compute_grad_ape else None)
        fp.launch(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, *grads)
    except Exception:  # refused by the entry point's checks (nothing launched): the checked path names it
        return None
    return grads


def _remember_fast(key, op, stream) -> None:
    """Offer a fully checked, compiled CUDA operator to the fast path (``key`` holds the
    arguments as the caller passed them, so the lookup needs no arithmetic)."""
    if op._fast is not None and stream is None:
        if len(_fast_plans) >= OP_CACHE_SIZE:
            _fast_plans.clear()
        _fast_plans[key] = op._fast


def _checked_inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, stream):
    plan.check_is_tensor("kv", kv)
    cfg = plan.make_config(kv, ratio, coff, head_dim)
    plan.check_inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, cfg, kv.device, _KV_DEVICE)
    _check_stream(stream, kv.device)
    return cfg


def csa_compressor_forward_wrapper(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio: int = 4,
                                   head_dim: Optional[int] = None, coff: int = 2,
                                   total_comp: Optional[int] = None, stream=None,
                                   validate: Optional[bool] = None) -> OpResult:
    """Allocate ``out`` (total_comp, head_dim) bf16 and run the forward pooling; returns
    ``{"out": out}``. ``total_comp=None`` reads ``cu_seqlens_comp[-1]`` (a sync on CUDA); pass it
    explicitly to stay sync-free and CUDA-graph capturable."""
    if stream is None and validate is None:
        out = _fast_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, total_comp)
        if out is not None:
            return OpResult(out=out)
    cfg = _checked_inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, stream)
    if total_comp is None:
        total_comp = int(cu_seqlens_comp[-1])
    total_comp = plan.check_rows("total_comp", total_comp, kv.shape[0], cfg)
    out = torch.empty((total_comp, cfg.head_dim), dtype=torch.bfloat16, device=kv.device)
    validate = plan.validate_requested(validate)
    op = _cached_op(
        ("forward", kv.device, cfg, validate),
        lambda: CSACompressorForward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio=cfg.ratio,
                                     coff=cfg.coff, head_dim=cfg.head_dim, validate=validate),
    )
    op._run(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, stream, "total_comp")
    _remember_fast(("forward", kv.device, ratio, coff, head_dim), op, stream)
    return OpResult(out=out)


def csa_compressor_backward_wrapper(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio: int = 4,
                                    head_dim: Optional[int] = None, coff: int = 2, stream=None,
                                    deterministic: bool = True, validate: Optional[bool] = None,
                                    compute_grad_ape: bool = True) -> OpResult:
    """Allocate the gradients and run the backward pooling; returns
    ``{"grad_kv", "grad_score", "grad_ape"}`` (also unpackable in that order). Gradients of
    padding rows (``cu_seqlens_comp[-1] <= row < grad_out.shape[0]``) are ignored.
    ``compute_grad_ape=False`` (a frozen ape) returns ``grad_ape`` None and skips its reduction."""
    if stream is None and validate is None and type(deterministic) is bool and type(compute_grad_ape) is bool:
        grads = _fast_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, ratio, coff, head_dim,
                               deterministic, compute_grad_ape)
        if grads is not None:
            return OpResult(grad_kv=grads[0], grad_score=grads[1], grad_ape=grads[2])
    cfg = _checked_inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio, coff, head_dim, stream)
    plan.check_row_operand("grad_out", grad_out, torch.bfloat16, cfg, kv.device)
    plan.check_rows("grad_out.shape[0]", grad_out.shape[0], kv.shape[0], cfg)
    deterministic = plan.check_flag("deterministic", deterministic)
    compute_grad_ape = plan.check_flag("compute_grad_ape", compute_grad_ape)
    grad_kv = torch.empty_like(kv)
    grad_score = torch.empty_like(score)
    grad_ape = torch.empty_like(ape) if compute_grad_ape else None
    validate = plan.validate_requested(validate)
    op = _cached_op(
        ("backward", kv.device, cfg, deterministic, validate),
        lambda: CSACompressorBackward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score,
                                      grad_ape, ratio=cfg.ratio, coff=cfg.coff, head_dim=cfg.head_dim,
                                      deterministic=deterministic, validate=validate),
    )
    op._run(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape, stream,
            "grad_out.shape[0]")
    _remember_fast(("backward", kv.device, ratio, coff, head_dim, deterministic), op, stream)
    return OpResult(grad_kv=grad_kv, grad_score=grad_score, grad_ape=grad_ape)
