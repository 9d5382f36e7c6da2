"""The server refuses NumPy 2, which Triton 2.51's Python-backend stub turns into corrupted inputs; a NumPy 1 for
the stub alone (SLORA_STUB_PYTHONPATH) is honoured, and packages built for NumPy 2 are hidden inside the stub."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from slora.backend import stub_compat
from slora.backend.launcher.cli import main


def _fake_numpy(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setitem(sys.modules, "numpy", types.SimpleNamespace(__version__=version))


def _numpy_folder(root: Path, version: str) -> Path:
    """A folder whose `numpy` is a stand-in reporting `version`."""
    (root / "numpy").mkdir(parents=True)
    (root / "numpy" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return root


def test_numpy_1_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_numpy(monkeypatch, "1.26.4")
    assert stub_compat.numpy_problem() is None


def test_numpy_2_refused_with_the_fixes_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_numpy(monkeypatch, "2.5.2")
    monkeypatch.delenv(stub_compat.ALLOW_ENV, raising=False)
    problem = stub_compat.numpy_problem()
    assert problem is not None and "numpy<2" in problem and "2.5.2" in problem
    assert stub_compat.STUB_PATH_ENV in problem
    monkeypatch.setenv(stub_compat.ALLOW_ENV, "1")
    assert stub_compat.numpy_problem() is None


def test_stub_numpy_version_is_read_with_the_stubs_first_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(stub_compat.STUB_PATH_ENV, str(_numpy_folder(tmp_path, "1.99.0")))
    assert stub_compat.stub_numpy_version(dict(os.environ)) == "1.99.0"


@pytest.mark.parametrize("model", ["slora"])
def test_model_shims_put_the_stub_folders_first(tmp_path: Path, model: str) -> None:
    """The stub ignores PYTHONPATH, so the model.py shim puts SLORA_STUB_PYTHONPATH first before importing anything."""
    first = tmp_path / "first"
    first.mkdir()
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "triton_python_backend_utils.py").write_text("TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1\n")
    shim = Path(__file__).parents[2] / "model_repository" / model / "1" / "model.py"
    script = f"import runpy, sys; runpy.run_path({str(shim)!r}); print(sys.path[0])"
    env = {**os.environ, stub_compat.STUB_PATH_ENV: str(first),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(first)


def test_launcher_checks_the_stubs_numpy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(stub_compat.ALLOW_ENV, raising=False)
    monkeypatch.setenv(stub_compat.STUB_PATH_ENV, str(_numpy_folder(tmp_path / "np2", "2.5.2")))
    assert main(["--model", "default", "--dry-run", "--workspace", str(tmp_path / "w2")]) == 1
    assert "NumPy 2.5.2" in caplog.text and "numpy<2" in caplog.text


def test_packages_built_for_numpy_2_are_hidden_in_the_stub(tmp_path: Path) -> None:
    """A scikit-learn whose import breaks under NumPy 1 is marked absent, so transformers skips it."""
    sklearn = tmp_path / "sklearn"
    sklearn.mkdir()
    (sklearn / "__init__.py").write_text("import numpy\nnumpy.long  # a NumPy 2 name: AttributeError under NumPy 1\n")
    (sklearn / "metrics.py").write_text("")
    script = textwrap.dedent(
        """
        import importlib.util, numpy
        from slora.backend.stub_compat import hide_packages_broken_by_numpy
        hidden = hide_packages_broken_by_numpy()
        if int(numpy.__version__.split(".")[0]) >= 2:
            assert hidden == [], hidden
        else:
            assert hidden == ["sklearn", "scipy"], hidden
            assert importlib.util.find_spec("sklearn") is None
            from transformers import AutoTokenizer  # imports without scikit-learn
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_working_scikit_learn_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text("")
    (tmp_path / "sklearn" / "metrics.py").write_text("")
    script = (
        "from slora.backend.stub_compat import hide_packages_broken_by_numpy as h; import sys; "
        "print(h(), sys.modules.get('sklearn', 0) is not None)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert result.stdout.strip() == "[] True", result.stderr[-2000:]
