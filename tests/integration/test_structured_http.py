"""Structured outputs on the embedded model through the OpenAI HTTP API, with the official
client: `chat.completions.parse(response_format=<pydantic model>)` returns a parsed object for
nested objects, arrays, enums, bounded numbers and optional fields; every output validates with
jsonschema; streaming and completions carry constraints too; a bad schema is a 400 naming it."""

from __future__ import annotations

import json
import os
import re
from enum import Enum

import jsonschema
import pytest
from kvmesh_procs import spawn_router, spawn_worker, stop, wait_idle, wait_ready
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favourite: Color


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Team(BaseModel):
    team: str = Field(max_length=20)
    members: list[Person] = Field(min_length=1, max_length=2)
    office: Address
    budget: float = Field(ge=0, le=1000)
    motto: str | None = Field(default=None, max_length=30)


class Weather(BaseModel):
    city: str = Field(max_length=20)
    celsius: float = Field(ge=-50, le=50)
    conditions: list[str] = Field(max_length=3)
    windy: bool | None = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvmesh.checkpoint.embedded import ensure_embedded_model
    from kvmesh.rpc import free_port

    model = ensure_embedded_model(progress=False)
    logs = tmp_path_factory.mktemp("so-http-logs")
    worker = spawn_worker("embedded", model, "unified", logs, num_blocks=512, block_size=16, max_model_len=2048)
    procs = [worker]
    try:
        wait_ready(worker)
        port = free_port()
        router = spawn_router("router", model, [worker.address], logs, extra=["--http-port", str(port)])
        procs.append(router)
        wait_ready(router)
        yield f"http://127.0.0.1:{port}", worker.address
    finally:
        for p in reversed(procs):
            stop(p)


def _client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{base}/v1", api_key=os.environ.get("KVMESH_API_KEY", "none"), max_retries=0, timeout=300)


@pytest.mark.parametrize("model, prompt", [
    (Person, "Describe a fictional person as JSON with name, age and favourite colour."),
    (Team, "Describe a small software team as JSON: team name, members, office address, budget, motto."),
    (Weather, "Report today's weather in Paris as JSON."),
])
def test_parse_returns_a_validated_object(server, model, prompt):
    base, worker = server
    resp = _client(base).chat.completions.parse(
        model="kvmesh", messages=[{"role": "user", "content": prompt}], response_format=model,
        temperature=0, max_tokens=400)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, model)
    jsonschema.validate(json.loads(msg.content), model.model_json_schema())


def test_stream_with_guided_choice_and_completions_with_regex(server):
    base, _ = server
    c = _client(base)
    chunks = c.chat.completions.create(
        model="kvmesh", messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        stream=True, temperature=0, max_tokens=20, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text in ("yes", "no", "maybe")
    out = c.completions.create(model="kvmesh", prompt="Today's date is", max_tokens=30, temperature=0.7, seed=3,
                               extra_body={"structured_outputs": {"regex": r" \d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", out.choices[0].text)


def test_bad_schema_is_400_naming_the_field(server):
    from openai import BadRequestError

    base, worker = server
    with pytest.raises(BadRequestError) as err:
        _client(base).chat.completions.create(
            model="kvmesh", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    body = err.value.body
    assert body["param"] == "structured_outputs.json" and "cannot compile" in body["message"]
    import asyncio

    asyncio.run(wait_idle([worker]))
