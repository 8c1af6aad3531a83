"""The docs: generated references fresh, README a front page, every relative link resolving,
the layout pages naming what the repository holds, the site building under --strict."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
BENCH_README = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_URL = DOCS / "assets" / "results"  # scripts/mkdocs_hooks.py serves benchmarks/results/*.png here

# Development-log narrative ("session 12", "in the last session") has no place in the docs.
NARRATIVE = re.compile(r"\bsessions? ?#?\d+\b|\b(this|that|last|previous|next|earlier|later|one) session\b",
                       re.IGNORECASE)


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc_files() -> list[Path]:
    return [README, BENCH_README, ROOT / "deploy" / "README.md", ROOT / "helm" / "kvmesh" / "README.md",
            *sorted(DOCS.rglob("*.md"))]


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code (links inside them are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _links(text: str) -> list[str]:
    return re.findall(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(text))


def _slug(heading: str) -> str:
    """mkdocs' (Python-Markdown toc) and GitHub's anchor of a heading, for the headings used here."""
    text = re.sub(r"`", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r"[\s]+", "-", text).strip("-")


def _anchors(path: Path) -> set[str]:
    out = set()
    for line in _prose_keep_headings(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if not m:
            continue
        title = m.group(1)
        explicit = re.search(r"\{#([\w-]+)\}\s*$", title)
        if explicit:
            out.add(explicit.group(1))
            title = title[:explicit.start()]
        out.add(_slug(title))
    return out


def _prose_keep_headings(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def test_generated_references_are_fresh():
    stale = _gen_docs().stale_pages()
    assert not stale, ("stale generated docs (run python3 scripts/gen_docs.py): "
                       + ", ".join(str(p.relative_to(ROOT)) for p in stale))


def test_readme_is_a_front_page():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move detail into docs/ (<= 220)"
    assert not re.search(r"\bsessions?\b", text, re.IGNORECASE), "README.md: no development-session narrative"
    # The two commands of the quickstart, as .ci/run runs them.
    assert "./scripts/install.sh && kvmesh serve" in text
    assert "python3 -m pytest -q" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/install.sh" in ci and "python3 -m pytest -q" in ci


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_session_narrative(path: Path):
    found = NARRATIVE.findall(path.read_text())
    assert not found, f"{path.relative_to(ROOT)}: development-log narrative {found}"


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for link in _links(path.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.IGNORECASE):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        dest = path if not target else (path.parent / target).resolve()
        if RESULTS_URL in dest.parents or dest == RESULTS_URL:
            dest = RESULTS / dest.relative_to(RESULTS_URL)
        if not dest.exists():
            broken.append(f"{link} (no {dest.relative_to(ROOT) if ROOT in dest.parents else dest})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{link} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: " + "; ".join(broken)


def _benchmark_scripts() -> list[str]:
    return sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def test_layout_lists_every_package_and_benchmark():
    arch = (DOCS / "architecture.md").read_text()
    packages = sorted(p.parent.name for p in (ROOT / "platform" / "kvmesh").glob("*/__init__.py"))
    missing = [f"{name}/" for name in packages if f"{name}/" not in arch]
    assert not missing, f"docs/architecture.md layout lacks {missing}"
    for page in (DOCS / "architecture.md", BENCH_README):
        text = page.read_text()
        absent = [s for s in _benchmark_scripts() if s not in text]
        assert not absent, f"{page.relative_to(ROOT)} does not list {absent}"
    readme = README.read_text()
    absent = [s for s in _benchmark_scripts() if s.removesuffix(".py") not in readme]
    assert not absent, f"README.md layout does not list {absent}"
    assert "sim/" in readme


def _nav_files(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [f for item in node for f in _nav_files(item)]
    if isinstance(node, dict):
        return [f for value in node.values() for f in _nav_files(value)]
    return []


def test_nav_covers_every_page():
    loader = yaml.SafeLoader
    loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=loader)  # noqa: S506 (SafeLoader)
    nav = set(_nav_files(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert nav - pages == set(), f"nav names missing pages: {sorted(nav - pages)}"
    assert pages - nav == set(), f"pages not in the nav: {sorted(pages - nav)}"
    assert {"guides/bench.md", "guides/observability.md"} <= nav


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason="mkdocs / mkdocs-material not installed (.ci/run installs them)")
def test_site_builds_strict(tmp_path: Path):
    assert shutil.which(sys.executable)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "assets" / "results").is_dir()
