"""Gemma-3-270M served by name, as a vLLM user would start it (`--model google/gemma-3-270m`):
a worker and a router with the OpenAI HTTP API, as real processes; a chat comes back as text
rendered through Gemma's chat template. The conversion into the cache happens once, in the
test process, before the processes start (they then reuse the folder)."""

from __future__ import annotations

import pytest

from kvmesh_procs import spawn_router, spawn_worker, stop, wait_idle, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NAME = "google/gemma-3-270m"


@pytest.fixture(scope="module")
def gemma_dir():
    from kvmesh.checkpoint.files import resolve_model_path

    return resolve_model_path(NAME, progress=False)


@pytest.fixture(scope="module")
def server(gemma_dir, tmp_path_factory):
    from kvmesh.rpc import free_port

    logs = tmp_path_factory.mktemp("gemma-http-logs")
    worker = spawn_worker("gemma-worker", NAME, "unified", logs, num_blocks=64, block_size=16, max_model_len=256)
    router = None
    try:
        wait_ready(worker, timeout=400)
        port = free_port()
        router = wait_ready(spawn_router("gemma-router", NAME, [worker.address], logs,
                                         extra=["--http-port", str(port)]), timeout=300)
        yield worker.address, f"http://127.0.0.1:{port}"
    finally:
        if router is not None:
            stop(router)
        stop(worker)


def test_chat_answers_through_the_openai_api(server, gemma_dir):
    import asyncio

    from openai import OpenAI

    from kvmesh.checkpoint.files import load_tokenizer

    worker, base = server
    client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="kvmesh", messages=messages, max_tokens=16, temperature=0)
    text = reply.choices[0].message.content
    assert text and text.strip()
    assert reply.choices[0].finish_reason in ("length", "stop")
    ids = load_tokenizer(gemma_dir).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert reply.usage.prompt_tokens == len(ids)  # <bos><start_of_turn>user ... <start_of_turn>model
    again = client.chat.completions.create(model="kvmesh", messages=messages, max_tokens=16, temperature=0)
    assert again.choices[0].message.content == text  # greedy: the same answer (prefix-cache hit)
    asyncio.run(wait_idle([worker]))
