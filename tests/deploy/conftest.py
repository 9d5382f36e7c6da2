"""Fixtures of the deployment tests: the rendered Kustomize overlays and the shipped endpoint picker config."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.deploy.kustomize import Doc, render

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "docker" / "k8s"
OVERLAYS = ("pvc", "object-store")


def load_script(path: Path) -> ModuleType:
    """A script of docker/ (not a package: `docker` is also the Docker SDK's name) as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Doc]]:
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="session")
def epp_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((K8S / "base" / "router" / "epp-config.yaml").read_text())
    return config
