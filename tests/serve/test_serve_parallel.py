"""`kvmesh serve --tensor-parallel-size 2` on a real local Ray instance: the README
quickstart's curl and Python snippets, as written, answer with the one-rank engine's greedy
text; a killed rank makes Ray's health check fail and Serve replaces the whole replica (a
new rank process), which then answers the same; Ctrl-C leaves no rank process behind. The
same with `rank_launch: actors`, where rank 1 is a Ray actor instead.

The embedded SmolLM2 has 9 attention heads, so it cannot shard over 2 ranks (vLLM refuses
it too): the tiny random Llama (4 heads, 2 KV heads) serves at TP=2 here, and the embedded
model at TP=3 / PP=2 is covered by tests/worker/test_parallel_embedded.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import is_rank_process
from serve_procs import start_serve, stop_serve
from test_quickstart import snippet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
QUICKSTART_PROMPT, QUICKSTART_TOKENS = "The capital of France is", 8


def rank_processes(root: int) -> list[psutil.Process]:
    """Descendants of `root` that are parallel ranks."""
    return [p for p in psutil.Process(root).children(recursive=True) if is_rank_process(p)]


def quickstart() -> tuple[str, str]:
    """(curl's completion text, the Python gRPC snippet's output), both as the README writes them."""
    out = subprocess.run(["bash", "-c", snippet("curl")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert "choices" in body, body
    py = subprocess.run([sys.executable, "-c", snippet("python")], capture_output=True, text=True, timeout=120)
    assert py.returncode == 0, py.stderr
    return body["choices"][0]["text"], py.stdout.rstrip("\n")


def rank_actor_processes(root: int) -> list[psutil.Process]:
    """Descendants of `root` that run a rank actor (Ray titles a worker by its running task)."""
    out = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if "RankActor" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _one_rank_text(tiny_llama) -> str:
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.llm import LLM

    llm = LLM(model=str(tiny_llama), max_model_len=256, block_size=4, num_blocks=128)
    want = llm.generate([QUICKSTART_PROMPT], SamplingParams(max_tokens=QUICKSTART_TOKENS, temperature=0))[0]
    llm.close()
    return want.outputs[0].text


def _serve_kill_and_recover(tiny_llama, tmp_path, extra: list[str], find_ranks) -> None:
    """Serve at TP=2, answer the quickstart as TP=1 does, SIGKILL rank 1 (found by
    `find_ranks(serve pid)`), see Serve replace the replica with a fresh rank 1 that answers
    the same, stop: no rank left."""
    want = _one_rank_text(tiny_llama)
    flags = ["--max-model-len", "256", "--block-size", "4", "--num-blocks", "128"]
    s = start_serve([*extra, "--model", str(tiny_llama), "--tensor-parallel-size", "2", *flags],
                    tmp_path / "serve.log")
    ranks: list[psutil.Process] = []
    try:
        assert s.grpc == "127.0.0.1:50051" and s.http == "http://127.0.0.1:8000"
        deadline = time.monotonic() + 60
        while not (ranks := find_ranks(s.popen.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)  # (a rank actor's title appears once its run task starts)
        assert len(ranks) == 1, [r.cmdline() for r in ranks]  # rank 1; rank 0 is the replica itself
        assert quickstart() == (want, want)

        # A dead rank: the replica's health check fails, Ray Serve replaces the replica, and
        # with it the group (a fresh rank 1), which answers as before.
        os.kill(ranks[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 240
        fresh: list[psutil.Process] = []
        while time.monotonic() < deadline:
            fresh = [r for r in find_ranks(s.popen.pid) if r.pid != ranks[0].pid]
            if fresh:
                break
            assert s.alive(), s.log.read_text()[-3000:]
            time.sleep(1)
        assert fresh, f"no new rank within 240 s; log:\n{s.log.read_text()[-3000:]}"
        ranks += fresh
        deadline = time.monotonic() + 240
        while True:  # the new replica deploys, then the router finds it
            try:
                got = quickstart()
                if got == (want, want):
                    break
            except AssertionError:
                got = None
            assert time.monotonic() < deadline, f"not serving again: {got}; log:\n{s.log.read_text()[-3000:]}"
            time.sleep(2)
    finally:
        rc = stop_serve(s)
    assert rc == 0, s.log.read_text()[-3000:]
    alive = [r.pid for r in ranks if r.is_running() and r.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"ranks left behind: {alive}"


def test_ray_serve_tensor_parallel_2_answers_the_quickstart_and_restarts_a_broken_group(tiny_llama, tmp_path):
    _serve_kill_and_recover(tiny_llama, tmp_path, [], rank_processes)


def test_ray_serve_rank_actors_answer_the_quickstart_and_restart_with_the_replica(tiny_llama, tmp_path):
    """`decode: {rank_launch: actors}`: rank 1 is a Ray actor in bundle 1 of the replica's
    placement group, not a child process of the replica; killing it replaces the replica,
    whose new group has a new rank actor (the old replica's actors die with it)."""
    config = tmp_path / "serving.yaml"
    config.write_text("decode:\n  rank_launch: actors\n")
    _serve_kill_and_recover(tiny_llama, tmp_path, ["--config", str(config)],
                            lambda pid: [] if rank_processes(pid) else rank_actor_processes(pid))
