"""Knowledge distillation of a (pruned or truncated) student from its teacher, on CPU.

Loss per token (Hinton et al. 2015), T = temperature:

    L = T^2 * KL(softmax(z_t / T) || softmax(z_s / T))
        + w_h * mean_l ||h_s[l] - h_t[m(l)]||^2 / mean ||h_t[m(l)]||^2

The second term (hidden-state MSE, relative to the teacher's scale) matches each
student layer l to the teacher layer m(l) it was cut from (``teacher_layers`` in the
student's kvmesh_optimize.json; evenly spaced layers for a student without one).

Teacher logits are computed on the fly (exact KL, allows the hidden term), or once up
front as the top-k logits of every training window (``teacher_top_k``: the teacher
then costs one forward per window for the whole run, shared by several students via
``teacher_cache``); the KL is then taken over the teacher's top-k tokens, with the
teacher's probabilities renormalised over them.

Training is plain PyTorch on the transformers model (kvmesh's engine is
inference-only). Token embeddings (and a tied lm_head) stay frozen: pruning never
changes them and they are a fifth of a small model's parameters. Data order is a
function of (seed, step) alone, and checkpoints hold weights, optimizer, scheduler,
step and every RNG state, so a resumed run ends with the same weights as an
uninterrupted one.

One file (~400 lines) because the loss, the teacher cache and the training loop share
the same window and layer-mapping state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvmesh.errors import ConfigError
from kvmesh.models.loader import load_tokenizer
from kvmesh.optimize.corpus import token_windows
from kvmesh.optimize.generate import teacher_chat_windows
from kvmesh.optimize.lora_adapter import add_lora, save_adapter
from kvmesh.optimize.prune import META_FILE, first_layers_checkpoint, read_config, write_checkpoint

CHECKPOINT_DIR = "checkpoint"
STUDENT_INIT_DIR = "student-init"
_STATE_FILE = "state.pt"


@dataclass(frozen=True)
class DistillConfig:
    """Hyperparameters of one distillation run (validated on construction)."""

    steps: int
    # T = 1 by default: on SmolLM2-135M pruned by 25%, 100 steps at T = 2 made held-out
    # perplexity worse than no distillation (27.8 -> 35.9), T = 1 better (-> 21.5).
    temperature: float = 1.0
    hidden_loss_weight: float = 0.0
    lr: float = 2e-4
    batch_size: int = 4
    seq_len: int = 128
    warmup_steps: int | None = None  # None: 5% of steps
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0
    teacher_top_k: int = 0  # 0: full teacher logits on the fly; k > 0: cached top-k
    # Training text: "corpus" (the corpus train split) or "chat" (the teacher's greedy
    # replies to chat_prompts instructions built from that split; see generate.py).
    data: str = "corpus"
    chat_prompts: int = 256
    chat_max_tokens: int = 96
    threads: int | None = None
    # > 0: train a LoRA adapter of this rank on the frozen student (the serving base) and
    # write it as a peft folder instead of a full student (optimize/lora_adapter.py).
    lora_rank: int = 0
    lora_alpha: float | None = None  # None: 2 * lora_rank

    def __post_init__(self) -> None:
        checks = [
            (self.steps >= 1, f"--steps: {self.steps} must be >= 1"),
            (self.temperature > 0, f"--temperature: {self.temperature} must be > 0"),
            (self.hidden_loss_weight >= 0, f"--hidden-loss-weight: {self.hidden_loss_weight} must be >= 0"),
            (self.lr > 0, f"--lr: {self.lr} must be > 0"),
            (self.batch_size >= 1, f"--batch-size: {self.batch_size} must be >= 1"),
            (self.seq_len >= 8, f"--seq-len: {self.seq_len} must be >= 8"),
            (self.checkpoint_every >= 1, f"--checkpoint-every: {self.checkpoint_every} must be >= 1"),
            (self.teacher_top_k >= 0, f"--teacher-top-k: {self.teacher_top_k} must be >= 0"),
            (self.data in ("corpus", "chat"), f"--data: {self.data!r} is not one of corpus, chat"),
            (self.chat_prompts >= 1, f"--chat-prompts: {self.chat_prompts} must be >= 1"),
            (self.chat_max_tokens >= 1, f"--chat-max-tokens: {self.chat_max_tokens} must be >= 1"),
            (self.lora_rank >= 0, f"--lora-rank: {self.lora_rank} must be >= 0"),
            (self.lora_alpha is None or self.lora_alpha > 0, f"--lora-alpha: {self.lora_alpha} must be > 0"),
            (not (self.teacher_top_k and self.hidden_loss_weight),
             "--hidden-loss-weight needs the teacher's hidden states on the fly: "
             "drop --teacher-top-k or set --hidden-loss-weight 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)


# ----------------------------------------------------------------------------- losses


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(p_t || p_s) at temperature T, mean over tokens. Logits: (..., V)."""
    v = student_logits.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, v).float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.reshape(-1, v).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def kd_loss_topk(student_logits: torch.Tensor, top_values: torch.Tensor, top_indices: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """KL over the teacher's top-k tokens (teacher renormalised over them), T^2-scaled.

    student_logits (..., V); top_values / top_indices (..., k) of the teacher's logits.
    """
    v, k = student_logits.shape[-1], top_values.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, v).float() / temperature, dim=-1)
    s_k = s.gather(1, top_indices.reshape(-1, k).long())
    t_k = F.log_softmax(top_values.reshape(-1, k).float() / temperature, dim=-1)
    return (t_k.exp() * (t_k - s_k)).sum(-1).mean() * temperature**2


def hidden_loss(student_h: list[torch.Tensor], teacher_h: list[torch.Tensor]) -> torch.Tensor:
    """Mean over matched layers of ||h_s - h_t||^2 / ||h_t||^2 (scale-free across depth)."""
    terms = [(s - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-8) for s, t in zip(student_h, teacher_h)]
    return torch.stack(terms).mean()


# ------------------------------------------------------------------------------- data


def batch_indices(step: int, batch_size: int, num_windows: int, seed: int) -> list[int]:
    """Window indices of `step`'s batch: epoch e walks permutation(seed, e). Pure in (step, seed)."""
    out = []
    for j in range(batch_size):
        epoch, pos = divmod(step * batch_size + j, num_windows)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out.append(int(torch.randperm(num_windows, generator=g)[pos]))
    return out


def windows_digest(windows: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(windows).encode()).hexdigest()[:16]


@torch.inference_mode()
def teacher_topk_cache(teacher, windows: list[list[int]], k: int, path: Path, key: dict,
                       progress: bool = True, chunk: int = 4) -> dict[str, torch.Tensor]:
    """{"values" (N, S, k) fp16, "indices" (N, S, k) int32} of the teacher's logits; reused from `path` if its key matches."""
    from tqdm.auto import tqdm

    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if cached.get("key") == json.dumps(key, sort_keys=True):
            return cached
    vals, idx = [], []
    for i in tqdm(range(0, len(windows), chunk), desc="teacher top-k logits", unit="batch", disable=not progress):
        logits = teacher(torch.tensor(windows[i:i + chunk]), use_cache=False).logits
        top = logits.float().topk(k, dim=-1)
        vals.append(top.values.half())
        idx.append(top.indices.int())
    cache = {"values": torch.cat(vals), "indices": torch.cat(idx), "key": json.dumps(key, sort_keys=True)}
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_save(cache, path)
    return cache


# ----------------------------------------------------------------------------- models


def load_causal_lm(path: Path, train: bool):
    """An fp32 transformers causal LM from an HF folder (eval mode, no grads, unless `train`)."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train(train)
    if not train:
        model.requires_grad_(False)
    return model


def prepare_student(teacher_path: Path, student: str, out: Path) -> Path:
    """The student's initial folder: `student` itself, or the teacher's first K layers for 'first-layers:K'."""
    if student.startswith("first-layers:"):
        try:
            k = int(student.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"--student: {student!r}: write first-layers:K with an integer K") from None
        init = out / STUDENT_INIT_DIR
        if (init / META_FILE).is_file():
            return init  # made by an earlier (interrupted) run of the same OUT
        shutil.rmtree(init, ignore_errors=True)
        return first_layers_checkpoint(teacher_path, init, k)
    path = Path(student).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"STUDENT: {student!r} is not a checkpoint folder (no config.json); pass a pruned "
                          "checkpoint folder or first-layers:K")
    return path


def layer_map(student_path: Path, n_student: int, n_teacher: int) -> list[int]:
    """Teacher layer matched to each student layer (for the hidden-state loss)."""
    meta_file = student_path / META_FILE
    if meta_file.is_file():
        layers = json.loads(meta_file.read_text()).get("teacher_layers")
        if layers and len(layers) == n_student and max(layers) < n_teacher:
            return list(layers)
    return [round((i + 1) * n_teacher / n_student) - 1 for i in range(n_student)]


def _freeze_embeddings(model) -> None:
    model.get_input_embeddings().requires_grad_(False)
    model.get_output_embeddings().requires_grad_(False)


def _capture_layer_outputs(model, layers: list[int], store: list) -> list:
    """Forward hooks appending the outputs of decoder `layers` (in order) to `store`."""
    hooks = []
    for i in layers:
        def hook(mod, args, out):
            store.append(out[0] if isinstance(out, tuple) else out)
        hooks.append(model.model.layers[i].register_forward_hook(hook))
    return hooks


# ------------------------------------------------------------------------ checkpoints


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rng_state() -> dict:
    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _lr_lambda(cfg: DistillConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


# ---------------------------------------------------------------------------- driver


@dataclass
class DistillResult:
    out: Path
    steps: int
    losses: list[float]
    resumed_from: int


def distill(teacher_path: Path, student: str, out: Path, cfg: DistillConfig, *, resume: bool = False,
            train_windows: list[list[int]] | None = None, teacher_cache: Path | None = None,
            progress: bool = True, on_step: Callable[[int, float], None] | None = None) -> DistillResult:
    """Train `student` (folder or 'first-layers:K') on `teacher_path`'s outputs; write the HF folder `out`
    (with cfg.lora_rank: a LoRA adapter of the student folder, which stays frozen, as a peft folder).

    train_windows default: `training_windows` (cfg.data: corpus train split or teacher chat replies).
    on_step(step, loss) is called after every optimizer step (tests use it to interrupt).
    """
    from tqdm.auto import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ckpt = out / CHECKPOINT_DIR / _STATE_FILE
    _check_out(out, ckpt, resume)
    if cfg.lora_rank and student.startswith("first-layers:"):
        raise ConfigError("--lora-rank trains an adapter of a base you serve: give the base's folder as STUDENT, "
                          "not first-layers:K (a cut model is a new base: distil it without --lora-rank)")
    out.mkdir(parents=True, exist_ok=True)
    student_path = prepare_student(teacher_path, student, out)
    teacher = load_causal_lm(teacher_path, train=False)
    model = load_causal_lm(student_path, train=True)
    if model.config.vocab_size != teacher.config.vocab_size:
        raise ConfigError(f"STUDENT: vocab {model.config.vocab_size} != teacher vocab {teacher.config.vocab_size}; "
                          "the student must share the teacher's tokenizer")
    if cfg.lora_rank:
        add_lora(model, cfg.lora_rank, cfg.alpha)
    else:
        _freeze_embeddings(model)
    if train_windows is None:
        train_windows = training_windows(teacher_path, cfg, out / CHECKPOINT_DIR, progress)
    cache = None
    if cfg.teacher_top_k:
        key = {"teacher": str(teacher_path.resolve()), "k": cfg.teacher_top_k, "windows": windows_digest(train_windows)}
        cache = teacher_topk_cache(teacher, train_windows, cfg.teacher_top_k,
                                   teacher_cache or out / CHECKPOINT_DIR / "teacher-topk.pt", key, progress)
    n_s, n_t = model.config.num_hidden_layers, teacher.config.num_hidden_layers
    s_store: list = []
    t_store: list = []
    hooks = []
    if cfg.hidden_loss_weight:
        hooks += _capture_layer_outputs(model, list(range(n_s)), s_store)
        hooks += _capture_layer_outputs(teacher, layer_map(student_path, n_s, n_t), t_store)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    start, losses = 0, []
    torch.manual_seed(cfg.seed)
    if resume and ckpt.is_file():
        start, losses = _load_checkpoint(ckpt, cfg, model, opt, sched)
    bar = tqdm(total=cfg.steps, initial=start, desc="distill", unit="step", disable=not progress)
    try:
        for step in range(start, cfg.steps):
            idx = batch_indices(step, cfg.batch_size, len(train_windows), cfg.seed)
            ids = torch.tensor([train_windows[i] for i in idx])
            s_store.clear()
            t_store.clear()
            logits = model(ids, use_cache=False).logits
            if cache is not None:
                loss = kd_loss_topk(logits, cache["values"][idx], cache["indices"][idx], cfg.temperature)
            else:
                with torch.no_grad():
                    t_logits = teacher(ids, use_cache=False).logits
                loss = kd_loss(logits, t_logits, cfg.temperature)
            if cfg.hidden_loss_weight:
                loss = loss + cfg.hidden_loss_weight * hidden_loss(s_store, t_store)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{sched.get_last_lr()[0]:.2e}")
            done = step + 1
            if done % cfg.checkpoint_every == 0 and done < cfg.steps:
                _save_checkpoint(ckpt, cfg, model, opt, sched, done, losses)
            if on_step is not None:
                on_step(done, losses[-1])
    finally:
        bar.close()
        for h in hooks:
            h.remove()
    _write_final(out, student_path, teacher_path, model, cfg, losses)
    shutil.rmtree(out / CHECKPOINT_DIR, ignore_errors=True)
    if student_path == out / STUDENT_INIT_DIR:
        shutil.rmtree(student_path, ignore_errors=True)
    return DistillResult(out, cfg.steps, losses, start)


def training_windows(teacher_path: Path, cfg: DistillConfig, work: Path, progress: bool = True) -> list[list[int]]:
    """The run's training windows for cfg.data (chat data cached in `work` for --resume)."""
    if cfg.data == "chat":
        return teacher_chat_windows(teacher_path, num_prompts=cfg.chat_prompts, max_tokens=cfg.chat_max_tokens,
                                    seq_len=cfg.seq_len, cache=work / "chat-data.json", threads=cfg.threads,
                                    progress=progress)
    return token_windows(load_tokenizer(teacher_path), "train", cfg.seq_len, max_windows=cfg.steps * cfg.batch_size)


def _check_out(out: Path, ckpt: Path, resume: bool) -> None:
    if resume and not ckpt.is_file():
        raise ConfigError(f"--resume: no checkpoint at {ckpt}; run without --resume to start")
    if not resume and out.exists():
        if ckpt.is_file():
            raise ConfigError(f"OUT: {str(out)!r} holds an unfinished run's checkpoint: pass --resume to continue "
                              "it, or choose a new OUT")
        if any(out.iterdir()):
            raise ConfigError(f"OUT: {str(out)!r} exists and is not empty; pass a new or empty folder")


def _save_checkpoint(path: Path, cfg: DistillConfig, model, opt, sched, step: int, losses: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_save({"step": step, "config": asdict(cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
                  "scheduler": sched.state_dict(), "rng": _rng_state(), "losses": losses}, path)


def _load_checkpoint(path: Path, cfg: DistillConfig, model, opt, sched) -> tuple[int, list[float]]:
    state = torch.load(path, weights_only=False)  # our own file: holds RNG tuples, not only tensors
    saved = {k: v for k, v in state["config"].items() if k != "threads"}
    now = {k: v for k, v in asdict(cfg).items() if k != "threads"}
    if saved != now:
        diff = {k: (saved.get(k), now[k]) for k in now if saved.get(k) != now[k]}
        raise ConfigError(f"--resume: the checkpoint was made with other settings {diff} (saved, given); "
                          "rerun with the same flags")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return state["step"], list(state["losses"])


def _write_final(out: Path, student_path: Path, teacher_path: Path, model, cfg: DistillConfig,
                 losses: list[float]) -> None:
    meta_src = student_path / META_FILE
    student_meta = json.loads(meta_src.read_text()) if meta_src.is_file() else {}
    meta = {"kind": "distill", "teacher": str(teacher_path), "student_init": student_meta.get("kind", "folder"),
            "teacher_layers": student_meta.get("teacher_layers"), "config": asdict(cfg),
            "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None}
    if cfg.lora_rank:
        save_adapter(model, out, student_path, cfg.lora_rank, cfg.alpha)
        (out / META_FILE).write_text(json.dumps({**meta, "kind": "distill-lora", "base": str(student_path)},
                                                indent=2) + "\n")
        return
    write_checkpoint(out, read_config(student_path), model.state_dict(), student_path, meta)
