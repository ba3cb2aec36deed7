"""The OpenAI-compatible HTTP API (FastAPI + uvicorn) over the same `LLM` and engine as the gRPC service.

    protocol.py      pydantic models of OpenAI's request and response bodies (and vLLM's extra fields)
    errors.py        OpenAI's error object, the HTTP statuses, one-line messages shared with gRPC
    serving.py       the chat and completion handlers: request -> SamplingParams + Request(s) -> body or SSE
    tool_parsers.py  model output -> tool calls (hermes, llama3_json, mistral), whole and streamed
    reasoning.py     <think>...</think> -> reasoning_content, whole and streamed
    app.py           the FastAPI app: routes, auth, CORS, /health, /metrics, /tokenize, /detokenize

Started by `jaxinfer.server.JaxinferServer` when `ServerConfig.http_port` is set, on the same event
loop as the gRPC server, sharing its admission count, draining and shutdown.
"""
