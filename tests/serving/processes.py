"""The processes on this host, for tests that check which of a server's processes run."""

from __future__ import annotations

from pathlib import Path


def live_processes() -> dict[int, tuple[int, str]]:
    """pid → (process group, command line) of every process on this host that is not a zombie."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[2]), command)
    return found
