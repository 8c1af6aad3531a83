"""layers/native.py's build targets: KVMESH_CPU_MARCH=portable fixes each tier's x86-64 level
(what an image bakes), and a build's marker decides whether a later process may load it
without compiling. The bake itself (compile, then start from it) is
tests/deploy/test_dockerfile_steps.py."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.cli import main
from kvmesh.errors import KVMeshError
from kvmesh.layers import native


def test_portable_builds_name_and_fix_their_level_per_tier():
    names = set()
    for tier, level in (("avx512", "-march=x86-64-v4"), ("avx2", "-march=x86-64-v3")):
        name, flags = native._target(tier, "portable")
        assert level in flags and "-march=native" not in flags and f"_{tier}_portable_" in name
        names |= {name, native._target(tier, "native")[0]}
    assert len(names) == 4  # one name, one set of flags: a native build never passes for a portable one
    name, flags = native._target("generic", "portable")
    assert not [f for f in flags if f.startswith("-march")]  # the compiler's baseline, on any architecture
    assert "-mno-avx512f" in native._target("avx2", "native")[1]


def test_march_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert native.march() == "native"
    monkeypatch.setenv(native.MARCH_ENV, "portable")
    assert native.march() == "portable"
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    with pytest.raises(KVMeshError, match="KVMESH_CPU_MARCH='x86-64-v3': use native .* or portable"):
        native.march()


def test_a_build_loads_without_compiling_only_when_its_marker_matches(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, flags = native._target("avx2", "portable")
    lib = native._library(name)
    assert not native._load_prebuilt("avx2", "portable")  # nothing built
    lib.write_bytes(b"")
    (lib.parent / native.MARKER).write_text(json.dumps({"torch": "0.0.1", "flags": flags}))
    assert not native._load_prebuilt("avx2", "portable")  # another torch's build: its ABI may differ
    (lib.parent / native.MARKER).write_text(json.dumps({"torch": torch.__version__, "flags": flags[:-1]}))
    assert not native._load_prebuilt("avx2", "portable")  # other flags


def test_tiers_a_cpu_runs_and_prebuild_refuses_the_others(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert native.runnable_tiers() == ("avx2", "generic")
    with pytest.raises(KVMeshError, match="cannot run the avx512 build"):
        native.prebuild("avx512")
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx512f", "avx2", "fma", "f16c"}))
    assert native.runnable_tiers() == ("avx512", "avx2", "generic")


def test_warm_refuses_what_it_cannot_build_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(native, "prebuild", lambda tier: pytest.fail("nothing may be built"))
    assert main(["warm", "--isa", "avx512"]) == 2
    assert "--isa avx512: this CPU runs avx2, generic" in capsys.readouterr().err
    assert main(["warm", "--model", "gpt-9", "--no-kernels"]) == 2
    assert "'gpt-9': not a packaged model" in capsys.readouterr().err
