"""Find a Triton server, give its Python backend the stub that matches this interpreter, and say how to run it.

Where the server comes from, first found wins:
  1. $TRITONSERVER_ROOT          a folder with bin/tritonserver and backends/python
  2. /opt/tritonserver           the official container (nvcr.io/nvidia/tritonserver:<yy.mm>-py3)
  3. the nvidia-pytriton wheel   pytriton/tritonserver: the same server, with one stub per Python version

The Python backend runs each model in a stub process that embeds a Python interpreter: it must be built for this
interpreter's version, find its libpython (LD_LIBRARY_PATH) and this environment's packages (PYTHONPATH; and
SLORA_SITE_DIRS, which the model.py shims re-add as site dirs so that .pth files, e.g. of an editable install, are
processed; the stub itself ignores PYTHONPATH, so the shims also put SLORA_STUB_PYTHONPATH's folders first: see
stub_compat.py). When the server's own stub is for another Python version, a backend folder is laid out in the
workspace: links to the server's backends plus the wheel's stub for this version.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

STUB = "triton_python_backend_stub"
OFFICIAL_ROOT = Path("/opt/tritonserver")


class ServerNotFoundError(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path
    source: str
    env: dict[str, str] = field(default_factory=dict)  # to add to the server's environment


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def locate_server(workspace: Path) -> TritonInstall:
    """The server to run, with a Python backend whose stub matches this interpreter; raises ServerNotFoundError."""
    root, source = _server_root()
    binary = root / "bin" / "tritonserver"
    if not os.access(binary, os.X_OK):
        raise ServerNotFoundError(f"{binary} is missing or not executable ({source})")
    python_backend = root / "backends" / "python"
    if not (python_backend / "libtriton_python.so").is_file():
        raise ServerNotFoundError(f"{python_backend}/libtriton_python.so is missing: this server has no Python backend")
    backend_dir = root / "backends"
    if stub_python_version(python_backend / STUB) != python_version():
        backend_dir = _overlay_backends(root / "backends", workspace / "backends")
        if root != _wheel_root():
            logger.warning(
                "using the nvidia-pytriton wheel's Python %s stub with the Python backend of %s: both must "
                "come from the same Triton release (the wheel's is 2.51 = 24.10)",
                python_version(),
                root,
            )
    wheel = _wheel_root()
    wheel_libs = wheel.parent.parent / "nvidia_pytriton.libs" if wheel is not None else None
    env = _environment(wheel_libs if wheel_libs is not None and wheel_libs.is_dir() else None)
    logger.info("Triton server: %s (%s); Python backend stub for Python %s in %s", binary, source, python_version(),
                backend_dir / "python")  # fmt: skip
    return TritonInstall(binary, backend_dir, source, env)


def stub_python_version(stub: Path) -> str | None:
    """The Python version a backend stub was built for (from the libpython it links), or None."""
    if not stub.is_file():
        return None
    match = re.search(rb"libpython(3\.\d+)", stub.read_bytes())
    return match.group(1).decode() if match else None


def site_dirs() -> list[str]:
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def _server_root() -> tuple[Path, str]:
    configured = os.environ.get("TRITONSERVER_ROOT")
    if configured:
        return Path(configured), "TRITONSERVER_ROOT"
    if (OFFICIAL_ROOT / "bin" / "tritonserver").is_file():
        return OFFICIAL_ROOT, "the official container"
    wheel = _wheel_root()
    if wheel is not None and (wheel / "bin" / "tritonserver").is_file():
        return wheel, "the nvidia-pytriton wheel"
    raise ServerNotFoundError(
        "no Triton server found: set TRITONSERVER_ROOT to a folder with bin/tritonserver and backends/, "
        "run inside nvcr.io/nvidia/tritonserver:24.10-py3, or `pip install nvidia-pytriton`"
    )


def _wheel_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "tritonserver"


def _wheel_stub() -> Path:
    wheel = _wheel_root()
    stub = wheel / "python_backend_stubs" / python_version() / STUB if wheel else None
    if stub is None or not stub.is_file():
        raise ServerNotFoundError(
            f"the server's Python backend stub is not built for Python {python_version()}, and no stub for it "
            "was found in the nvidia-pytriton wheel (pip install nvidia-pytriton), or run with the Python "
            "the server was built for"
        )
    return stub


def _overlay_backends(source: Path, target: Path) -> Path:
    """target/: links to every backend of `source`, and a python/ whose stub is the one for this interpreter."""
    stub = _wheel_stub()
    if target.exists():
        shutil.rmtree(target)
    (target / "python").mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name != "python":
            (target / entry.name).symlink_to(entry.resolve())
    for entry in (source / "python").iterdir():
        if entry.name != STUB:
            (target / "python" / entry.name).symlink_to(entry.resolve())
    shutil.copy2(stub, target / "python" / STUB)
    return target


def _environment(wheel_libs: Path | None) -> dict[str, str]:
    libdir = sysconfig.get_config_var("LIBDIR")
    libraries = [p for p in (libdir, str(wheel_libs) if wheel_libs else None) if p]
    packages = site_dirs()
    return {
        "LD_LIBRARY_PATH": _join(libraries, os.environ.get("LD_LIBRARY_PATH")),
        "PYTHONPATH": _join(packages, os.environ.get("PYTHONPATH")),
        "SLORA_SITE_DIRS": os.pathsep.join(packages),
        "PATH": _join([str(Path(sys.executable).parent)], os.environ.get("PATH")),
        "SLORA_PYTHON": sys.executable,  # the engine process's interpreter (engine_process.py)
    }


def _join(first: list[str], rest: str | None) -> str:
    return os.pathsep.join([*first, *([rest] if rest else [])])
