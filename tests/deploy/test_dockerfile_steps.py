"""The images' Dockerfiles, built without Docker: parse deploy/Dockerfile and
deploy/Dockerfile.operator, replay their steps into a temporary root (ARG / ENV / WORKDIR /
COPY, and every RUN in /bin/sh, in a fresh virtual environment standing in for the image's),
then start what they built.

What the replay leaves out, and why:
- `FROM` and `COPY --from`: every stage shares one root here, so a later stage's copy of an
  earlier one's folder is already in place.
- deploy/image/system-packages.sh (apt-get, useradd): it changes the host, not the root. The
  host has what it installs (g++); the runtime stage's libraries are checked against the
  kernels' ELF dependencies instead.
- The runtime image's venv is made with --system-site-packages, so torch, Ray and the other
  multi-GB wheels already installed here satisfy install-runtime.sh and only kvmesh itself is
  built and installed (a full install is minutes of unpacking on 2 cores). The operator
  image's venv is clean: that is the test that it needs no torch.
- The runtime build bakes the kernels for one tier (KERNEL_ISAS=avx2, a build is ~1-2 min on
  2 cores) instead of every tier the machine runs; an AVX-512 machine then loading that AVX2
  build shows a pod on a wider CPU uses a narrower baked build instead of compiling.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from kernel_checks import INT8_KV_CHECK

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "deploy" / "Dockerfile"
OPERATOR = REPO / "deploy" / "Dockerfile.operator"
# Host variables that would leak the test's own environment into the image's.
_HOST_ONLY = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR", "CXX")


def parse(path: Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of (INSTRUCTION, arguments); continuations joined,
    comments dropped. Instructions before the first FROM form stage 0 (global ARGs)."""
    stages: list[list[tuple[str, str]]] = [[]]
    logical = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        logical += line.rstrip()
        if logical.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        op, _, rest = logical.strip().partition(" ")
        logical = ""
        if op.upper() == "FROM":
            stages.append([])
        stages[-1].append((op.upper(), rest.strip()))
    return stages


def _pairs(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in shlex.split(text))


@dataclass
class Replay:
    """Replays Dockerfile stages into `root`: image paths (/opt, /src, /home, /usr) map under it."""

    root: Path
    build_args: dict[str, str] = field(default_factory=dict)
    rewrite: dict[str, str] = field(default_factory=dict)  # RUN text -> the text run here
    env: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    entrypoint: list[str] | None = None

    def __post_init__(self):
        bin_dir = self.root / "usr" / "local" / "bin"  # the base image's python
        bin_dir.mkdir(parents=True)
        for name in ("python", "python3"):
            (bin_dir / name).symlink_to(sys._base_executable)
        host = {k: v for k, v in os.environ.items() if k not in _HOST_ONLY and not k.startswith("KVMESH_")}
        self.base_env = {**host, "PATH": f"{bin_dir}:{host['PATH']}"}
        self.cwd = self.root

    def at(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/") if image_path.startswith("/") else self.cwd / image_path

    def _expand(self, text: str, scope: dict[str, str]) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: scope.get(m[1] or m[2], ""), text)

    def stage(self, instructions: list[tuple[str, str]]) -> None:
        args: dict[str, str] = {}
        self.env = dict(self.base_env)
        for op, rest in instructions:
            scope = {**args, **self.env}
            if op == "ARG":
                name, _, default = rest.partition("=")
                args[name] = self.build_args.get(name, self._expand(default, scope))
            elif op == "ENV":
                for key, literal in _pairs(rest).items():
                    # Image paths map under the root before expansion, so $PATH's host paths stay.
                    mapped = ":".join(str(self.at(s)) if s.startswith("/") else s for s in literal.split(":"))
                    self.env[key] = self._expand(mapped, {**args, **self.env})
            elif op == "WORKDIR":
                self.cwd = self.at(rest)
                self.cwd.mkdir(parents=True, exist_ok=True)
            elif op == "COPY":
                self._copy(shlex.split(rest))
            elif op == "RUN":
                self._run(rest, {**self.env, **args})
            elif op == "LABEL":
                self.labels.update({k: self._expand(v, scope) for k, v in _pairs(rest).items()})
            elif op == "USER":
                self.user = rest
            elif op == "ENTRYPOINT":
                self.entrypoint = json.loads(rest)

    def _copy(self, words: list[str]) -> None:
        if any(w.startswith("--from=") for w in words):
            self.skipped.append("COPY " + " ".join(words))
            return
        *srcs, dest = [w for w in words if not w.startswith("--")]
        target = self.at(dest)
        for src in srcs:
            path = REPO / src
            if path.is_dir():
                shutil.copytree(path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into = dest.endswith("/") or len(srcs) > 1 or target.is_dir()
                (target if into else target.parent).mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name if into else target)

    def _run(self, command: str, env: dict[str, str]) -> None:
        assert not re.search(r"(^|\s)/(opt|src|home)\b", command), f"RUN names an image path; use ENV: {command}"
        if "system-packages" in command:
            self.skipped.append("RUN " + command)
            return
        for old, new in self.rewrite.items():
            command = command.replace(old, new)
        done = subprocess.run(["/bin/sh", "-c", command], cwd=self.cwd, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"RUN {command} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"


def _arg_default(stages, name: str) -> str:
    for stage in stages:
        for op, rest in stage:
            if op == "ARG" and rest.startswith(f"{name}="):
                return rest.split("=", 1)[1]
    raise AssertionError(f"no ARG {name}")


@pytest.mark.parametrize("dockerfile", [RUNTIME, OPERATOR], ids=["runtime", "operator"])
def test_dockerfile_labels_pins_and_non_root_user(dockerfile, tmp_path):
    """Both images: OCI labels, the project's version, a numeric non-root USER (what the
    restricted Pod Security profile checks), and the versions the chart and CI pin."""
    stages = parse(dockerfile)
    final = stages[-1]
    assert len(stages) == 3 and stages[1][0] == ("FROM", "python:${PYTHON_VERSION}-slim AS build")
    replay = Replay(tmp_path)
    replay.stage([i for i in final if i[0] in ("ARG", "LABEL", "USER")])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((REPO / "helm" / "kvmesh" / "Chart.yaml").read_text())
    for key in ("title", "description", "version", "revision", "source", "licenses"):
        assert replay.labels.get(f"org.opencontainers.image.{key}"), key
    assert replay.labels["org.opencontainers.image.version"] == version == chart["appVersion"]
    assert replay.labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    uid, _, gid = replay.user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0
    assert subprocess.run(["bash", "-n", *map(str, (REPO / "deploy" / "image").glob("*.sh"))]).returncode == 0
    values = yaml.safe_load((REPO / "helm" / "kvmesh" / "values.yaml").read_text())
    # The tag the header's build command gives is the chart's default for that image.
    repo = values["runtimeImage" if dockerfile == RUNTIME else "image"]["repository"]
    assert f"-t {repo}:{version} ." in dockerfile.read_text()
    if dockerfile == RUNTIME:
        assert _arg_default(stages, "RAY_VERSION") == values["rayVersion"]
        assert f'"torch=={_arg_default(stages, "TORCH_VERSION")}"' in (REPO / "scripts" / "install.sh").read_text()


def _distributions(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                          "print('\\n'.join(d.metadata['Name'].lower() for d in m.distributions()))"],
                         capture_output=True, text=True, check=True, cwd="/")
    return set(out.stdout.split())


def test_operator_dockerfile_steps_build_a_torch_free_operator(tmp_path):
    """A clean venv gets the operator extra and kvmesh --no-deps; the entry point then runs, and
    the CRD it generates is the chart's, with no torch, Ray or gRPC installed at all."""
    replay = Replay(tmp_path)
    for stage in parse(OPERATOR)[1:]:
        replay.stage(stage)
    venv = Path(replay.env["KVMESH_VENV"])
    assert venv.is_relative_to(tmp_path)
    installed = _distributions(venv / "bin" / "python")
    assert {"kvmesh", "kopf", "kubernetes_asyncio", "pydantic"} <= installed
    assert not installed & {"torch", "ray", "grpcio", "numpy", "transformers", "triton"}, installed
    env = {**replay.env, "PATH": f"{venv}/bin:/usr/bin:/bin"}
    entry = subprocess.run([*replay.entrypoint, "--help"], env=env, capture_output=True, text=True, cwd="/")
    assert entry.returncode == 0 and "--all-namespaces" in entry.stdout, entry.stderr
    crd = subprocess.run(["python", "-c", "import sys, runpy; runpy.run_module('kvmesh_operator.crd', "
                          "run_name='__main__'); assert 'torch' not in sys.modules"],
                         env=env, capture_output=True, text=True, cwd="/")
    assert crd.returncode == 0, crd.stderr
    assert yaml.safe_load(crd.stdout) == yaml.safe_load((REPO / "helm/kvmesh/crds/llmservices.yaml").read_text())


_START = """
import contextlib, io, json
import kvmesh
from kvmesh.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["generate", "--max-tokens", "6", "--threads", "2", "The capital of France is"])
from kvmesh.layers import native
print(json.dumps({"rc": rc, "text": out.getvalue(), "native": native._loaded, "compiler": native._compiler(),
                  "kvmesh": kvmesh.__file__}))
"""


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_runtime_dockerfile_steps_bake_model_and_kernels_and_start_from_them(tmp_path):
    """install-runtime.sh and warm-runtime.sh as the Dockerfile runs them; then kvmesh, with no
    compiler on PATH, generates from the baked model and kernels, the baked kernels' int8 KV
    paths equal PyTorch's, and nothing is written to the cache."""
    if "avx2" not in (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""):
        pytest.skip("the baked kernel tier here is avx2; this CPU has no AVX2")
    replay = Replay(tmp_path, build_args={"TORCH_INDEX": "", "KERNEL_ISAS": "avx2"},
                    rewrite={"python -m venv": "python -m venv --system-site-packages"})
    build, final = parse(RUNTIME)[1:]
    replay.stage(build)
    cache, ext = Path(replay.env["KVMESH_CACHE_DIR"]), Path(replay.env["TORCH_EXTENSIONS_DIR"])
    assert cache.is_relative_to(tmp_path) and ext.is_relative_to(cache)
    assert (cache / "models" / "SmolLM2-135M-Instruct-f32" / ".complete").is_file()
    [lib] = ext.glob("kvmesh_cpu_kernels_avx2_portable_*/*.so")
    assert json.loads((lib.parent / "kvmesh_build.json").read_text())["flags"][1] == "-march=x86-64-v3"
    # The runtime stage has no compiler: every system library the kernels link must be one it
    # has (python:slim carries libstdc++ / libgcc_s / libc; system-packages.sh adds libgomp1).
    needed = re.findall(r"\(NEEDED\).*\[(.+)\]", subprocess.run(["readelf", "-d", str(lib)], capture_output=True,
                                                                 text=True, check=True).stdout)
    system = {n for n in needed if not n.startswith(("libc10", "libtorch"))}
    assert system <= {"libstdc++.so.6", "libm.so.6", "libgomp.so.1", "libgcc_s.so.1", "libc.so.6",
                      "ld-linux-x86-64.so.2"}, system
    assert "libgomp1" in (REPO / "deploy" / "image" / "system-packages.sh").read_text()

    replay.stage(final)
    venv = Path(replay.env["KVMESH_VENV"])
    assert replay.user == "1000:1000" and replay.cwd == tmp_path / "home" / "ray"
    before = _snapshot(cache)
    env = {**replay.env, "PATH": f"{venv}/bin"}  # no compiler, no ninja
    done = subprocess.run([str(venv / "bin" / "python"), "-c", _START], env=env, cwd=replay.cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    started = json.loads(done.stdout.strip().splitlines()[-1])
    assert started["rc"] == 0 and "Paris" in started["text"], started
    assert started["compiler"] is None and started["native"]["ok"] and started["native"]["isa"] == "avx2", started
    assert Path(started["kvmesh"]).is_relative_to(venv)
    # The baked AVX2 build runs the int8 KV kernels as the default build does (on an AVX-512
    # CPU the default takes 16-lane loads; this is the suite's one AVX2 build).
    int8 = subprocess.run([str(venv / "bin" / "python"), "-c", INT8_KV_CHECK], env=env, cwd=replay.cwd,
                          capture_output=True, text=True, timeout=300)
    assert int8.returncode == 0 and int8.stdout.strip().endswith("ok"), int8.stderr[-3000:]
    assert _snapshot(cache) == before  # read-only is enough: a pod may mount it so
