"""AsyncLLMEngine: concurrent streams, cancellation frees blocks, bad input is isolated."""

import asyncio

import pytest
import torch

from kvmesh.build import build_engine
from kvmesh import InvalidRequestError, SamplingParams
from kvmesh.engine.async_engine import AsyncLLMEngine


@pytest.fixture(scope="module")
def engine(tiny_llama):
    torch.set_num_threads(1)
    return build_engine(model=str(tiny_llama), progress=False, block_size=4, num_blocks=200,
                                 max_model_len=256)


def _prompt(n, seed=0):
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_concurrent_streams_match_offline(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [_prompt(n, n) for n in (3, 20, 41)]

    async def main():
        aeng = AsyncLLMEngine(engine)

        async def consume(p):
            deltas, last = [], None
            async for out in aeng.generate(p, greedy):
                deltas.extend(out.outputs[0].delta_token_ids)
                last = out
            return deltas, last

        res = await asyncio.gather(*(consume(p) for p in prompts))
        await aeng.shutdown()
        return res

    results = asyncio.run(main())
    for p, (deltas, last) in zip(prompts, results):
        assert last.finished and deltas == last.outputs[0].token_ids and len(deltas) == 12
        engine.add_request("offline", p, greedy)
        offline = None
        while engine.has_unfinished():
            for o in engine.step():
                offline = o
        assert offline.outputs[0].token_ids == deltas
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_every_step_runs_on_one_thread(engine, monkeypatch):
    """Steps never alternate between threads: an OpenMP team belongs to the thread that
    starts it, and two teams on two cores take cores from each other."""
    import threading
    import time

    threads = set()
    real_step = engine.step

    def step():
        threads.add(threading.get_ident())
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def main():
        aeng = AsyncLLMEngine(engine)
        loop = asyncio.get_running_loop()

        async def consume(i):
            async for _ in aeng.generate(_prompt(5 + i, i), SamplingParams(max_tokens=6, ignore_eos=True)):
                await asyncio.sleep(0.001 * i)  # consumers that lag, so the loop idles and wakes

        async def other_blocking_work():  # the process's default executor is busy too
            while True:
                await asyncio.gather(*(loop.run_in_executor(None, time.sleep, 0.002) for _ in range(3)))

        other = asyncio.create_task(other_blocking_work())
        for _ in range(3):
            await asyncio.gather(*(consume(i) for i in range(4)))
        other.cancel()
        await aeng.shutdown()

    asyncio.run(main())
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_model_load_steps_and_between_step_calls_share_one_thread(tiny_llama, monkeypatch):
    """build_async_engine loads the model on the step thread, and run_between_steps calls
    (block reads for KV transfers, stats) run there too: a torch op on any other thread
    leaves a second OpenMP team, and libgomp then throttles every worker's spin-wait."""
    import threading

    import kvmesh.build as build

    threads = {}
    real_parts = build.build_parts

    def parts(*args, **kwargs):
        threads["load"] = threading.get_ident()
        return real_parts(*args, **kwargs)

    monkeypatch.setattr(build, "build_parts", parts)
    aeng = build.build_async_engine(model=str(tiny_llama), progress=False, block_size=4, num_blocks=64,
                                    max_model_len=128)
    real_step = aeng.engine.step

    def step():
        threads.setdefault("steps", set()).add(threading.get_ident())
        return real_step()

    monkeypatch.setattr(aeng.engine, "step", step)

    async def main():
        async for _ in aeng.generate(_prompt(9), SamplingParams(max_tokens=4, ignore_eos=True)):
            threads["call"] = await aeng.run_between_steps(threading.get_ident)
        with pytest.raises(ZeroDivisionError):  # a failing call raises in its caller only
            await aeng.run_between_steps(lambda: 1 / 0)
        assert await aeng.run_between_steps(lambda: aeng.engine.num_free_blocks) == aeng.engine.num_usable_blocks
        await aeng.shutdown()

    asyncio.run(main())
    assert threads["steps"] == {threads["load"]} == {threads["call"]}
    assert threads["load"] != threading.get_ident()


def test_cancel_and_break_free_blocks_others_unaffected(engine):
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        aeng = AsyncLLMEngine(engine)

        async def run_to_end():
            n = 0
            async for out in aeng.generate(_prompt(9, 1), SamplingParams(max_tokens=30, ignore_eos=True)):
                n = len(out.outputs[0].token_ids)
            return n

        async def cancelled():
            async for _ in aeng.generate(_prompt(50, 2), long):
                pass

        async def breaks_early():
            gen = aeng.generate(_prompt(30, 3), long)
            async for out in gen:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            await gen.aclose()

        survivor = asyncio.create_task(run_to_end())
        victim = asyncio.create_task(cancelled())
        await asyncio.sleep(0.3)
        victim.cancel()
        await breaks_early()
        n = await survivor
        await aeng.wait_idle()
        await aeng.shutdown()
        return n

    assert asyncio.run(main()) == 30
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == engine.num_usable_blocks


def test_bad_request_raises_before_streaming(engine):
    async def main():
        aeng = AsyncLLMEngine(engine)
        with pytest.raises(InvalidRequestError, match="prompt"):
            async for _ in aeng.generate("", SamplingParams()):
                pass
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            async for _ in aeng.generate([5] * 400, SamplingParams()):
                pass
        outs = [o async for o in aeng.generate(_prompt(5), SamplingParams(max_tokens=4, ignore_eos=True))]
        await aeng.shutdown()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
