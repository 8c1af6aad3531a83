"""The OpenAI-compatible FastAPI app: `create_app(get_backend, metrics)` assembles the
routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/tokenize`,
`/detokenize`, `/health`, `/metrics`, and vLLM's `/v1/load_lora_adapter` / `/v1/unload_lora_adapter`),
the OpenAI-shaped error handlers (bad bodies become a 400 naming the field), when
`KVMESH_API_KEY` is set, the bearer-key check on `/v1/*`, and, when tracing is on, the
GenAI span of each generation request (request_span.py, continuing a `traceparent`). Every error is OpenAI-shaped,
FastAPI's own 404 / 405 / body errors and unexpected exceptions included; request
limits (body size, prompt size, batch size) are `limits.HTTPLimits`. The routes are module-level
functions that find the backend through `app.state`, so one app object can be built
before its backend exists (the Ray replica's case). `start_http` runs an app with uvicorn
on the running event loop (the router's: `kvmesh serve`, Ray or local, and `kvmesh
router`); `serve_http_in_thread` on a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.chat import ChatConfig
from kvmesh.errors import KVMeshError
from kvmesh.rpc.auth import ApiKeys
from kvmesh.serve.openai import chat, completions, lora, responses, tokenize
from kvmesh.serve.openai.backend import CLIENT_AUTHORIZATION, Backend
from kvmesh.serve.openai.generation import BackendSource
from kvmesh.serve.openai.limits import BodySizeLimit, HTTPLimits, body_too_large_cause, too_large
from kvmesh.serve.openai.protocol import APIError
from kvmesh.serve.openai.request_span import TraceContext

MetricsRenderer = Callable[[], tuple[bytes, str]]
logger = logging.getLogger(__name__)


def create_app(get_backend: Callable[[], Backend | None], metrics: MetricsRenderer | None = None,
               title: str = "kvmesh", limits: HTTPLimits | None = None, chat_config: ChatConfig | None = None) -> FastAPI:
    """The OpenAI-compatible app. `get_backend` is called per request (the Ray replica
    sets its backend after the app object is built); `metrics` renders /metrics;
    `chat_config` the tool-call / reasoning parsers (`app.state.kvmesh_chat`)."""
    app = FastAPI(title=f"{title} OpenAI-compatible API")
    app.state.kvmesh_chat = chat_config or ChatConfig()
    app.state.kvmesh_backends = BackendSource(get_backend)
    app.state.kvmesh_metrics = metrics
    app.state.kvmesh_limits = limits = limits or HTTPLimits()
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    keys = ApiKeys.from_env()
    if keys.enabled:
        app.middleware("http")(functools.partial(_check_api_key, keys))
    app.add_middleware(TraceContext)  # outermost: the request span covers the whole response
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat.chat_completions, methods=["POST"])
    app.add_api_route("/v1/responses", responses.responses, methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", lora.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", lora.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/tokenize", tokenize.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenize.detokenize, methods=["POST"])
    return app


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    msg = f"{loc}: {detail}" if loc else detail
    return JSONResponse(APIError(400, msg, param=loc or None).body(), status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's and Starlette's own errors (unknown route, wrong method, unreadable body)."""
    if body_too_large_cause(exc):
        err = too_large(request.app.state.kvmesh_limits.max_body_bytes)
    elif exc.status_code == 404:
        err = APIError(404, f"no route {request.url.path}; see /docs for the API", "not_found_error")
    elif exc.status_code == 405:
        err = APIError(405, f"method {request.method} is not allowed on {request.url.path}", "invalid_request_error")
    else:
        err = APIError(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500
                       else "internal_error")
    return JSONResponse(err.body(), status_code=err.status, headers=getattr(exc, "headers", None))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error in an HTTP handler", exc_info=exc)
    err = APIError(500, f"internal error: {exc!r}", "internal_error", code="internal_error")
    return JSONResponse(err.body(), status_code=500)


# Routes behind the API key: the OpenAI API (LoRA load / unload included) and the tokenizer routes
# (health, metrics, docs stay open).
_KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


async def _check_api_key(keys: ApiKeys, request: Request,
                         call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    if not request.url.path.startswith(_KEYED_PREFIXES):
        return await call_next(request)
    header = request.headers.get("authorization")
    if keys.tenant_of(header) is None:
        err = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")
        return JSONResponse(err.body(), status_code=401)
    CLIENT_AUTHORIZATION.set(header)  # forwarded to the router: the tenant's salt and rate limit
    return await call_next(request)


async def health(request: Request):
    b = BackendSource.of(request).get()
    if b is None or not await b.healthy():
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return {"status": "ok"}


async def metrics_endpoint(request: Request):
    metrics: MetricsRenderer | None = request.app.state.kvmesh_metrics
    if metrics is None:
        raise APIError(404, "metrics are not enabled", "not_found_error")
    body, content_type = metrics()
    return Response(body, media_type=content_type)


async def models(request: Request):
    b = BackendSource.of(request).require()
    try:
        resp = await b.list_models()
    except KVMeshError as e:
        raise APIError.of(e) from None
    now = int(time.time())
    # vLLM's shape: a LoRA adapter's `parent` is the base model, its `root` the adapter's path.
    # kvmesh adds `workers` to an adapter's entry: how many workers hold it (the operator's
    # status.adapters reads it).
    return {"object": "list", "data": [
        {"id": m.id, "object": "model", "created": now, "owned_by": "kvmesh", "root": m.root or m.id,
         "parent": m.parent or None, "max_model_len": m.max_model_len,
         **({"workers": m.num_workers} if m.parent else {})}
        for m in resp.models]}


class HTTPServer(uvicorn.Server):
    """uvicorn on the event loop it is started from (`start_http`), leaving the process's
    signal handling to its owner; `stop()` ends it: it stops accepting, lets requests in
    flight finish for up to `drain_s`, then cancels the rest (which closes their router
    streams, so the workers free their blocks)."""

    task: asyncio.Task | None = None
    port: int = 0  # the bound port (the one asked for, or the kernel's pick for 0)

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def stop(self) -> None:
        self.should_exit = True
        if self.task is not None:
            await self.task


def _server(server_cls: type[uvicorn.Server], app: FastAPI, host: str, port: int, ssl_certfile: str | None,
            ssl_keyfile: str | None, ssl_ca_certs: str | None, **options):
    tls = {}
    if ssl_certfile:
        tls = {"ssl_certfile": ssl_certfile, "ssl_keyfile": ssl_keyfile}
        if ssl_ca_certs:
            tls.update(ssl_ca_certs=ssl_ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return server_cls(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off", **tls,
                                     **options))


async def start_http(app: FastAPI, host: str, port: int, ssl_certfile: str | None = None,
                     ssl_keyfile: str | None = None, ssl_ca_certs: str | None = None,
                     reuse_port: bool = False, drain_s: float = 10.0) -> HTTPServer:
    """Serve `app` with uvicorn on the running event loop, the router's: the HTTP routes
    then reach the router's servicer in-process (serve/openai/backend.py InProcessBackend),
    with no thread hop, GIL hand-off or loopback socket per streamed message. Returns once
    it listens. TLS and `reuse_port` as in `serve_http_in_thread`; `drain_s` bounds `stop()`."""
    server = _server(HTTPServer, app, host, port, ssl_certfile, ssl_keyfile, ssl_ca_certs,
                     timeout_graceful_shutdown=drain_s)
    # Bound here, not by uvicorn, whose bind failure is a sys.exit that would end the loop.
    sock = _listen_socket(host, port, reuse_port)
    server.port = sock.getsockname()[1]
    server.task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="kvmesh-http")
    while not server.started:
        if server.task.done():
            exc = server.task.exception() if not server.task.cancelled() else None
            raise OSError(f"the HTTP server did not start on {host}:{port}; is the port free? ({exc!r})")
        await asyncio.sleep(0.02)
    return server


def serve_http_in_thread(app: FastAPI, host: str, port: int, ssl_certfile: str | None = None,
                         ssl_keyfile: str | None = None, ssl_ca_certs: str | None = None,
                         reuse_port: bool = False) -> uvicorn.Server:
    """Run `app` with uvicorn on its own thread and loop (leaves the caller's signal
    handling alone), for a backend that does not need the router's loop (GrpcBackend).
    Returns the uvicorn Server; set `server.should_exit = True` to stop.
    With `ssl_certfile` / `ssl_keyfile` it serves HTTPS (and, with `ssl_ca_certs`,
    requires client certificates signed by that CA). `reuse_port` binds with
    SO_REUSEPORT, so several processes of one host (router replicas, an old replica
    still draining next to its successor) share the port and the kernel spreads the
    connections over them."""
    server = _server(uvicorn.Server, app, host, port, ssl_certfile, ssl_keyfile, ssl_ca_certs)
    sockets = [_listen_socket(host, port, reuse_port=True)] if reuse_port else None
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True, name="kvmesh-http")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise OSError(f"the HTTP server did not start on {host}:{port}; is the port free?")
        time.sleep(0.05)
    return server


def _listen_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP port {host}:{port}: {exc}") from exc
    sock.listen(2048)
    return sock
