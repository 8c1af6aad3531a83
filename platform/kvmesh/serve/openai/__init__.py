"""OpenAI-compatible HTTP API over the router's gRPC `kvmesh.v1.LLM` service.

`create_app(get_backend)` builds a FastAPI app with `/v1/models`, `/v1/completions`,
`/v1/chat/completions` (server-sent events when `stream`), `/health` and `/metrics`.
The same app is the Ray Serve ingress of the router deployment (serve/deployments.py)
and the HTTP front of `kvmesh serve --local`; both talk to the router over loopback
gRPC through a `GrpcBackend`, so the HTTP path gets exactly the routing, P/D and
retries of the gRPC path. The package splits by concern: `protocol` (request models,
the OpenAI error shape), `backend` (the gRPC client), `generation` (what the routes
share), `completions` and `chat` (the routes), `app` (assembly, uvicorn thread).
"""

from kvmesh.serve.openai.app import create_app, serve_http_in_thread
from kvmesh.serve.openai.backend import GrpcBackend
from kvmesh.serve.openai.protocol import APIError, ChatMessage, ChatRequest, CompletionRequest

__all__ = ["APIError", "ChatMessage", "ChatRequest", "CompletionRequest", "GrpcBackend", "create_app",
           "serve_http_in_thread"]
