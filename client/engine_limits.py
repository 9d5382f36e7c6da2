"""The engine's batch limits as it resolved them at start (`slora_engine_limit` on the metrics port).

A model's parameters say "auto" for max_num_seqs and max_batch_tokens unless they were given; on CUDA the engine
sizes them from its page pool at start. A client that models the server's steps (the served benchmarks' roofline,
perf/roofline.py) reads them here instead of assuming the CPU defaults.

    read_limits("localhost:8002")  # {"max_num_seqs": 512, "max_batch_tokens": 2048}
"""

from __future__ import annotations

import re

from slora.client.admin import metrics

_LIMIT = re.compile(r'^slora_engine_limit\{limit="(\w+)"\}\s+(\S+)$')


def parse_limits(text: str) -> dict[str, int]:
    """slora_engine_limit's series of a Prometheus text page: limit name → value (empty on a server without it)."""
    return {m[1]: int(float(m[2])) for line in text.splitlines() if (m := _LIMIT.match(line))}


def read_limits(metrics_url: str) -> dict[str, int]:
    """The limits of the server at `metrics_url` (host:port). Raises OSError (urllib's URLError is one) when the page
    cannot be read."""
    return parse_limits("\n".join(metrics(metrics_url)))
