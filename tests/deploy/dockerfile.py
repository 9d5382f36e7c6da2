"""docker/Dockerfile read as data: its base image, build arguments, environment, copies, RUN steps, entrypoint.

Only the instructions the Dockerfile uses are understood (FROM, ARG, ENV, WORKDIR, COPY, RUN, EXPOSE,
ENTRYPOINT, CMD, in their plain forms); anything else is an error, so the container check cannot skip a step.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Dockerfile:
    base: str = ""
    args: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    copies: list[tuple[list[str], str, str]] = field(default_factory=list)  # (sources, destination, workdir)
    runs: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (command, workdir, env then)
    exposed: list[int] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, rest = (pending + stripped).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def parse(path: Path) -> Dockerfile:
    image = Dockerfile()
    for keyword, rest in _instructions(path.read_text()):
        if keyword == "FROM":
            image.base = rest
        elif keyword == "ARG":
            name, _, default = rest.partition("=")
            image.args[name] = default.strip('"')
        elif keyword == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                image.env[key] = value
        elif keyword == "WORKDIR":
            image.workdir = rest
        elif keyword == "COPY":
            *sources, destination = shlex.split(rest)
            if any(s.startswith("--") for s in sources):
                raise ValueError(f"COPY options are not understood here: {rest}")
            image.copies.append((sources, destination, image.workdir))
        elif keyword == "RUN":
            image.runs.append((rest, image.workdir, dict(image.env)))
        elif keyword == "EXPOSE":
            image.exposed += [int(port) for port in rest.split()]
        elif keyword in ("ENTRYPOINT", "CMD"):
            setattr(image, keyword.lower(), json.loads(rest))
        else:
            raise ValueError(f"instruction {keyword} is not understood by the container check")
    return image
