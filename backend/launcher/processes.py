"""The launcher's processes: started in sessions of their own, polled over HTTP, and none left behind.

tritonserver and the OpenAI API each run in a session of their own: a terminal's Ctrl-C reaches slora-serve
only, which stops everything in order; and each gets SIGTERM when slora-serve dies (PR_SET_PDEATHSIG) instead of
lingering. tritonserver's session also holds its Python stubs and their engine processes: `reap_group` waits for
them to follow it and kills what is left.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger("slora.serve")


def child_setup() -> None:
    """preexec_fn of a child: a session of its own, and SIGTERM when its parent dies."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def answers_ok(url: str) -> bool:
    """Whether GET `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def reap_group(group: int, force: threading.Event, grace_s: float) -> None:
    """tritonserver runs in a session of its own, with its stubs and their engine processes: wait for those to
    exit (they follow the server within a second), kill those still there after grace_s."""
    deadline = time.monotonic() + grace_s
    left = live_members(group)
    while left and not force.is_set() and time.monotonic() < deadline:
        force.wait(0.1)
        left = live_members(group)
    if left:
        logger.warning("killing %d processes tritonserver left behind: %s", len(left), " ".join(map(str, left)))
        kill_group(group)
        deadline = time.monotonic() + grace_s  # SIGKILL takes effect asynchronously
        while live_members(group) and time.monotonic() < deadline:
            time.sleep(0.02)


def live_members(group: int) -> list[int]:
    """The processes of process group `group` that still run (a zombie has exited); none where /proc is absent."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, pgrp, ...
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            members.append(int(stat.parent.name))
    return members


def kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


SHM_PREFIX = "triton_python_backend_shm_region_"  # the Python backend's region of each stub, named on its command line


def stub_shm_regions(group: int) -> list[str]:
    """The shared-memory regions of the Python stubs in process group `group` (read while they run)."""
    regions = []
    for pid in live_members(group):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        regions += [arg.decode() for arg in args if arg.startswith(SHM_PREFIX.encode())]
    return regions


def remove_shm_regions(regions: list[str]) -> None:
    """Remove those of `regions` still in /dev/shm: a stub killed before it could clean up leaves its own."""
    shm = Path("/dev/shm")
    for name in regions:
        for path in shm.glob(f"{name}*"):  # the region, and any the backend made beside it under its name
            logger.info("removing the shared-memory region %s that a stopped stub left", path.name)
            path.unlink(missing_ok=True)
