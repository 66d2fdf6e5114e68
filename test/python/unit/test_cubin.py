"""Facts of the compiled stream kernels that size their grids: register counts read back from
cubins (``kernels/cubin.py``, on a hand-built ELF and on kernels compiled for sm_90a) and the
planner's shared-memory figure against the compiled launch."""
import struct

import pytest

from csa_frontend.compressor.kernels import cubin

pytestmark = pytest.mark.L0


def elf_with_nv_info(entries: bytes) -> bytes:
    """A minimal little-endian ELF64: a null section, the section-name table and ``.nv.info``."""
    names = b"\0.shstrtab\0.nv.info\0"
    header_size, entry_size = 64, 64
    names_at = header_size
    info_at = names_at + len(names)
    sections_at = info_at + len(entries)
    header = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, sections_at, 0, header_size, 0, 0, entry_size, 3, 1)
    null = bytes(entry_size)
    shstrtab = struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)
    nv_info = struct.pack("<IIQQQQIIQQ", 11, 0x70000000, 0, 0, info_at, len(entries), 0, 0, 4, 0)
    return header + names + entries + null + shstrtab + nv_info


def attribute(attr: int, *words: int) -> bytes:
    return struct.pack("<BBH", 4, attr, 4 * len(words)) + struct.pack(f"<{len(words)}I", *words)


def test_register_count_from_nv_info():
    entries = (struct.pack("<BBH", 1, 0x0A, 0)  # a payload-free attribute is skipped
               + attribute(0x2F, 7, 96) + attribute(0x11, 7, 0) + attribute(0x2F, 8, 125) + attribute(0x12, 7, 0))
    assert cubin.registers(elf_with_nv_info(entries)) == 125
    assert cubin.registers(elf_with_nv_info(attribute(0x11, 7, 0))) is None
    assert cubin.registers(None) is None and cubin.registers(b"") is None
    with pytest.raises(ValueError, match="ELF64"):
        cubin.registers(b"not a cubin at all, just bytes")


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim,direction", [(48, 2, 256, "bwd"), (160, 2, 128, "bwd"),
                                                           (128, 2, 512, "fwd"), (24, 1, 512, "fwd")])
def test_stream_kernels_report_their_residency(ratio, coff, head_dim, direction, monkeypatch):
    """The compiled stream kernel's CTAs per SM come from the registers ptxas gave it, as in
    its cubin (compiled here for sm_90a without a GPU)."""
    from csa_frontend.compressor.kernels import dispatch, schedule

    seen = []
    real = cubin.registers
    monkeypatch.setattr(dispatch, "registers", lambda blob: seen.append(real(blob)) or seen[-1])
    sched = schedule.choose_schedule(ratio, coff, head_dim, direction)
    build = dispatch._build_forward if direction == "fwd" else dispatch._build_backward
    per_sm = build(ratio, coff, head_dim, sched, "sm_90a")[-1]
    assert len(seen) == 1 and 16 <= seen[0] <= 255
    assert per_sm == schedule.resident_ctas_per_sm(sched.threads, seen[0]) >= 1


@pytest.mark.L1
def test_missing_register_count_falls_back_to_the_assumed_one(monkeypatch, caplog):
    """A cubin without a count (another DSL version, say) still gives a grid: the 128-register
    assumption of the thread targets, with a warning that says so."""
    from csa_frontend.compressor.kernels import dispatch, schedule

    monkeypatch.setattr(dispatch, "registers", lambda blob: None)
    sched = schedule.choose_schedule(48, 2, 256, "bwd")
    with caplog.at_level("WARNING", logger="csa_frontend"):
        per_sm = dispatch._build_backward(48, 2, 256, sched, "sm_90a")[-1]
    assert per_sm == schedule.resident_ctas_per_sm(sched.threads, schedule.ASSUMED_REGISTERS)
    assert "no register count" in caplog.text


@pytest.mark.L1
def test_artifact_dumps_stay_where_the_developer_asked(tmp_path):
    """With CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR set (ptxas and register studies,
    ``benchmark/csa/window_registers.py``), a stream kernel's PTX lands in that directory, not in
    the temporary one its cubin is otherwise read from."""
    import os
    import subprocess
    import sys

    code = ("from csa_frontend.compressor.kernels import dispatch, schedule as s\n"
            "print(dispatch._build_backward(48, 2, 256, s.choose_schedule(48, 2, 256, 'bwd'), 'sm_90a')[-1])")
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) >= 1
    assert list(tmp_path.glob("*StreamBackward*.ptx")) and list(tmp_path.glob("*StreamBackward*.cubin"))


@pytest.mark.L1
@pytest.mark.parametrize("ratio,coff,head_dim,direction", [
    (100, 1, 512, "fwd"), (25, 2, 128, "fwd"), (128, 2, 512, "fwd"), (200, 2, 65, "fwd"),
    (48, 2, 256, "bwd"), (128, 2, 512, "bwd"), (16, 2, 256, "bwd"), (33, 1, 66, "bwd"), (200, 2, 65, "bwd")])
def test_planned_shared_memory_is_the_compiled_launchs(ratio, coff, head_dim, direction):
    """``schedule.stream_shared_bytes`` (what the residency may count) is the dynamic shared
    memory the compiled host code launches the kernel with: a constant of its IR (staged and
    unstaged, 224- to 512-thread CTAs, the backward's once-per-CTA combine)."""
    import re

    from csa_frontend.compressor.kernels import dispatch, schedule

    sched = schedule.choose_schedule(ratio, coff, head_dim, direction)
    build = dispatch._build_forward if direction == "fwd" else dispatch._build_backward
    ir = str(build(ratio, coff, head_dim, sched, "sm_90a")[0].ir_module)
    constants = {int(v) for v in re.findall(r"llvm\.mlir\.constant\((\d+) : i(?:32|64)\)", ir)}
    assert schedule.stream_shared_bytes(sched, direction) in constants
