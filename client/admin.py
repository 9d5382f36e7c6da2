"""Operator requests: adapter list / load / unload and tenant weights (admin requests to `slora`), health, metrics.

On a server started with --admin-token-file, admin requests carry its token: the `admin_token` argument, or the
environment variable SLORA_ADMIN_TOKEN.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from slora.client.generate import ServerError

MODELS = ("slora", "ensemble")
TOKEN_ENV = "SLORA_ADMIN_TOKEN"


@dataclass(frozen=True)
class Health:
    live: bool
    ready: bool
    models: dict[str, bool]


def adapter_command(
    http_url: str,
    op: str,
    name: str | None = None,
    path: str | None = None,
    admin_token: str | None = None,
    replace: bool = False,
) -> list[dict[str, Any]]:
    """Run an adapter command through HTTP generate on `slora`; returns the adapters it reports."""
    body: dict[str, Any] = {"adapter_command": op}
    if name:
        body["adapter_id"] = name
    if path:
        body["adapter_path"] = path
    parameters: dict[str, Any] = {"replace": True} if replace else {}
    adapters = admin_request(http_url, body, parameters, admin_token).get("adapters", [])
    return list(adapters)


def set_tenant_weights(
    http_url: str, weights: dict[str, float], replace: bool = False, admin_token: str | None = None
) -> dict[str, float]:
    """Merge (or with `replace`, set) the tenants' weights of the `fair` policy; returns every weight now set."""
    parameters = {"tenant_weights": json.dumps(weights), "replace": replace}
    result = admin_request(http_url, {"adapter_command": "tenant_weights"}, parameters, admin_token)
    return dict(result.get("tenant_weights", {}))


def admin_request(
    http_url: str, body: dict[str, Any], parameters: dict[str, Any], admin_token: str | None = None
) -> dict[str, Any]:
    """POST an admin request (its inputs in `body`, request parameters beside them) and return its JSON answer."""
    token = admin_token or os.environ.get(TOKEN_ENV)
    if token:
        parameters = {**parameters, "admin_token": token}
    if parameters:
        body = {**body, "parameters": parameters}
    payload = _post_json(f"http://{http_url}/v2/models/slora/generate", body)
    result = payload.get("adapter_result")
    result = result[0] if isinstance(result, list) else result
    if not isinstance(result, str):
        raise ServerError(f"the server sent no adapter_result: {payload}")
    answer = json.loads(result)
    if not isinstance(answer, dict):
        raise ServerError(f"unexpected adapter_result: {answer!r}")
    return answer


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
