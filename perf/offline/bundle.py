"""The offline bundle: everything a GPU host without a package registry needs beyond Python, torch and this
repository, in one folder (default .whl/), to carry there and `source .whl/gpu-env.sh` (perf/offline/README.md).

    python3 perf/offline/bundle.py --dry-run        # the plan: each download and each file, nothing fetched
    python3 perf/offline/bundle.py                  # writes .whl/ (about 40 MB)
    python3 perf/offline/bundle.py --python 3.11 --out /tmp/bundle-py311

What goes in (the host's Python version decides the wheels' tags and the server's Python stub):
    tritonserver-py3XX.tar.xz  Triton 2.51's server, backends and the Python backend stub of that Python, cut
                               from the nvidia-pytriton wheel (its libpython copies for other Pythons left out)
    *.whl                      tritonclient, python-rapidjson, perf_analyzer, gguf, and the OpenAI API's server
                               (fastapi, starlette, uvicorn, pydantic): installed for every process
    stub/*.whl                 NumPy 1.26 for Triton 2.51's Python-backend stub alone (under NumPy 2 it corrupts
                               every input tensor: backend/stub_compat.py), while the host's own SciPy needs NumPy 2
    genai/*.whl                genai-perf 0.0.16 and the modules it imports that such hosts lack (perf/genai_perf.sh
                               installs them into a folder of its own)
    gpu-env.sh                 perf/offline/gpu-env.sh: installs the above under /tmp and exports the paths

Every wheel is fetched with `pip download --no-deps --only-binary=:all:` for CPython of `--python` on manylinux
x86_64, so the bundle can be made on any machine with pip and a registry. Nothing here runs on the GPU host.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("bundle")

HERE = Path(__file__).resolve().parent
ENV_SCRIPT = HERE / "gpu-env.sh"
LINUX = ("manylinux_2_38_x86_64", "manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_24_x86_64",
         "manylinux_2_17_x86_64", "manylinux2014_x86_64")  # fmt: skip
SERVER_WHEEL = "nvidia-pytriton==0.7.0"  # its tritonserver is Triton 2.51, the server slora-serve runs
SERVER_PARTS = ("pytriton/tritonserver/bin/", "pytriton/tritonserver/backends/", "pytriton/tritonserver/caches/",
                "nvidia_pytriton.libs/")  # fmt: skip
STUBS = "pytriton/tritonserver/python_backend_stubs/"
LIBPYTHON = re.compile(r"nvidia_pytriton\.libs/libpython3[^/]*\.(\d+)\.so[.\d]*$")


@dataclass(frozen=True)
class Download:
    """Wheels fetched into one folder of the bundle."""

    folder: str  # under the bundle's root; "" is the root
    requirements: tuple[str, ...]
    platforms: tuple[str, ...]
    why: str


DOWNLOADS = (
    Download("", ("tritonclient", "python-rapidjson", "perf_analyzer==2.60.0", "gguf"), LINUX,
             "the gRPC/HTTP client, perf_analyzer, and gguf (the default model's conversion), for every process"),
    Download("", ("fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "pydantic==2.14.4",
                  "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
                  "annotated-doc==0.0.7", "opentelemetry-api==1.45.2"), (*LINUX, "any"),
             "the OpenAI API's server (slora-serve --openai-port), versions tested together; anyio, h11 and httpx "
             "are on such hosts"),
    Download("stub", ("numpy==1.26.4",), ("manylinux_2_17_x86_64", "manylinux2014_x86_64"),
             "NumPy 1 for Triton 2.51's Python-backend stub alone (SLORA_STUB_PYTHONPATH)"),
    Download("genai", ("genai-perf==0.0.16", "orjson", "soundfile", "cffi", "pycparser"),
             ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "any"),
             "genai-perf and the modules it imports that a bare host lacks (perf/genai_perf.sh)"),
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What one bundle holds and how each part is made."""

    out: Path
    python: str  # "3.12"
    downloads: tuple[Download, ...] = DOWNLOADS
    server_wheel: str = SERVER_WHEEL
    env_script: Path = ENV_SCRIPT
    pip: tuple[str, ...] = (sys.executable, "-m", "pip")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d+", self.python):
            raise ValueError(f"python must be a version like 3.12, got {self.python!r}")

    @property
    def tag(self) -> str:
        return "py" + self.python.replace(".", "")

    @property
    def server_archive(self) -> Path:
        return self.out / f"tritonserver-{self.tag}.tar.xz"

    def download_command(self, download: Download) -> list[str]:
        platforms = [arg for platform in download.platforms for arg in ("--platform", platform)]
        return [*self.pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", self.python,
                "--implementation", "cp", *platforms, "-d", str(self.out / download.folder),
                *download.requirements]  # fmt: skip

    def server_command(self, folder: Path) -> list[str]:
        return [*self.pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", self.python,
                *[arg for platform in LINUX for arg in ("--platform", platform)], "-d", str(folder),
                self.server_wheel]  # fmt: skip

    def files(self) -> list[str]:
        """The bundle's files, relative to its root (a wheel as <name>-*.whl: its version is the registry's)."""
        wheels = [
            f"{d.folder + '/' if d.folder else ''}{_wheel_glob(r)}" for d in self.downloads for r in d.requirements
        ]
        return sorted([*wheels, self.server_archive.name, "gpu-env.sh"])


def _wheel_glob(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    return f"{re.sub(r'[-.]+', '_', name)}-{version or '*'}-*.whl"


def server_members(names: Iterable[str], python: str) -> list[str]:
    """The members of the pytriton wheel the server needs: bin, backends, caches, its libraries (but the libpython
    of any other Python) and the Python stub of `python`."""
    minor = python.split(".")[1]
    keep = []
    for name in names:
        if name.endswith("/"):
            continue
        other_python = (m := LIBPYTHON.match(name)) is not None and m.group(1) != minor
        if name.startswith(f"{STUBS}{python}/") or (name.startswith(SERVER_PARTS) and not other_python):
            keep.append(name)
    return keep


def cut_server(wheel: Path, archive: Path, python: str) -> int:
    """Write the server's members of `wheel` into the tar.xz `archive`, file modes kept; returns how many."""
    with zipfile.ZipFile(wheel) as source, tarfile.open(archive, "w:xz") as target:
        members = server_members(source.namelist(), python)
        if not any(name.startswith(f"{STUBS}{python}/") for name in members):
            raise ValueError(f"{wheel.name} has no Python {python} backend stub under {STUBS}")
        for name in members:
            info = source.getinfo(name)
            entry = tarfile.TarInfo(name)
            entry.size = info.file_size
            entry.mode = (info.external_attr >> 16) & 0o777 or 0o644
            with source.open(info) as data:
                target.addfile(entry, data)
    return len(members)


Run = Callable[[list[str]], None]


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True)


def build(plan: Plan, run: Run = _run, force: bool = False) -> None:
    """Make the bundle: the wheels, the server archive (kept if there, unless `force`), the env script."""
    for download in plan.downloads:
        (plan.out / download.folder).mkdir(parents=True, exist_ok=True)
        logger.info("wheels into %s/: %s (%s)", plan.out / download.folder, " ".join(download.requirements),
                    download.why)  # fmt: skip
        run(plan.download_command(download))
    if force or not plan.server_archive.is_file():
        with tempfile.TemporaryDirectory() as folder:
            run(plan.server_command(Path(folder)))
            wheel = next(Path(folder).glob("nvidia_pytriton-*.whl"))
            count = cut_server(wheel, plan.server_archive, plan.python)
            logger.info("%s: %d files of %s", plan.server_archive, count, wheel.name)
    shutil.copyfile(plan.env_script, plan.out / "gpu-env.sh")
    total = sum(f.stat().st_size for f in plan.out.rglob("*") if f.is_file())
    logger.info("bundle %s: %.1f MB; carry it to the host and `source %s/gpu-env.sh`", plan.out, total / 1e6,
                plan.out)  # fmt: skip


def describe(plan: Plan) -> list[str]:
    """The plan as lines: each command, then each file."""
    lines = [f"bundle for CPython {plan.python} on manylinux x86_64 in {plan.out}:"]
    lines += ["  $ " + " ".join(plan.download_command(d)) for d in plan.downloads]
    lines += [f"  $ {' '.join(plan.server_command(Path('<tmp>')))}",
              f"    cut: {', '.join(SERVER_PARTS)} and {STUBS}{plan.python}/ -> {plan.server_archive.name}",
              f"  copy {plan.env_script} -> {plan.out / 'gpu-env.sh'}", "files:"]  # fmt: skip
    return lines + [f"  {name}" for name in plan.files()]


def _not_ignored_warning(out: Path) -> None:
    """The bundle must not be committed (nor carried twice as part of the tree): say so if git would see it."""
    try:
        ignored = subprocess.run(["git", "check-ignore", "-q", str(out)], capture_output=True).returncode == 0
    except OSError:
        return
    if not ignored:
        logger.warning("%s is not ignored by git: echo /%s/ >> .git/info/exclude", out, out.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".whl"), help="the bundle's folder (default .whl)")
    parser.add_argument("--python", default="3.12", help="the GPU host's Python version (default 3.12)")
    parser.add_argument("--dry-run", action="store_true", help="show the plan, fetch nothing")
    parser.add_argument("--force", action="store_true", help="cut the server archive again even if it is there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = Plan(args.out, args.python)
    if args.dry_run:
        for line in describe(plan):
            logger.info("%s", line)
        return
    _not_ignored_warning(args.out)
    build(plan, force=args.force)


if __name__ == "__main__":
    main()
