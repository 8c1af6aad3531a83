"""Distillation on tiny random Llama checkpoints: the loss falls, the result loads in kvmesh
and transformers with equal greedy tokens, a resumed run ends with the same weights as an
uninterrupted one, and the distilled student is a lossless speculative-decoding draft."""

import pytest
import torch

from helpers import hf_greedy
from kvmesh import LLM, SamplingParams
from kvmesh.errors import ConfigError
from kvmesh.optimize.distill import DistillConfig, batch_indices, distill, kd_loss, kd_loss_topk, layer_map
from kvmesh.optimize.prune import PruneShape, load_state_dict, prune_checkpoint

SEQ = 24


def _windows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, 384, (SEQ - 1,), generator=g).tolist()] for _ in range(n)]


def _cfg(**kw):
    return DistillConfig(**{"steps": 6, "lr": 3e-3, "batch_size": 2, "seq_len": SEQ, "threads": 1, **kw})


@pytest.fixture(scope="module")
def teacher(model_factory):
    return model_factory(num_layers=3)


def test_distilled_first_layers_load_in_kvmesh_and_transformers(teacher, tmp_path):
    from transformers import AutoModelForCausalLM

    res = distill(teacher, "first-layers:1", tmp_path / "s", _cfg(steps=8), train_windows=_windows(), progress=False)
    assert res.losses[-1] < res.losses[0]
    assert not (tmp_path / "s" / "checkpoint").exists() and not (tmp_path / "s" / "student-init").exists()
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "s"), dtype=torch.float32).eval()
    assert hf.config.num_hidden_layers == 1
    llm = LLM(str(tmp_path / "s"), progress=False, block_size=4, num_blocks=128)
    prompts = [w[:9] for w in _windows(3, seed=4)]
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0,
                                                                         ignore_eos=True))):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10)


def test_resume_gives_the_same_weights_as_uninterrupted(teacher, tmp_path):
    cfg = _cfg(steps=5, checkpoint_every=2)
    distill(teacher, "first-layers:2", tmp_path / "full", cfg, train_windows=_windows(), progress=False)

    def interrupt(step, loss):
        if step == 3:  # after the step-2 checkpoint; step 3's work is lost
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        distill(teacher, "first-layers:2", tmp_path / "cut", cfg, train_windows=_windows(), progress=False,
                on_step=interrupt)
    assert (tmp_path / "cut" / "checkpoint" / "state.pt").is_file()
    with pytest.raises(ConfigError, match="--resume"):  # forgetting --resume is a clear error
        distill(teacher, "first-layers:2", tmp_path / "cut", cfg, train_windows=_windows(), progress=False)
    with pytest.raises(ConfigError, match="other settings"):
        distill(teacher, "first-layers:2", tmp_path / "cut", _cfg(steps=5, checkpoint_every=2, lr=1e-3),
                resume=True, train_windows=_windows(), progress=False)
    res = distill(teacher, "first-layers:2", tmp_path / "cut", cfg, resume=True, train_windows=_windows(),
                  progress=False)
    assert res.resumed_from == 2
    full, cut = load_state_dict(tmp_path / "full"), load_state_dict(tmp_path / "cut")
    assert full.keys() == cut.keys()
    for name in full:
        assert torch.equal(full[name], cut[name]), name


def test_pruned_student_with_hidden_loss_and_topk_cache(teacher, tmp_path):
    res = prune_checkpoint(teacher, tmp_path / "p", PruneShape(2, 4, 64), _windows(4), progress=False)
    assert layer_map(tmp_path / "p", 2, 3) == res.plan.kept_layers  # hidden states matched to the source layers
    assert layer_map(tmp_path / "nometa", 2, 6) == [2, 5]  # no metadata: evenly spaced
    one_batch = _windows(1) * 2  # the same batch every step: the loss must fall
    hidden = distill(teacher, str(tmp_path / "p"), tmp_path / "h", _cfg(hidden_loss_weight=1.0, steps=8, lr=1e-3),
                     train_windows=one_batch, progress=False)
    topk = distill(teacher, str(tmp_path / "p"), tmp_path / "k", _cfg(teacher_top_k=16, steps=8, lr=1e-3),
                   train_windows=one_batch, progress=False)
    assert hidden.losses[-1] < hidden.losses[0] and topk.losses[-1] < topk.losses[0]


def test_kd_losses():
    t = torch.randn(3, 5, 50)
    assert float(kd_loss(t, t, 2.0)) == pytest.approx(0.0, abs=1e-6)
    top = t.topk(50, dim=-1)  # top-k over the whole vocab is the exact KL
    s = torch.randn(3, 5, 50)
    assert float(kd_loss_topk(s, top.values, top.indices, 2.0)) == pytest.approx(float(kd_loss(s, t, 2.0)), rel=1e-4)


def test_batch_order_depends_only_on_step_and_seed():
    seen = [i for step in range(4) for i in batch_indices(step, 3, 12, seed=1)]
    assert sorted(seen) == list(range(12))  # one epoch visits every window once
    assert batch_indices(2, 3, 12, seed=1) == batch_indices(2, 3, 12, seed=1) != batch_indices(2, 3, 12, seed=2)


def test_bad_settings_are_clear_errors(teacher, tmp_path):
    with pytest.raises(ConfigError, match="--temperature"):
        DistillConfig(steps=1, temperature=0)
    with pytest.raises(ConfigError, match="--hidden-loss-weight needs"):
        DistillConfig(steps=1, hidden_loss_weight=1.0, teacher_top_k=8)
    with pytest.raises(ConfigError, match="first-layers:K"):
        distill(teacher, "first-layers:x", tmp_path / "o", _cfg(), train_windows=_windows(), progress=False)
    with pytest.raises(ConfigError, match="not a checkpoint folder"):
        distill(teacher, str(tmp_path / "nope"), tmp_path / "o2", _cfg(), train_windows=_windows(), progress=False)
    with pytest.raises(ConfigError, match=r"K must be in \[1, 3\]"):
        distill(teacher, "first-layers:7", tmp_path / "o3", _cfg(), train_windows=_windows(), progress=False)


def test_distilled_draft_is_lossless_for_its_teacher(tiny_llama, tmp_path):
    distill(tiny_llama, "first-layers:1", tmp_path / "draft", _cfg(steps=10), train_windows=_windows(16),
            progress=False)
    kw = dict(progress=False, block_size=4, num_blocks=400, max_model_len=256, max_num_batched_tokens=16)
    prompts = [w[:n] for w, n in zip(_windows(4, seed=11), (5, 17, 9, 23))]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **kw).generate(prompts, greedy)]
    llm = LLM(str(tiny_llama), speculative={"method": "draft", "model": str(tmp_path / "draft"),
                                            "num_speculative_tokens": 3}, **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert got == ref
    assert llm.engine.stats()["spec_proposed_tokens"] > 0
    assert llm.engine.num_free_blocks == llm.engine.num_usable_blocks


def test_chat_data_is_the_teachers_greedy_replies(teacher, tmp_path):
    from kvmesh.optimize.corpus import chat_prompts
    from kvmesh.optimize.generate import teacher_chat_windows

    cache = tmp_path / "chat.json"
    kw = dict(num_prompts=3, max_tokens=6, seq_len=SEQ, cache=cache, threads=1, progress=False)
    windows = teacher_chat_windows(teacher, **kw)
    assert windows and all(len(w) == SEQ and w[0] == 1 for w in windows)  # BOS + packed stream
    # The stream is prompt + the teacher's greedy reply (the tiny tokenizer has no chat
    # template: the instruction as plain text) + EOS, conversation after conversation.
    llm = LLM(str(teacher), progress=False)
    prompt = llm.engine.encode(chat_prompts("train", 3)[0])
    reply = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].token_ids
    first = [*prompt, *reply]
    first += [] if first[-1] == 2 else [2]
    stream = [t for w in windows for t in w[1:]]
    assert stream[: min(len(first), len(stream))] == first[: len(stream)]
    assert teacher_chat_windows(teacher, **kw) == windows  # served from the cache
    # A run on chat data distils, and --resume settings include the data choice.
    res = distill(teacher, "first-layers:1", tmp_path / "d", _cfg(data="chat", chat_prompts=3, chat_max_tokens=6,
                                                                   steps=4), progress=False)
    assert len(res.losses) == 4
    with pytest.raises(ConfigError, match="--data"):
        _cfg(data="web")
