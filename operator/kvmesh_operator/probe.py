"""The operator's only call to a served LLMService: `GET /v1/models` on its router.

The status timer asks the router which LoRA adapters it serves (status.with_adapters reads
the answer). The router is reached through the `<name>-http` Service by default;
`KVMESH_ROUTER_URL` overrides the base URL (a template with `{name}` and `{namespace}`),
e.g. for an operator run outside the cluster through a port-forward, or tests.

    body = await list_models(base_url(t), api_key)   # ProbeError says what failed
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

from kvmesh_operator.render import Target, endpoints

URL_ENV = "KVMESH_ROUTER_URL"
TIMEOUT_S = 5.0


class ProbeError(Exception):
    """The router could not be asked (unreachable, refused, an error status, not JSON)."""


def base_url(t: Target) -> str:
    """The router's HTTP base URL for the operator (the in-cluster Service unless KVMESH_ROUTER_URL is set)."""
    template = os.environ.get(URL_ENV)
    if template:
        return template.format(name=t.name, namespace=t.namespace).rstrip("/")
    return endpoints(t)["http"]


async def list_models(base: str, api_key: str | None = None, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The body of GET <base>/v1/models (an OpenAI model list)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base}/v1/models"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(url, headers=headers) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    raise ProbeError(f"GET {url}: HTTP {resp.status} {text}".strip())
                body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise ProbeError(f"GET {url}: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ProbeError(f"GET {url}: expected an OpenAI model list, got {type(body).__name__}")
    return body
