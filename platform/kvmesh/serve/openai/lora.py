"""LoRA adapters at run time, as vLLM's server has them: `POST /v1/load_lora_adapter`
{lora_name, lora_path} and `POST /v1/unload_lora_adapter` {lora_name}. They sit under
/v1/, so with API keys configured they need one (the app's key middleware). A loaded
adapter is served by its name in the `model` field and listed by /v1/models with
`parent` (the base model) and `root` (its path). Errors are OpenAI-shaped: a missing or
bad field, or a path the workers cannot load, is a 400 naming it; unloading an unknown
adapter is a 404.
"""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from kvmesh.errors import KVMeshError
from kvmesh.serve.openai.generation import BackendSource
from kvmesh.serve.openai.protocol import APIError


class LoadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's load_inplace and the like

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what identifies an adapter here


# POST /v1/load_lora_adapter and /v1/unload_lora_adapter, registered by create_app (no docstrings:
# FastAPI would publish them).
async def load_lora_adapter(body: LoadLoRAAdapterBody, request: Request):
    b = BackendSource.of(request).require()
    try:
        resp = await b.load_lora_adapter(body.lora_name, body.lora_path)
    except KVMeshError as e:
        raise APIError.of(e) from None
    return {"object": "lora_adapter", "lora_name": resp.lora_name, "lora_path": body.lora_path, "rank": resp.rank,
            "workers": list(resp.workers),
            "message": f"Success: LoRA adapter '{resp.lora_name}' added successfully."}


async def unload_lora_adapter(body: UnloadLoRAAdapterBody, request: Request):
    b = BackendSource.of(request).require()
    try:
        await b.unload_lora_adapter(body.lora_name)
    except KVMeshError as e:
        raise APIError.of(e) from None
    return {"object": "lora_adapter", "lora_name": body.lora_name, "deleted": True,
            "message": f"Success: LoRA adapter '{body.lora_name}' removed successfully."}
