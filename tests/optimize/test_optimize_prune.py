"""Structured pruning on tiny random Llama checkpoints: shapes and parameter counts,
exact slicing (pruning zeroed units changes no logit), block-influence ranking,
Wanda channel scores, --target-params planning, and kvmesh == transformers on the result."""

import json

import pytest
import torch

from helpers import hf_greedy
from kvmesh import LLM, SamplingParams
from kvmesh.errors import ConfigError
from kvmesh.models.arch import ArchConfig
from kvmesh.optimize.prune import (
    PruneShape, calibrate, count_params, layer_order, load_state_dict, mlp_channel_scores, prune_checkpoint,
    read_config, resolve_shape, shape_for_target, write_checkpoint,
)

MODEL = dict(num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=384)
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True}


def _windows(n=4, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (length,), generator=g).tolist() for _ in range(n)]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _edited_copy(src, dst, edit):
    """A copy of checkpoint `src` in `dst` with edit(state_dict) applied."""
    sd = load_state_dict(src)
    edit(sd)
    write_checkpoint(dst, read_config(src), sd, src, {"kind": "test"})
    return dst


@pytest.fixture(scope="module")
def base(model_factory):
    return model_factory(**MODEL)


def test_shapes_and_param_counts(base, tmp_path):
    cfg = ArchConfig.from_hf(read_config(base))
    shape = resolve_shape(cfg, drop_layers=1, heads=2, mlp_ratio=0.5)
    assert shape == PruneShape(3, 2, 64)
    res = prune_checkpoint(base, tmp_path / "p", shape, _windows(), progress=False)
    conf = read_config(tmp_path / "p")
    assert (conf["num_hidden_layers"], conf["num_attention_heads"], conf["num_key_value_heads"],
            conf["intermediate_size"], conf["head_dim"]) == (3, 2, 1, 64, 16)
    hf = _hf(tmp_path / "p")
    n = sum(p.numel() for p in hf.parameters())
    assert n == res.params_after == count_params(cfg, shape)
    assert res.params_before == sum(p.numel() for p in _hf(base).parameters())
    sd = load_state_dict(tmp_path / "p")
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (2 * 16, 64)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)
    assert sd["model.layers.2.mlp.down_proj.weight"].shape == (64, 64)
    assert "model.layers.3.mlp.down_proj.weight" not in sd
    meta = json.loads((tmp_path / "p" / "kvmesh_optimize.json").read_text())
    assert len(meta["teacher_layers"]) == 3 and (tmp_path / "p" / "tokenizer.json").is_file()


def test_pruning_zeroed_units_keeps_logits_exactly(base, tmp_path):
    """KV group 0 and the odd MLP channels contribute nothing (their o_proj / down_proj
    columns are zero): pruning must remove exactly them and leave every logit unchanged."""
    def zero(sd):
        for i in range(4):
            sd[f"model.layers.{i}.self_attn.o_proj.weight"][:, :32] = 0  # query heads 0-1 = KV group 0
            sd[f"model.layers.{i}.mlp.down_proj.weight"][:, 1::2] = 0
    src = _edited_copy(base, tmp_path / "src", zero)
    cfg = ArchConfig.from_hf(read_config(src))
    res = prune_checkpoint(src, tmp_path / "p", resolve_shape(cfg, heads=2, mlp_ratio=0.5), _windows(),
                           progress=False)
    assert res.plan.kept_kv_groups == [[1]] * 4
    assert res.plan.kept_channels == [list(range(0, 128, 2))] * 4
    ids = torch.tensor([_windows(1, 30, seed=5)[0]])
    with torch.no_grad():
        torch.testing.assert_close(_hf(tmp_path / "p")(ids).logits, _hf(src)(ids).logits, rtol=1e-4, atol=1e-4)


def test_identity_layer_has_lowest_block_influence(base, tmp_path):
    def make_identity(sd):
        sd["model.layers.2.self_attn.o_proj.weight"].zero_()
        sd["model.layers.2.mlp.down_proj.weight"].zero_()
    src = _edited_copy(base, tmp_path / "src", make_identity)
    stats = calibrate(_hf(src), _windows(), progress=False)
    assert layer_order(stats)[0] == 2
    assert stats.block_influence[2] == pytest.approx(0.0, abs=1e-6)
    assert min(b for i, b in enumerate(stats.block_influence) if i != 2) > 1e-3
    res = prune_checkpoint(src, tmp_path / "p", PruneShape(3, 4, 128), _windows(), progress=False)
    assert res.plan.kept_layers == [0, 1, 3]


def test_wanda_channel_score_weights_by_activation():
    sd = {"m.mlp.down_proj.weight": torch.tensor([[1.0, 9.0, 1.0, 0.0], [1.0, 9.0, 1.0, 0.0]])}
    down_in = torch.tensor([1.0, 0.0, 5.0, 7.0])  # channel 1 never fires; channel 3 fires but writes nothing
    scores = mlp_channel_scores(sd, "m", down_in)
    assert scores.tolist() == [2.0, 0.0, 10.0, 0.0]


@pytest.mark.parametrize("fraction", [0.9, 0.75, 0.5, 0.3])
def test_target_params_lands_just_under_target(fraction):
    cfg = ArchConfig.from_hf(SMOLLM2)
    target = int(cfg.num_params * fraction)
    shape = shape_for_target(cfg, target)
    got = count_params(cfg, shape)
    assert got <= target
    assert target - got <= 8 * 3 * cfg.hidden_size * shape.num_layers  # one rounding unit
    assert shape.num_heads % 3 == 0 and shape.intermediate_size % 8 == 0
    assert shape.num_layers < cfg.num_layers  # depth takes a share


def test_target_params_errors_name_the_flag():
    cfg = ArchConfig.from_hf(SMOLLM2)
    with pytest.raises(ConfigError, match="--target-params.*not below"):
        shape_for_target(cfg, cfg.num_params + 1)
    with pytest.raises(ConfigError, match="smallest prunable"):
        shape_for_target(cfg, 1000)
    with pytest.raises(ConfigError, match="--heads.*groups of 3"):
        resolve_shape(cfg, heads=4)
    with pytest.raises(ConfigError, match="--drop-layers"):
        resolve_shape(cfg, drop_layers=30)
    with pytest.raises(ConfigError, match="--mlp-ratio"):
        resolve_shape(cfg, mlp_ratio=1.5)
    with pytest.raises(ConfigError, match="nothing to prune"):
        resolve_shape(cfg)
    with pytest.raises(ConfigError, match="--target-params chooses"):
        resolve_shape(cfg, target_params="50%", drop_layers=2)


def test_pruned_checkpoint_kvmesh_equals_transformers(base, tmp_path):
    cfg = ArchConfig.from_hf(read_config(base))
    prune_checkpoint(base, tmp_path / "p", resolve_shape(cfg, drop_layers=2, heads=2, mlp_ratio=0.75),
                     _windows(), progress=False)
    torch.set_num_threads(1)
    hf = _hf(tmp_path / "p")
    llm = LLM(str(tmp_path / "p"), progress=False, block_size=4, num_blocks=128)
    prompts = _windows(3, 11, seed=9)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3", "qwen3_moe"])
def test_layouts_the_plan_does_not_know_are_refused_by_name(model_factory, tmp_path, architecture):
    """Served but not prunable yet (q/k norms, Gemma's norms, experts): a ConfigError naming the
    architecture, before any folder is written, not a checkpoint with dropped tensors."""
    from kvmesh.optimize.prune import first_layers_checkpoint

    src = model_factory(architecture=architecture)
    cfg = ArchConfig.from_hf(json.loads((src / "config.json").read_text()))
    with pytest.raises(ConfigError, match=f"{cfg.architecture} is served but not prunable"):
        resolve_shape(cfg, drop_layers=1)
    with pytest.raises(ConfigError, match="not prunable"):
        prune_checkpoint(src, tmp_path / "out", PruneShape(2, cfg.num_heads, cfg.intermediate_size), [[1, 2, 3]])
    with pytest.raises(ConfigError, match="not prunable"):
        first_layers_checkpoint(src, tmp_path / "student", 1)
    assert not (tmp_path / "student").exists()
