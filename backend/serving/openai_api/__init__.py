"""An OpenAI-compatible HTTP API beside Triton, where `model` names the adapter (docs/openai.md).

    client ── HTTP /v1/... ──► uvicorn (this package, a process of its own) ── gRPC stream ──► tritonserver ─► slora

One file per concern: config (options), protocol (request bodies, 400s naming the field), models (names and
/v1/models), chat (the chat template), sampling (OpenAI fields → one slora request), triton_client (the gRPC
streams), streaming (SSE chunks), responses (bodies), errors (OpenAI's error format and statuses), disconnect
(a client that leaves aborts its request), completions (the two endpoints), app (routes), server (entry point),
launch (how slora-serve starts and stops it; standard library only, so the launcher needs no web stack).
Every request still goes through the `slora` model, which tokenizes the prompt and decodes the text once.
"""
