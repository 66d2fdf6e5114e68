"""Facts read back from a compiled kernel's cubin (an ELF file), for planning its launches.

The stream kernels' grids are sized to the CTAs an SM holds at once, which depends on the
registers ptxas gave the kernel: only the compiled code knows it, so it is read here from the
``.nv.info`` section (attribute ``EIATTR_REGCOUNT``) rather than guessed.
"""
from __future__ import annotations

import struct
from typing import Optional

_NV_INFO = b".nv.info"
_EIATTR_REGCOUNT = 0x2F
_EIFMT_SVAL = 4  # attribute with a 16-bit payload size


def _sections(elf: bytes):
    """(name, offset, size) of each section of a little-endian ELF64 file."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not an ELF64 file")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    for name_off, _type, _flags, _addr, offset, size in headers:
        end = elf.index(b"\0", names + name_off)
        yield elf[names + name_off:end], offset, size


def registers(cubin: Optional[bytes]) -> Optional[int]:
    """Registers per thread of the cubin's kernels (the most of any), or None where the cubin
    is missing or carries no register count."""
    if not cubin:
        return None
    counts = []
    for name, offset, size in _sections(cubin):
        if name != _NV_INFO:
            continue
        pos, end = offset, offset + size
        while pos + 4 <= end:
            fmt, attr, payload = struct.unpack_from("<BBH", cubin, pos)
            if fmt != _EIFMT_SVAL:  # payload-free attribute: its 16 bits are the value
                pos += 4
                continue
            if attr == _EIATTR_REGCOUNT and payload >= 8:
                counts.append(struct.unpack_from("<I", cubin, pos + 8)[0])  # (function index, count)
            pos += 4 + payload
    return max(counts) if counts else None
