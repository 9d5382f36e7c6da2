"""Operator requests: adapter list / load / unload (control requests to `slora`), health, metrics."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from slora.client.generate import ServerError

MODELS = ("slora", "ensemble")


@dataclass(frozen=True)
class Health:
    live: bool
    ready: bool
    models: dict[str, bool]


def adapter_command(http_url: str, op: str, name: str | None = None, path: str | None = None) -> list[dict[str, Any]]:
    """Run an adapter command through HTTP generate on `slora`; returns the adapters it reports."""
    body: dict[str, Any] = {"adapter_command": op}
    if name:
        body["adapter_id"] = name
    if path:
        body["adapter_path"] = path
    payload = _post_json(f"http://{http_url}/v2/models/slora/generate", body)
    result = payload.get("adapter_result")
    result = result[0] if isinstance(result, list) else result
    if not isinstance(result, str):
        raise ServerError(f"the server sent no adapter_result: {payload}")
    adapters = json.loads(result).get("adapters", [])
    return list(adapters)


def health(http_url: str) -> Health:
    def ok(path: str) -> bool:
        try:
            with urllib.request.urlopen(f"http://{http_url}{path}", timeout=5.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    models = {model: ok(f"/v2/models/{model}/ready") for model in MODELS}
    return Health(live=ok("/v2/health/live"), ready=ok("/v2/health/ready"), models=models)


def metrics(metrics_url: str, everything: bool = False) -> list[str]:
    """The Prometheus text of the metrics port: the slora_ (and vllm:) families, or all of it."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10.0) as response:
        lines = response.read().decode().splitlines()
    if everything:
        return lines
    prefixes = ("slora_", "vllm:", "# HELP slora_", "# TYPE slora_", "# HELP vllm:", "# TYPE vllm:")
    return [line for line in lines if line.startswith(prefixes)]


def _post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120.0) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            message = f"HTTP {exc.code}: {exc.reason}"
        raise ServerError(str(message)) from None
    except urllib.error.URLError as exc:
        raise ServerError(f"cannot reach {url}: {exc.reason}") from None
    if not isinstance(payload, dict):
        raise ServerError(f"unexpected answer from {url}: {payload!r}")
    return payload
