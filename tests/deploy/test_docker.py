"""docker/Dockerfile: hadolint clean, its base image documented with the Triton release it carries, and its
pinned packages installable on that image's Python (3.10)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.deploy.conftest import REPO
from tests.deploy.dockerfile import parse

BIN = Path(sys.executable).parent
_RELEASE_ROW = re.compile(r"^\| `nvcr\.io/nvidia/tritonserver:(\S+)` \| (\d+\.\d+\.\d+) \| Python (3\.\d+) \|", re.M)
IMAGE_PYTHON = "3.10"
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)] + ["manylinux2014_x86_64", "linux_x86_64"]


def documented_releases() -> dict[str, str]:
    """docs/deploy.md's table of base image tags: tag → the Triton release it carries."""
    return {tag: release for tag, release, _ in _RELEASE_ROW.findall((REPO / "docs" / "deploy.md").read_text())}


def test_dockerfile_is_hadolint_clean(tmp_path: Path) -> None:
    result = subprocess.run([str(BIN / "hadolint"), str(REPO / "docker" / "Dockerfile")], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    unpinned = tmp_path / "Dockerfile"
    unpinned.write_text("FROM nvcr.io/nvidia/tritonserver:24.10-py3\nRUN pip install torch\n")
    result = subprocess.run([str(BIN / "hadolint"), str(unpinned)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3013" in result.stdout  # hadolint does reject an unpinned install


def test_documented_base_images_match_their_triton_release() -> None:
    """Every tag in the docs' table carries the Triton release listed: NVIDIA numbers them in step (release notes:
    21.08 = 2.13.0, 22.11 = 2.28.0, 24.05 = 2.46.0, 24.10 = 2.51.0, 24.12 = 2.53.0), so yy.mm is
    2.(12 (yy - 20) + mm - 7).0 up to 25.06; the container check also asks the served Triton for its version."""
    releases = documented_releases()
    tag = parse(REPO / "docker" / "Dockerfile").base.rsplit(":", 1)[1]
    assert tag in releases, f"docs/deploy.md does not list the Dockerfile's base image {tag}"
    for listed, release in releases.items():
        year, month = map(int, listed.split("-")[0].split("."))
        assert (year, month) <= (25, 6), f"{listed}: past 25.06 the numbering is not in step; check by hand"
        assert release == f"2.{12 * (year - 20) + month - 7}.0", listed
    row = next(r for r in _RELEASE_ROW.findall((REPO / "docs" / "deploy.md").read_text()) if r[0] == tag)
    assert row[2] == IMAGE_PYTHON


def _pins() -> list[Requirement]:
    lines = (REPO / "docker" / "requirements.txt").read_text().splitlines()
    return [Requirement(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]


def test_image_pins_resolve_for_the_images_python(tmp_path: Path) -> None:
    """Each pin has a CPython 3.10 wheel for Linux x86-64, and the pins agree with each other (torch's triton,
    transformers' tokenizers and safetensors). Asks PyPI for metadata only (pip --dry-run, no download)."""
    pins = {pin.name: pin for pin in _pins()}
    assert all(len(pin.specifier) == 1 and next(iter(pin.specifier)).operator == "==" for pin in pins.values())
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
               "--report", str(report), "--python-version", IMAGE_PYTHON, "--implementation", "cp",
               "--only-binary=:all:", "--target", str(tmp_path / "target"), *platforms, "--platform", "any",
               *(str(pin) for pin in pins.values())]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={"PIP_CONSTRAINT": ""})
    if "NewConnectionError" in result.stderr or "Network is unreachable" in result.stderr:
        pytest.fail(f"PyPI could not be reached:\n{result.stderr[-2000:]}")
    assert result.returncode == 0, result.stderr[-4000:]
    installed = {
        item["metadata"]["name"].lower(): item["metadata"] for item in json.loads(report.read_text())["install"]
    }
    assert set(installed) == {name.lower() for name in pins}
    versions = {name: str(next(iter(pin.specifier))).lstrip("=") for name, pin in pins.items()}
    for name, metadata in installed.items():
        assert SpecifierSet(metadata.get("requires_python") or "").contains(IMAGE_PYTHON + ".0"), name
        for requirement in map(Requirement, metadata.get("requires_dist", [])):
            marker_ok = requirement.marker is None or requirement.marker.evaluate(
                {"python_version": IMAGE_PYTHON, "platform_system": "Linux", "platform_machine": "x86_64",
                 "sys_platform": "linux", "extra": ""})  # fmt: skip
            if marker_ok and requirement.name in versions:
                assert requirement.specifier.contains(versions[requirement.name], prereleases=True), (
                    f"{name} requires {requirement}, pinned {versions[requirement.name]}"
                )
