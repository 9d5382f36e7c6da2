"""preStop hook: wait until the server has no request running or waiting, so that SIGTERM ends nothing.

On SIGTERM slora-serve drains: the `slora` model refuses new requests and ends every request still in flight with
finish_reason "abort" (backend/serving/drain.py). A rolling update or a scale-in must therefore let the requests in
flight finish *before* SIGTERM. Kubernetes runs this hook first, and the pod is already terminating: the endpoint
picker and the Service stop choosing it within a few seconds (`--grace-s`), then the hook polls the metrics port
until `slora_requests{state="running"}` and `{state="waiting"}` have both read 0 for `--quiet-s`, or `--timeout-s`
has passed. It always exits 0: a hook that fails only adds an event, and SIGTERM follows either way.

    python3 /opt/slora/docker/wait_idle.py --timeout-s 240      (the Deployment's lifecycle.preStop)

terminationGracePeriodSeconds must cover the timeout plus slora-serve's own stop (drain 10 s, Triton up to 60 s).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

logger = logging.getLogger("slora.wait_idle")

_REQUESTS = re.compile(r'^slora_requests\{state="(running|waiting)"\} (\S+)$', re.MULTILINE)


def in_flight(metrics_text: str) -> int | None:
    """Requests running plus waiting, from a metrics page; None when the page has neither gauge."""
    values = {state: float(value) for state, value in _REQUESTS.findall(metrics_text)}
    if not values:
        return None
    return int(sum(values.values()))


def read_in_flight(url: str, timeout_s: float = 2.0) -> int | None:
    """`in_flight` of the page at `url`; None when it cannot be read (the server is not up, or already gone)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return in_flight(response.read().decode())
    except (urllib.error.URLError, OSError):
        return None


def wait_idle(url: str, grace_s: float, quiet_s: float, timeout_s: float, poll_s: float) -> bool:
    """Wait `grace_s`, then until `url` reports nothing in flight for `quiet_s`; False if `timeout_s` ran out."""
    start = time.monotonic()
    time.sleep(grace_s)
    idle_since: float | None = None
    while (now := time.monotonic()) - start < timeout_s:
        count = read_in_flight(url)
        if count is None:
            logger.info("no slora_requests gauges at %s: nothing to wait for", url)
            return True
        if count > 0:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= quiet_s:
            logger.info("idle after %.1f s", now - start)
            return True
        time.sleep(poll_s)
    logger.warning("requests still in flight after %.0f s: SIGTERM will end them", timeout_s)
    return False


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s wait_idle %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    parser.add_argument("--grace-s", type=float, default=5.0, help="time for the router to stop choosing this pod")
    parser.add_argument("--quiet-s", type=float, default=1.0, help="how long nothing must be in flight")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="the longest wait, grace included")
    parser.add_argument("--poll-s", type=float, default=0.5)
    args = parser.parse_args(argv)
    for name in ("grace_s", "quiet_s", "timeout_s", "poll_s"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    wait_idle(args.metrics_url, args.grace_s, args.quiet_s, args.timeout_s, args.poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
