"""perf/offline: the bundle's plan (downloads, files), the server cut from a stand-in pytriton wheel, and gpu-env.sh
sourced over the result, all without fetching anything."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from perf.offline import bundle

REPO = Path(__file__).resolve().parents[2]
HOST_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
WHEEL_FILES = {  # name -> executable, as in nvidia_pytriton-0.7.0 (plus what must stay out)
    "pytriton/tritonserver/bin/tritonserver": True,
    "pytriton/tritonserver/backends/python/libtriton_python.so": False,
    "pytriton/tritonserver/backends/python/triton_python_backend_utils.py": False,
    "pytriton/tritonserver/caches/local/libtritoncache_local.so": False,
    f"pytriton/tritonserver/python_backend_stubs/{HOST_PYTHON}/triton_python_backend_stub": True,
    "pytriton/tritonserver/python_backend_stubs/3.8/triton_python_backend_stub": True,
    "nvidia_pytriton.libs/libcudart-09529672.so.12.6.77": True,
    "nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0": True,
    "pytriton/proxy/model_client.py": False,
    "nvidia_pytriton-0.7.0.dist-info/WHEEL": False,
}


def _fake_wheel(folder: Path) -> Path:
    path = folder / "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, executable in WHEEL_FILES.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if executable else 0o644) << 16
            body = "#!/bin/sh\necho triton\n" if name.endswith("tritonserver") else name
            wheel.writestr(info, body)
    return path


def test_plan_lists_every_download_and_file(tmp_path: Path) -> None:
    plan = bundle.Plan(tmp_path / ".whl", "3.12", pip=("pip",))
    stub = next(d for d in plan.downloads if d.folder == "stub")
    assert plan.download_command(stub) == [
        "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
        "cp", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d",
        str(tmp_path / ".whl" / "stub"), "numpy==1.26.4",
    ]  # fmt: skip
    assert plan.server_command(Path("/t"))[-3:] == ["-d", "/t", "nvidia-pytriton==0.7.0"]
    assert plan.files() == [
        "annotated_doc-0.0.7-*.whl", "annotated_types-0.8.0-*.whl", "fastapi-0.165.0-*.whl",
        "genai/cffi-*-*.whl", "genai/genai_perf-0.0.16-*.whl", "genai/orjson-*-*.whl", "genai/pycparser-*-*.whl",
        "genai/soundfile-*-*.whl", "gguf-*-*.whl", "gpu-env.sh", "opentelemetry_api-1.45.2-*.whl",
        "perf_analyzer-2.60.0-*.whl",
        "pydantic-2.14.4-*.whl", "pydantic_core-2.50.5-*.whl", "python_rapidjson-*-*.whl", "starlette-1.10.0-*.whl",
        "stub/numpy-1.26.4-*.whl", "tritonclient-*-*.whl", "tritonserver-py312.tar.xz",
        "typing_inspection-0.4.5-*.whl", "uvicorn-0.54.0-*.whl",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="python"):
        bundle.Plan(tmp_path, "312")


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_server_cut_keeps_the_server_and_this_pythons_stub(python: str) -> None:
    kept = set(bundle.server_members([*WHEEL_FILES, "pytriton/tritonserver/bin/"], python))
    assert {n for n in kept if "python_backend_stubs" in n} == (
        {f"pytriton/tritonserver/python_backend_stubs/{python}/triton_python_backend_stub"} & set(WHEEL_FILES)
    )
    assert (
        "pytriton/tritonserver/bin/tritonserver" in kept
        and "nvidia_pytriton.libs/libcudart-09529672.so.12.6.77" in kept
    )
    assert ("nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0" in kept) == (python == "3.13")
    assert not any(n.startswith(("pytriton/proxy/", "nvidia_pytriton-")) or n.endswith("/") for n in kept)


def test_bundle_made_from_stand_ins_serves_gpu_env(tmp_path: Path) -> None:
    """build() with a pip that fetches nothing but the stand-in server wheel; then gpu-env.sh, sourced, unpacks the
    server once, puts this Python's stub in place and exports the paths."""
    commands: list[list[str]] = []

    def fake_pip(command: list[str]) -> None:
        commands.append(command)
        if command[-1] == bundle.SERVER_WHEEL:
            _fake_wheel(Path(command[command.index("-d") + 1]))

    plan = bundle.Plan(tmp_path / "bundle", HOST_PYTHON, pip=("pip",))
    bundle.build(plan, run=fake_pip)
    assert len(commands) == len(bundle.DOWNLOADS) + 1
    with tarfile.open(plan.server_archive) as archive:
        modes = {m.name: m.mode for m in archive.getmembers()}
    assert modes["pytriton/tritonserver/bin/tritonserver"] == 0o755
    assert (tmp_path / "bundle" / "gpu-env.sh").read_text() == (REPO / "perf/offline/gpu-env.sh").read_text()
    bundle.build(plan, run=fake_pip)  # the server archive is kept: no second server download
    assert sum(c[-1] == bundle.SERVER_WHEEL for c in commands) == 1

    script = ('source "$1/gpu-env.sh"; printf "%s\\n" "$TRITONSERVER_ROOT" "$PERF_ANALYZER" '
              '"${SLORA_STUB_PYTHONPATH-unset}"; "$TRITONSERVER_ROOT/bin/tritonserver"; '
              'test -x "$TRITONSERVER_ROOT/backends/python/triton_python_backend_stub" && echo stub')  # fmt: skip
    env = {**os.environ, "SLORA_OFFLINE_DIR": str(tmp_path / "host"), "PY": sys.executable}
    env.pop("SLORA_STUB_PYTHONPATH", None)
    done = subprocess.run(["bash", "-c", script, "_", str(plan.out)], env=env, capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    root = tmp_path / "host" / "triton" / "pytriton" / "tritonserver"
    assert done.stdout.splitlines() == [str(root), str(tmp_path / "host/site/perf_analyzer/bin/perf_analyzer"),
                                        "unset", "triton", "stub"]  # fmt: skip
    assert "no Triton Python stub" not in done.stderr


def test_wrapper_shows_the_plan_without_fetching() -> None:
    done = subprocess.run(["bash", str(REPO / "perf/offline/gpu_wheels.sh"), "--dry-run", "--python", "3.11"],
                          env={**os.environ, "PY": sys.executable}, capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    assert "tritonserver-py311.tar.xz" in done.stderr and "stub/numpy-1.26.4-*.whl" in done.stderr
    assert not (REPO / ".whl" / "tritonserver-py311.tar.xz").exists()
