"""The endpoint picker: the router's placement, for a gateway that forwards the request itself.

Given an OpenAI request body (`/v1/completions`: `prompt`; `/v1/chat/completions`:
`messages`), `EndpointPicker.pick` does what `RouterAPI` does before it calls a worker —
resolve `model` (the base model or a served LoRA adapter), tokenize, hash the prompt's
blocks with the workers' chained hashes, run the configured filters / scorers / picker
(prefix affinity, queue, free KV, LoRA affinity) — and returns the chosen worker's
*endpoint*: the host of its gRPC address with the pool's `target_port`, where that pod
serves the OpenAI HTTP API. kvmesh workers speak only kvmesh's gRPC; a pod joins an
InferencePool by running a worker and, next to it, a router over that one worker with
`--http-port` (docs/guides/observability.md, "InferencePool"). The picker does not
proxy: the gateway sends the untouched body to the endpoint (router/ext_proc.py).

Bad input is a `PickError` carrying the HTTP status the gateway answers with at once:
400 (no body, not JSON, no prompt), 404 (unknown model), 503 (no eligible worker).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.chat import takes_tools, template_messages, template_source
from kvmesh.engine.hashing import block_hashes
from kvmesh.errors import InvalidRequestError, NotFoundError
from kvmesh.router.config import RouterConfig
from kvmesh.router.lora import LoRAAdapters
from kvmesh.router.plugins import RouteRequest, WorkerScheduler
from kvmesh.router.registry import WorkerHandle, WorkerPool
from kvmesh.rpc.auth import ApiKeys, tenant_salt
from kvmesh.telemetry.router import ScoreRecorder


class PickError(Exception):
    """A request the picker answers itself: `status` is the HTTP status, `message` says what to change."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        """An OpenAI-style error body."""
        kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "service_unavailable" if self.status == 503 else "internal_error")
        return json.dumps({"error": {"message": self.message, "type": kind, "param": self.param,
                                     "code": self.status}}).encode()


@dataclass
class Pick:
    endpoint: str  # "host:port" the gateway forwards to
    worker: WorkerHandle
    prefix_blocks: int  # leading prompt blocks the worker likely holds
    prompt_tokens: int


def endpoint_of(address: str, target_port: int | None) -> str:
    """`host:target_port` of a worker's gRPC address `host:port` (IPv6 hosts keep their brackets)."""
    host, _, port = address.rpartition(":")
    return f"{host}:{target_port if target_port else port}"


class EndpointPicker:
    """Placement over `pool`'s workers with `config`'s plugins (see the module docstring).

    `target_port`: the port of the OpenAI server on each worker's pod (the InferencePool's
    targetPorts); None returns the worker's own address."""

    def __init__(self, pool: WorkerPool, config: RouterConfig, tokenizer, model_id: str,
                 target_port: int | None = None, adapters: Iterable[tuple[str, str]] = (),
                 keys: ApiKeys | None = None):
        self.pool = pool
        self.config = config
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.target_port = target_port
        self.keys = keys or ApiKeys()
        self.scheduler = WorkerScheduler.from_config(config)
        self.scores = ScoreRecorder(self.scheduler, [s.name for s in config.scorers])
        self.loras = LoRAAdapters(pool, self.scheduler, model_id, adapters)

    def endpoint(self, worker: WorkerHandle) -> str:
        return endpoint_of(worker.address, self.target_port)

    async def pick(self, body: bytes, headers: Mapping[str, str] | None = None,
                   subset: list[str] | None = None) -> Pick:
        """The endpoint for one request; raises PickError. `subset`: the gateway's
        `x-gateway-destination-endpoint-subset` (pick only among those endpoints)."""
        req = _parse(body)
        try:
            lora = self.loras.resolve(req.get("model") or "")
        except NotFoundError as exc:
            raise PickError(404, str(exc), "model") from None
        except InvalidRequestError as exc:
            raise PickError(400, str(exc), "model") from None
        ids = await self._prompt_ids(req)
        if self.pool.fingerprint is None or self.pool.block_size is None:
            raise PickError(503, "no worker has answered the picker yet; retry shortly")
        tenant = self.keys.tenant_of((headers or {}).get("authorization")) if self.keys.enabled else None
        salt = tenant_salt(tenant, str(req.get("cache_salt") or ""))
        key = self.loras.key_of(lora.name) if lora is not None else ""
        hashes = block_hashes(ids, self.pool.block_size, self.pool.fingerprint, cache_salt=salt, lora_key=key)
        route = RouteRequest(uuid.uuid4().hex, ids, hashes, self.pool.block_size,
                             lora=lora.name if lora is not None else None)
        workers = self.pool.handles()
        if subset is not None:
            allowed = set(subset)
            workers = [w for w in workers if self.endpoint(w) in allowed]
        worker = self.scheduler.pick(route, workers)
        if worker is None:
            raise PickError(503, "no healthy worker can take this request" +
                            (" among the gateway's endpoint subset" if subset is not None else "") + "; retry later")
        self.scores.observe("decode", worker)
        prefix = worker.prefix_blocks(hashes)
        worker.remember(hashes)  # what it will hold once it served this prompt
        if lora is not None:
            worker.note_lora(lora.name)
        return Pick(self.endpoint(worker), worker, prefix, len(ids))

    async def _prompt_ids(self, req: dict[str, Any]) -> list[int]:
        """The prompt's token ids as the pod's router will compute them; [] when the
        picker cannot render it (the pod answers the error; placement goes by load)."""
        if "messages" in req:
            messages = req["messages"]
            if not isinstance(messages, list) or not messages:
                raise PickError(400, "messages: give a non-empty list of {role, content}", "messages")
            self._check_chars(sum(len(json.dumps(m)) for m in messages), "messages")
            return await asyncio.to_thread(self._chat_ids, messages, req)
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            special = req.get("add_special_tokens", True) is not False
            return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=special)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and prompt:
            return []  # a batch: its prompts go to one endpoint together, by load
        raise PickError(400, "give `prompt` (/v1/completions) or `messages` (/v1/chat/completions)", "prompt")

    def _check_chars(self, n: int, field: str) -> None:
        if n > self.config.max_prompt_chars:
            raise PickError(400, f"{field} has {n} characters, over the limit of {self.config.max_prompt_chars} "
                                 "(max_prompt_chars); shorten it", field)

    def _chat_ids(self, messages: list, req: dict[str, Any]) -> list[int]:
        source = template_source(self.tokenizer)
        if not source:
            raise PickError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            conv, extra = template_messages([_template_dict(m) for m in messages], None, takes_tools(source))
            kwargs = {"add_generation_prompt": req.get("add_generation_prompt", True) is not False, **extra}
            ids = self.tokenizer.apply_chat_template(conv, tokenize=True, **kwargs)
        except PickError:
            raise
        except Exception:  # noqa: BLE001  (tools, images, a template's refusal: the pod says what is wrong)
            return []
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)


def _parse(body: bytes) -> dict[str, Any]:
    if not body:
        raise PickError(400, "the request has no body; send the OpenAI JSON request (model, prompt or messages)")
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PickError(400, f"the request body is not JSON ({exc})") from None
    if not isinstance(req, dict):
        raise PickError(400, "the request body must be a JSON object")
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise PickError(400, "model must be a string", "model")
    return req


def _template_dict(m: Any) -> dict[str, Any]:
    """A chat message as the chat template takes it (text parts joined, as the HTTP layer does)."""
    if not isinstance(m, dict) or "role" not in m:
        raise PickError(400, "messages: each message needs a role and content", "messages")
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    role = m["role"] if m["role"] != "developer" else "system"
    out = {"role": role, "content": content if m.get("tool_calls") and content is None else content or ""}
    for k in ("tool_calls", "tool_call_id", "name"):
        if m.get(k) is not None:
            out[k] = m[k]
    return out
