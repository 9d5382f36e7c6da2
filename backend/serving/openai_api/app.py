"""The ASGI app: OpenAI's routes over the local Triton's `slora` model.

    GET  /health                 200 when Triton's slora model is ready, else 503
    GET  /v1/models              the base model and every adapter (models.py)
    GET  /v1/models/{model}      one of them, or 404
    POST /v1/completions         completions.py
    POST /v1/chat/completions    completions.py

Errors are OpenAI's error bodies (errors.py) with their status, also for unknown routes and methods.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from slora.backend.serving.openai_api.chat import ChatRenderer
from slora.backend.serving.openai_api.completions import Service, create_chat_completion, create_completion
from slora.backend.serving.openai_api.config import OpenAIConfig
from slora.backend.serving.openai_api.disconnect import ClientDisconnected
from slora.backend.serving.openai_api.errors import OpenAIError, model_not_found
from slora.backend.serving.openai_api.models import ModelNames, ModelRegistry
from slora.backend.serving.openai_api.triton_client import SloraClient

logger = logging.getLogger(__name__)


def build_app(
    config: OpenAIConfig, base_name: str, chat: ChatRenderer, client_factory: Callable[..., Any] = SloraClient
) -> FastAPI:
    """The app; its gRPC client to Triton (`client_factory(url, model, admin_token)`, a SloraClient) is made when
    the app starts: it belongs to the server's event loop."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = client_factory(config.triton_url, config.triton_model, config.admin_token)
        names = ModelNames(base_name, config.lora_separator)
        registry = ModelRegistry(names, client.adapters, config.owned_by, config.models_ttl_s, config.retry_after_s)
        app.state.service = Service(config, client, names, registry, chat)
        logger.info("OpenAI API for %s (base model %r) on Triton %s", config.triton_model, base_name,
                    config.triton_url)  # fmt: skip
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="slora-triton OpenAI API", lifespan=lifespan)
    _routes(app)
    _error_handlers(app)
    return app


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def _routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        ready = await _service(request).client.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        cards = await _service(request).registry.cards()
        return JSONResponse({"object": "list", "data": [card.body() for card in cards]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> Response:
        card = await _service(request).registry.card(model)
        if card is None:
            raise model_not_found(model)
        return JSONResponse(card.body())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(_service(request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(_service(request), request)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        if exc.status >= 500:
            logger.warning("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        logger.info("%s %s: the client went away; its request was aborted", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it: nginx's code for a request the client closed

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = OpenAIError(exc.status_code, str(exc.detail), type=_kind(exc.status_code))
        return JSONResponse(error.body(), status_code=exc.status_code, headers=_headers(exc))


def _kind(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


def _headers(exc: HTTPException) -> dict[str, Any] | None:
    return dict(exc.headers) if exc.headers else None
