"""Pure-Python planning of a compressor call: the static configuration and every input check.

Nothing here launches work on a device. Structural checks (dtype, rank, shape relations,
device, contiguity, 16-byte alignment, the ratio/coff/head_dim envelope, int32 limits) read only
tensor metadata, so they accept ``TensorDesc`` objects and ``meta`` tensors as well as real
tensors. Content checks of the offset arrays read their values: free for CPU tensors, a device
synchronisation for CUDA tensors, hence opt-in there (``validate=True`` or
``CSA_FRONTEND_VALIDATE=1``).

Every error names the argument and the expected value, e.g.
``kv: expected dtype torch.bfloat16, got torch.float32``.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch

from ..api_base import TensorDesc, tensor_misalignment, POINTER_ALIGNMENT

RATIO_RANGE = (1, 256)
HEAD_DIM_RANGE = (1, 4096)
COFF_VALUES = (1, 2)
INT32_LIMIT = 2**31  # every offset a kernel computes must stay below this
VALIDATE_ENV = "CSA_FRONTEND_VALIDATE"

KV_DTYPE = torch.bfloat16
APE_DTYPE = torch.float32
OFFSET_DTYPE = torch.int32


@dataclass(frozen=True)
class CompressorConfig:
    """Static facts a compiled kernel depends on; token and segment counts are dynamic."""

    ratio: int
    coff: int
    head_dim: int

    @property
    def cols(self) -> int:
        """Columns of kv/score/ape: ``coff * head_dim``."""
        return self.coff * self.head_dim

    @property
    def window(self) -> int:
        """Positions pooled into one output row: ``coff * ratio``."""
        return self.coff * self.ratio


# -- scalars ---------------------------------------------------------------------------------

def check_int(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``; bools and non-integers are rejected."""
    if type(value) is int:  # the common case, kept cheap: this runs on every call
        v = value
    elif isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value!r}")
    else:
        v = operator.index(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {v}")
    return v


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value


def check_coff(coff) -> int:
    if type(coff) is int and coff in COFF_VALUES:
        return coff
    if isinstance(coff, bool) or not hasattr(type(coff), "__index__") or operator.index(coff) not in COFF_VALUES:
        raise ValueError(f"coff: expected 1 or 2, got {coff!r}")
    return operator.index(coff)


def make_config(kv, ratio, coff, head_dim) -> CompressorConfig:
    """Check the scalar envelope; ``head_dim=None`` is inferred as ``kv.shape[1] // coff``."""
    ratio = check_int("ratio", ratio, *RATIO_RANGE)
    coff = check_coff(coff)
    if head_dim is None:
        check_is_tensor("kv", kv)
        if kv.dim() != 2:
            raise ValueError(f"kv: expected a 2-D tensor (T, coff*head_dim), got shape {tuple(kv.shape)}")
        cols = kv.shape[1]
        if cols % coff or not HEAD_DIM_RANGE[0] <= cols // coff <= HEAD_DIM_RANGE[1]:
            raise ValueError(
                f"head_dim: expected an int in {list(HEAD_DIM_RANGE)} inferred as kv.shape[1] // coff "
                f"with kv.shape[1] a multiple of coff={coff}, got kv.shape[1]={cols}"
            )
        head_dim = cols // coff
    head_dim = check_int("head_dim", head_dim, *HEAD_DIM_RANGE)
    return _config(ratio, coff, head_dim)


@lru_cache(maxsize=1024)
def _config(ratio: int, coff: int, head_dim: int) -> CompressorConfig:
    return CompressorConfig(ratio, coff, head_dim)


def _raw_environ_key():
    """CPython keeps os.environ's encoded entries in ``_data``; a membership test there costs
    ~50 ns, ``os.environ.get`` ~600 ns (it encodes the key and decodes the value every call)."""
    try:
        data, key = os.environ._data, os.environ.encodekey(VALIDATE_ENV)  # type: ignore[attr-defined]
    except Exception:
        return None, None
    return (data, key) if isinstance(data, dict) else (None, None)


_ENV_DATA, _ENV_KEY = _raw_environ_key()


def validate_env_on() -> bool:
    """``CSA_FRONTEND_VALIDATE`` as a flag, read per call (the wrappers' hot path asks first)."""
    if _ENV_KEY is not None and _ENV_KEY not in _ENV_DATA:
        return False
    return os.environ.get(VALIDATE_ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")


def validate_requested(validate: Optional[bool]) -> bool:
    """``validate=None`` defers to the ``CSA_FRONTEND_VALIDATE`` environment variable."""
    if validate is None:
        return validate_env_on()
    return check_flag("validate", validate)


def arch_from_capability(capability: Tuple[int, int]) -> str:
    """CUDA compute capability -> the target name the kernels are compiled for."""
    major, minor = capability
    if major == 8:
        return "sm_80"  # one sm_80 binary serves every Ampere/Ada part
    if major in (9, 10):
        return f"sm_{major}{minor}a"  # arch-specific features (TMA, wgmma/tcgen05)
    return f"sm_{major}{minor}"


# -- tensor metadata ---------------------------------------------------------------------------

def check_is_tensor(name: str, t) -> None:
    if not isinstance(t, (torch.Tensor, TensorDesc)):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _fmt_shape(shape: Sequence[Optional[int]], names: Sequence[str]) -> str:
    """As Python prints a shape tuple, so the expected and the actual shape read alike."""
    items = [n if s is None else str(s) for s, n in zip(shape, names)]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def check_tensor(
    name: str,
    t,
    dtype: torch.dtype,
    shape: Sequence[Optional[int]],
    dims: Sequence[str],
    device: torch.device,
    device_origin: str,
) -> None:
    """Check one operand; ``shape`` holds the expected extents, None where any extent is fine
    (``dims`` names each extent for the message, e.g. ``("T", "coff*head_dim")``). Written for
    the per-call path: a handful of attribute reads when everything is right."""
    if not isinstance(t, torch.Tensor):
        check_is_tensor(name, t)
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    actual = t.shape
    if len(actual) != len(shape):
        raise ValueError(
            f"{name}: expected a {len(shape)}-D tensor {_fmt_shape([None] * len(dims), dims)}, "
            f"got shape {tuple(actual)}"
        )
    for expected, extent in zip(shape, actual):
        if expected is not None and expected != extent:
            raise ValueError(
                f"{name}: expected shape {_fmt_shape([None] * len(dims), dims)} = {_fmt_shape(shape, dims)}, "
                f"got {tuple(actual)}"
            )
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} ({device_origin}), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous (row-major) tensor, got strides {tuple(t.stride())} "
            f"for shape {tuple(actual)}"
        )
    off = tensor_misalignment(t)
    if off:
        raise ValueError(
            f"{name}: expected data_ptr aligned to {POINTER_ALIGNMENT} bytes, got an address "
            f"{off} bytes past a {POINTER_ALIGNMENT}-byte boundary"
        )


def _check_int32_extent(name: str, what: str, value: int) -> None:
    if value >= INT32_LIMIT:
        raise ValueError(f"{name}: expected {what} < 2**31 (int32 offsets), got {value}")


def check_inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, cfg: CompressorConfig,
                 device: torch.device, device_origin: str) -> None:
    """The five inputs both directions share."""
    cols = cfg.cols
    tok = ("T", "coff*head_dim")
    check_tensor("kv", kv, KV_DTYPE, (None, cols), tok, device, device_origin)
    num_tokens = kv.shape[0]
    _check_int32_extent("kv", "T*coff*head_dim", num_tokens * cols)
    same_device = "the device of kv"
    check_tensor("score", score, KV_DTYPE, (num_tokens, cols), tok, device, same_device)
    check_tensor("ape", ape, APE_DTYPE, (cfg.ratio, cols), ("ratio", "coff*head_dim"), device, same_device)
    check_tensor("cu_seqlens", cu_seqlens, OFFSET_DTYPE, (None,), ("B+1",), device, same_device)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens: expected at least 1 element (B+1 offsets, B >= 0), got shape (0,)")
    check_tensor("cu_seqlens_comp", cu_seqlens_comp, OFFSET_DTYPE, (cu_seqlens.shape[0],),
                 ("len(cu_seqlens)",), device, same_device)


def check_rows(name: str, rows, num_tokens: int, cfg: CompressorConfig) -> int:
    """Checks on the output row count ``total_comp`` (``name`` is how the caller gave it)."""
    rows = check_int(name, rows, 0, INT32_LIMIT - 1)
    _check_int32_extent(name, "total_comp*head_dim", rows * cfg.head_dim)
    if rows > 0 and num_tokens < cfg.ratio:
        raise ValueError(
            f"kv: expected at least ratio={cfg.ratio} tokens when {name}={rows} > 0 (padding rows "
            f"pool tokens 0..ratio-1), got T={num_tokens}"
        )
    return rows


def check_row_operand(name: str, t, dtype: torch.dtype, cfg: CompressorConfig, device: torch.device) -> None:
    """``out`` / ``grad_out``: (total_comp, head_dim); the row count is checked by check_rows."""
    check_tensor(name, t, dtype, (None, cfg.head_dim), ("total_comp", "head_dim"), device, "the device of kv")


def check_forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, cfg: CompressorConfig,
                  device: torch.device, device_origin: str) -> None:
    check_inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, cfg, device, device_origin)
    check_row_operand("out", out, KV_DTYPE, cfg, device)
    check_rows("out.shape[0]", out.shape[0], kv.shape[0], cfg)


def check_backward(kv, score, ape, cu_seqlens, cu_seqlens_comp, grad_out, grad_kv, grad_score, grad_ape,
                   cfg: CompressorConfig, device: torch.device, device_origin: str) -> None:
    check_inputs(kv, score, ape, cu_seqlens, cu_seqlens_comp, cfg, device, device_origin)
    check_row_operand("grad_out", grad_out, KV_DTYPE, cfg, device)
    check_rows("grad_out.shape[0]", grad_out.shape[0], kv.shape[0], cfg)
    check_gradients(grad_kv, grad_score, grad_ape, kv, cfg, device)


def check_gradients(grad_kv, grad_score, grad_ape, kv, cfg: CompressorConfig, device: torch.device) -> None:
    """The three gradient buffers mirror kv, score and ape; ``grad_ape`` may be None (not
    computed: a frozen ape)."""
    tok = ("T like kv", "coff*head_dim")
    for name, t in (("grad_kv", grad_kv), ("grad_score", grad_score)):
        check_tensor(name, t, dtype=KV_DTYPE, shape=(kv.shape[0], cfg.cols), dims=tok, device=device,
                     device_origin="the device of kv")
    if grad_ape is None:
        return
    check_tensor("grad_ape", grad_ape, dtype=APE_DTYPE, shape=(cfg.ratio, cfg.cols),
                 dims=("ratio", "coff*head_dim"), device=device, device_origin="the device of kv")


# -- offset contents ---------------------------------------------------------------------------

def _first_true(mask: torch.Tensor) -> int:
    """Index of the first True of a 1-D CPU bool tensor, or -1."""
    idx = torch.nonzero(mask)
    return int(idx[0, 0]) if idx.numel() else -1


def check_offsets(cu_seqlens: torch.Tensor, cu_seqlens_comp: torch.Tensor, num_tokens: int,
                  ratio: int, total_comp: int, rows_name: str = "total_comp") -> None:
    """Content checks of the offset arrays (structure already checked). Copies them to the host:
    a synchronisation when they live on a GPU."""
    # One device-to-host copy (one synchronisation) for both arrays.
    cu, comp = torch.cat((cu_seqlens, cu_seqlens_comp)).to("cpu", torch.int64).split(cu_seqlens.shape[0])
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    bad = _first_true(lengths < 0)
    if bad >= 0:
        raise ValueError(
            f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{bad + 1}] = {int(cu[bad + 1])} "
            f"< cu_seqlens[{bad}] = {int(cu[bad])}"
        )
    bad = _first_true(cu > num_tokens)  # offsets are non-decreasing: from here on all are beyond T
    if bad >= 0:
        raise ValueError(
            f"cu_seqlens: expected cu_seqlens[{bad}] <= T = kv.shape[0] = {num_tokens} (offsets end at or "
            f"below the token count), got {int(cu[bad])}"
        )
    expected = torch.zeros_like(comp)
    torch.cumsum(lengths // ratio, 0, out=expected[1:])
    bad = _first_true(comp != expected)
    if bad >= 0:
        raise ValueError(
            f"cu_seqlens_comp: expected cu_seqlens_comp[{bad}] == {int(expected[bad])} (running sum of "
            f"seqlen // ratio over cu_seqlens, ratio={ratio}), got {int(comp[bad])}"
        )
    if total_comp < int(comp[-1]):
        raise ValueError(
            f"{rows_name}: expected total_comp >= cu_seqlens_comp[-1] = {int(comp[-1])}, got {total_comp}"
        )
