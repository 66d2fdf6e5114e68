"""Test markers and shared fixtures.

``L0`` fast smoke tests run by default (``addopts = -m L0`` in pyproject.toml); ``L1`` is the full
matrix (``pytest -m "L0 or L1" test/python``). ``gpu`` tests skip cleanly without CUDA.
"""
import logging

import pytest
import torch

import csa_frontend.compressor.api as api


def pytest_configure(config):
    config.addinivalue_line("markers", "L0: fast smoke tests (run by default)")
    config.addinivalue_line("markers", "L1: the full operator and reference matrix")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_state(monkeypatch):
    """Each test starts with an empty operator cache, no validate env var and default
    determinism settings, and leaves them so."""
    monkeypatch.delenv("CSA_FRONTEND_VALIDATE", raising=False)
    api.clear_op_cache()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    api.clear_op_cache()


@pytest.fixture
def csa_log(caplog):
    caplog.set_level(logging.DEBUG, logger="csa_frontend")
    return caplog


def _online_window(monkeypatch, window, max_head_dim=None):
    """The online stream forward's window limit set to ``window`` (and its head-dim limit to
    ``max_head_dim``) for one test; planner and compile caches are emptied before and after, so
    neither side sees the other's schedules."""
    from csa_frontend.compressor.kernels import schedule
    from csa_testing import forget_plans

    forget_plans()
    monkeypatch.setattr(schedule, "STREAM_FWD_ONLINE_WINDOW", window)
    if max_head_dim is not None:
        monkeypatch.setattr(schedule, "STREAM_FWD_ONLINE_MAX_HEAD_DIM", max_head_dim)
    yield
    forget_plans()


@pytest.fixture
def online_forward(monkeypatch):
    """The online stream forward at its measured window limit (the default) and on every head
    dim (by default d512+ keep the pipeline, for speed alone), whatever the environment says."""
    from csa_frontend.compressor.kernels import schedule
    yield from _online_window(monkeypatch, schedule.STREAM_FWD_ONLINE_MEASURED_WINDOW, 1 << 30)


@pytest.fixture
def online_forward_off(monkeypatch):
    """The online stream forward off: short stream windows take the pipelined forward, as
    CSA_FRONTEND_STREAM_FWD_ONLINE=0 asks."""
    yield from _online_window(monkeypatch, 0)
