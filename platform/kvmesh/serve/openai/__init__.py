"""OpenAI-compatible HTTP API over the router's gRPC `kvmesh.v1.LLM` service.

`create_app(get_backend)` builds a FastAPI app with `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (server-sent events when `stream`), `/health` and `/metrics`.
The same app is the HTTP front of the router replica (serve/deployments.py) and of
`kvmesh serve --local` / `kvmesh router`, served on the router's event loop and calling
its servicer in-process (`InProcessBackend`), and the Ray Serve ingress of the router
deployment behind Ray's proxy, which reaches the router over loopback gRPC
(`GrpcBackend`). Either way the HTTP path gets exactly the routing, P/D and retries of
the gRPC path. The package splits by concern: `protocol` (request models), `errors` (the
OpenAI error shape), `fields` (fields refused or ignored), `structured` (structured-output
fields), `legacy` (legacy function calling), `backend` (the router client), `generation`
(what the routes share), `completions`, `chat`, `responses`, `tokenize`, `lora` (the
routes), `request_span` (the GenAI span of a request), `app` (assembly, uvicorn).
"""

from kvmesh.serve.openai.app import HTTPServer, create_app, serve_http_in_thread, start_http
from kvmesh.serve.openai.backend import Backend, GrpcBackend, InProcessBackend
from kvmesh.serve.openai.protocol import APIError, ChatMessage, ChatRequest, CompletionRequest

__all__ = ["APIError", "Backend", "ChatMessage", "ChatRequest", "CompletionRequest", "GrpcBackend", "HTTPServer",
           "InProcessBackend", "create_app", "serve_http_in_thread", "start_http"]
