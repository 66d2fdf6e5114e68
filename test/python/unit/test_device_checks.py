"""test/python/gpu/device_checks.sh on CPU: its steps' commands, bad steps refused before anything
runs, and a suite or fuzz step that saw no GPU not reported as a pass (the device session's one
command must not turn a missing GPU into green)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "test" / "python" / "gpu" / "device_checks.sh"


def run(*steps, **env):
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("DEVICE_CHECKS_", "SANITIZE_"))}
    full = {**inherited, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *steps], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=600)


def dry_run(*steps, **env):
    result = run(*steps, DEVICE_CHECKS_DRY_RUN="1", **env)
    assert result.returncode == 0, result.stderr
    return dict(line.split(": ", 1) for line in result.stdout.splitlines())


@pytest.mark.L0
def test_suite_is_ctests_gpu_suite():
    # run_suite.py gpu takes the gpu marker over all of test/python: no file list to fall behind
    assert dry_run("suite", DEVICE_CHECKS_WORKERS="0")["suite"] == f"{sys.executable} test/python/run_suite.py gpu -q"


@pytest.mark.L0
def test_step_commands():
    commands = dry_run("fuzz:18898-19097", "table", "sanitize", DEVICE_CHECKS_LOG_DIR="/tmp/dc_probe")
    assert commands["sanitize"] == "SANITIZE_LOG_DIR='/tmp/dc_probe/sanitize' bash test/python/gpu/sanitize.sh"
    assert commands["fuzz:18898-19097"].startswith("CSA_FRONTEND_FUZZ_SEEDS=18898-19097 ")
    assert "test/python/gpu/test_fuzz.py" in commands["fuzz:18898-19097"]
    assert "--shapes all --providers fused,eager,copy --out '/tmp/dc_probe/table'" in commands["table"]
    assert "targets.py '/tmp/dc_probe/table/bench_csa_compressor.json'" in commands["table"]


@pytest.mark.L0
@pytest.mark.parametrize("steps, message", [
    ((), "no step given"),
    (("suite", "bogus"), "unknown step 'bogus'"),
    (("fuzz:9-3",), "step 'fuzz:9-3': expected fuzz:A-B"),
    (("fuzz:1",), "step 'fuzz:1': expected fuzz:A-B"),
])
def test_bad_steps_refused_before_anything_runs(tmp_path, steps, message):
    logs = tmp_path / "logs"
    result = run(*steps, DEVICE_CHECKS_LOG_DIR=str(logs))
    assert result.returncode == 2 and message in result.stderr
    assert not logs.exists()


@pytest.mark.L0
def test_bad_worker_count_refused(tmp_path):
    result = run("suite", DEVICE_CHECKS_WORKERS="many", DEVICE_CHECKS_LOG_DIR=str(tmp_path / "logs"))
    assert result.returncode == 2 and "DEVICE_CHECKS_WORKERS" in result.stderr


@pytest.mark.L0
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU verdict")
@pytest.mark.parametrize("step, summary", [("suite", "no CUDA device"), ("fuzz:1-1", "1 skipped")])
def test_no_gpu_is_not_a_pass(tmp_path, step, summary):
    pythonpath = os.pathsep.join([str(ROOT / "python"), str(ROOT / "test" / "python"),
                                  os.environ.get("PYTHONPATH", "")])
    result = run(step, DEVICE_CHECKS_LOG_DIR=str(tmp_path), DEVICE_CHECKS_WORKERS="0", PYTHONPATH=pythonpath)
    assert result.returncode == 1, result.stdout + result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith(step))
    assert re.search(f"NOTHING RAN .*{summary}", line), line
    assert (tmp_path / f"{step.replace(':', '_')}.log").exists()
