"""The container, checked without Docker: docker/Dockerfile's steps (its copies, its RUN steps with its
environment and build argument, so docker/install.sh and docker/requirements.txt's pins) in a fresh virtualenv
under a folder that stands for the image's root, then its entrypoint serves a request.

What differs from the image, and why: the interpreter is this machine's Python (3.11; the image's is 3.10,
whose pins test_docker.py resolves), torch==2.13.0 resolves to the CPU build on this machine's disk, Triton 2.51
comes from the nvidia-pytriton wheel instead of /opt/tritonserver (the same release: checked at /v2), pip keeps
its cache (PIP_NO_CACHE_DIR only keeps layers small). The /cache volume starts empty, as a new container's: the
default model is converted on the first start, as in the image.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO
from tests.deploy.dockerfile import Dockerfile, parse
from tests.deploy.test_docker import documented_releases
from tests.serving.conftest import _free_ports, _wait_ready
from tests.serving.triton_calls import run_one, token_inputs

pytestmark = [pytest.mark.slow, pytest.mark.server]

PYTRITON = "nvidia-pytriton==0.7.0"  # stands for the base image's /opt/tritonserver (Triton 2.51)
INSTALL_TIMEOUT_S = 1500


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _copy_sources(image: Dockerfile, root: Path) -> None:
    for sources, destination, workdir in image.copies:
        target = _under(root, workdir) / destination
        for source in sources:
            origin = REPO / source
            into = target / origin.name if destination.endswith("/") else target
            into.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_dir():
                shutil.copytree(origin, into, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(origin, into)


def _environment(image: Dockerfile, env: dict[str, str], root: Path, venv: Path) -> dict[str, str]:
    mapped = {key: str(_under(root, value)) if value.startswith("/") else value for key, value in env.items()}
    mapped.pop("PIP_NO_CACHE_DIR", None)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    return {**base, **mapped, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def _run(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                timeout=INSTALL_TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{log.read_text()[-6000:]}"


def test_image_install_steps_serve_a_request(tmp_path: Path, default_model_dir: Path) -> None:
    image = parse(REPO / "docker" / "Dockerfile")
    root, log = tmp_path / "image", tmp_path / "install.log"
    _copy_sources(image, root)
    venv = root / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", str(venv)], check=True, timeout=300)  # type: ignore[attr-defined]
    args = {**image.args, "DEFAULT_MODEL": "1"}  # docker build --build-arg DEFAULT_MODEL=1: a model to serve
    for command, workdir, env in image.runs:
        _run(["bash", "-c", command], _under(root, workdir), {**_environment(image, env, root, venv), **args}, log)
    environment = _environment(image, image.env, root, venv)
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", PYTRITON], root, environment, log)
    frozen = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True,
                            env=environment, check=True).stdout.lower().splitlines()  # fmt: skip
    pins = [
        line.split("#")[0].strip().lower() for line in (REPO / "docker" / "requirements.txt").read_text().splitlines()
    ]
    for pin in filter(None, pins):
        name, version = pin.split("==")
        assert any(f.startswith(f"{name.split('[')[0]}==") and f.split("==")[1].split("+")[0] == version
                   for f in frozen), f"{pin} is not what the virtualenv got"  # fmt: skip
    _serve(image, root, venv, environment, tmp_path)


def _serve(image: Dockerfile, root: Path, venv: Path, env: dict[str, str], tmp_path: Path) -> None:
    """docker run <image> --model default --device cpu ... (CMD replaced, ENTRYPOINT kept)."""
    http, grpc, metrics = _free_ports(3)
    command = [str(venv / "bin" / image.entrypoint[0]), *image.entrypoint[1:], "--model", "default", "--device",
               "cpu", "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
               "--metrics-port", str(metrics), "--lora-info-metric"]  # fmt: skip
    log = tmp_path / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=_under(root, image.workdir), env=env, stdout=out,
                                   stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_ready(f"127.0.0.1:{http}", process, log)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2", timeout=10) as response:
            version = json.load(response)["version"]
        tag = image.base.rsplit(":", 1)[1]
        assert documented_releases()[tag] == version, f"the base image {tag} is documented with another release"
        got = run_one(f"127.0.0.1:{grpc}", "slora", token_inputs([1, 504, 3, 28], 4, sampling={"temperature": 0}))
        assert got.error is None and got.finish_reason == "length" and len(got.token_ids) == 4, got
        hook = _under(root, image.workdir) / "docker" / "wait_idle.py"
        metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        subprocess.run([str(venv / "bin" / "python"), str(hook), "--metrics-url", metrics_url, "--grace-s", "0",
                        "--timeout-s", "30"], check=True, timeout=60, env=env)  # fmt: skip
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(90)
    assert code == 0, log.read_text()[-4000:]
