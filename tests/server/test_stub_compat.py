"""The server refuses NumPy 2, which Triton 2.51's Python-backend stub turns into corrupted inputs."""

from __future__ import annotations

import sys
import types

import pytest

from slora.backend import stub_compat
from slora.backend.launcher import main


def _fake_numpy(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(__version__=version))


def test_numpy_1_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_numpy(monkeypatch, "1.26.4")
    assert stub_compat.numpy_problem() is None


def test_numpy_2_refused_with_the_fix_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_numpy(monkeypatch, "2.5.2")
    monkeypatch.delenv(stub_compat.ALLOW_ENV, raising=False)
    problem = stub_compat.numpy_problem()
    assert problem is not None and "numpy<2" in problem and "2.5.2" in problem
    monkeypatch.setenv(stub_compat.ALLOW_ENV, "1")
    assert stub_compat.numpy_problem() is None


def test_launcher_stops_before_starting_the_server(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("slora.backend.launcher.numpy_problem", lambda: "NumPy 2.5.2 ... install numpy<2")
    assert main(["--model", "default", "--dry-run"]) == 1
    assert "numpy<2" in caplog.text
