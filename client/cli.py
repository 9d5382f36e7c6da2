"""`slora-client`: talk to a running slora-serve.

slora-client generate "Tell me a joke" --adapter demo-qv-r4 --max-tokens 64 --temperature 0
slora-client generate "Hi" --protocol http            # HTTP generate_stream instead of gRPC streaming
slora-client adapters list | adapters load NAME [--path DIR] [--replace] | adapters unload NAME
slora-client tenants set TENANT=WEIGHT ... [--replace]   # the `fair` policy's weights
slora-client health
slora-client metrics [--all]
slora-client steps [--window 10]                         # the engine's steps by kind over the next 10 s
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from slora.client.admin import adapter_command, health, metrics, set_tenant_weights
from slora.client.generate import Chunk, GenerateRequest, ServerError, grpc_generate, http_generate
from slora.client.steps import format_summary, read_steps, step_summary

logger = logging.getLogger("slora.client")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slora-client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="localhost:8001", help="gRPC endpoint (host:port)")
    parser.add_argument("--http-url", default="localhost:8000", help="HTTP endpoint (host:port)")
    parser.add_argument("--metrics-url", default="localhost:8002", help="metrics endpoint (host:port)")
    parser.add_argument("--admin-token-file", help="file holding the server's admin token (else $SLORA_ADMIN_TOKEN)")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text, printing it as it arrives")
    generate.add_argument("prompt")
    generate.add_argument("--model", default="slora", help="the model (default: slora; ensemble is its alias)")
    generate.add_argument("--adapter", help="adapter name (default: the base model)")
    generate.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    generate.add_argument("--no-stream", action="store_true", help="one response at the end")
    generate.add_argument("--chat-template", action="store_true", help="wrap the prompt in the chat template")
    generate.add_argument("--max-tokens", type=int)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")

    adapters = commands.add_parser("adapters", help="list, load or unload adapters")
    action = adapters.add_subparsers(dest="action", required=True)
    action.add_parser("list", help="every known adapter with its tier (gpu/host/disk) and rank")
    load = action.add_parser("load", help="register NAME (with --path) or read it from the adapter root")
    load.add_argument("name")
    load.add_argument("--path", help="adapter folder on the server's disk")
    load.add_argument("--replace", action="store_true", help="re-point NAME if it exists (refused otherwise)")
    unload = action.add_parser("unload", help="unregister NAME")
    unload.add_argument("name")

    tenants = commands.add_parser("tenants", help="tenants' weights under scheduling_policy=fair")
    tenants_action = tenants.add_subparsers(dest="action", required=True)
    weights = tenants_action.add_parser("set", help="merge TENANT=WEIGHT pairs into the weights")
    weights.add_argument("weights", nargs="+", metavar="TENANT=WEIGHT")
    weights.add_argument("--replace", action="store_true", help="replace every weight instead of merging")

    commands.add_parser("health", help="server liveness/readiness and each model's readiness")
    metrics_parser = commands.add_parser("metrics", help="the slora_ metrics of the server")
    metrics_parser.add_argument("--all", action="store_true", help="every metric, not just slora_")
    steps_parser = commands.add_parser("steps", help="the engine's steps by kind over a window: count, mean ms, "
                                       "batch, prompt tokens")  # fmt: skip
    steps_parser.add_argument("--window", type=float, default=10.0, help="seconds to watch (default 10)")
    return parser


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
    values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.ignore_eos:
        values["ignore_eos"] = True
    return values


def run_generate(args: argparse.Namespace) -> int:
    request = GenerateRequest(
        prompt=args.prompt,
        model=args.model,
        adapter=args.adapter,
        sampling=sampling_from_args(args),
        stream=not args.no_stream,
        parameters={"apply_chat_template": True} if args.chat_template else {},
    )
    chunks: Iterator[Chunk] = (
        grpc_generate(args.url, request) if args.protocol == "grpc" else http_generate(args.http_url, request)
    )
    reason = ""
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        reason = chunk.finish_reason or reason
    sys.stdout.write("\n")
    logger.info("finish reason: %s", reason or "?")
    return 0


def admin_token(args: argparse.Namespace) -> str | None:
    if not args.admin_token_file:
        return None
    with open(args.admin_token_file) as handle:
        return handle.read().strip()


def run_adapters(args: argparse.Namespace) -> int:
    rows = adapter_command(args.http_url, args.action, getattr(args, "name", None), getattr(args, "path", None),
                           admin_token(args), getattr(args, "replace", False))  # fmt: skip
    width = max((len(r["name"]) for r in rows), default=4)
    sys.stdout.write(f"{'name':<{width}}  state  rank  path\n")
    for row in rows:
        rank = "-" if row.get("rank") is None else str(row["rank"])
        sys.stdout.write(f"{row['name']:<{width}}  {row['state']:<5}  {rank:>4}  {row['path']}\n")
    return 0


def run_tenants(args: argparse.Namespace) -> int:
    weights: dict[str, float] = {}
    for pair in args.weights:
        tenant, sep, value = pair.rpartition("=")
        if not sep or not tenant:
            raise ServerError(f"expected TENANT=WEIGHT, got {pair!r}")
        try:
            weights[tenant] = float(value)
        except ValueError:
            raise ServerError(f"the weight of {tenant!r} must be a number, got {value!r}") from None
    now = set_tenant_weights(args.http_url, weights, args.replace, admin_token(args))
    for tenant, weight in sorted(now.items()):
        sys.stdout.write(f"{tenant}  {weight:g}\n")
    return 0


def run_health(args: argparse.Namespace) -> int:
    status = health(args.http_url)
    sys.stdout.write(f"live: {status.live}\nready: {status.ready}\n")
    for model, ready in status.models.items():
        sys.stdout.write(f"model {model}: {'ready' if ready else 'NOT ready'}\n")
    return 0 if status.ready else 1


def run_metrics(args: argparse.Namespace) -> int:
    sys.stdout.write("\n".join(metrics(args.metrics_url, args.all)) + "\n")
    return 0


def run_steps(args: argparse.Namespace) -> int:
    if not args.window > 0:
        raise ServerError(f"--window must be > 0 seconds, got {args.window}")
    before = read_steps(args.metrics_url)  # OSError: main says the server cannot be reached
    if not before:
        raise ServerError(f"{args.metrics_url} has no slora_steps_total: a server from before the step counters?")
    time.sleep(args.window)
    sys.stdout.write(format_summary(step_summary(before, read_steps(args.metrics_url)), args.window))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    handlers = {"generate": run_generate, "adapters": run_adapters, "tenants": run_tenants, "health": run_health,
                "metrics": run_metrics, "steps": run_steps}  # fmt: skip
    try:
        return handlers[args.command](args)
    except ServerError as exc:
        logger.error("error: %s", exc)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130
    except OSError as exc:
        logger.error("cannot reach the server: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
