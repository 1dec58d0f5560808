"""benchmarks/ keeps its layout (benchmarks/README.md): every script in a group named by what it measures,
run as `python -m benchmarks.<group>.<script>` with no `sys.path` edits and no import of `tests/`, results
under `results/<group>/`, and every benchmark path the README, docs/ and the code's comments quote still there."""

from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
GROUPS = ("engine", "actor", "runner", "learning", "retrieval", "robustness", "device")
# Quoted as what a script will write once it runs; each must still be missing (remove it when it lands).
NOT_RUN_YET = {
    "benchmarks/results/learning/learning_parity_h200.json",  # README / docs/LEARNING.md: "not run yet"
    "benchmarks/results/engine/engines_h200.json",  # README, Rollout backends: "not measured yet"
}
QUOTED = re.compile(r"benchmarks/[A-Za-z0-9_.*{},/-]+")
MODULE = re.compile(r"-m (benchmarks(?:\.\w+)+)")


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.parts)


def docs() -> list[Path]:
    readmes = [p for p in BENCH.rglob("*.md") if "results" not in p.relative_to(BENCH).parts]
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(readmes)]


def test_every_script_sits_in_a_group_with_its_readme_line():
    top = {p.name for p in BENCH.iterdir()} - {"__pycache__"}
    assert top == {"__init__.py", "README.md", "results", *GROUPS}, "benchmarks/ holds only the groups"
    for group in GROUPS:
        assert (BENCH / group / "__init__.py").is_file() and (BENCH / group / "README.md").is_file(), group
    for script in scripts():
        relative = script.relative_to(BENCH)
        if script.name == "__init__.py":
            continue
        assert len(relative.parts) == 2 and relative.parts[0] in GROUPS, f"{relative} is in no group"
        readme = (script.parent / "README.md").read_text()
        assert f"- `{script.name}`:" in readme, f"{relative} has no line in {script.parent.name}/README.md"


def test_results_sit_under_their_group():
    for entry in (BENCH / "results").iterdir():
        if entry.is_dir():
            assert entry.name in GROUPS, f"results/{entry.name}: results go under results/<group>/"
        else:  # the logs of tests/gpu on an H100 or H200, which no benchmark writes
            assert re.fullmatch(r"gpu_tests_h[12]00\w*\.log", entry.name), (
                f"results/{entry.name}: not in a group"
            )


def offences(path: Path) -> list[str]:
    """Imports of `tests`, `sys.path` edits, and imports of a benchmark module by its bare name."""
    source = path.read_text()
    bare = {p.stem for p in BENCH.rglob("*.py") if p.name != "__init__.py"}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["." * node.level + (node.module or "")]
        elif isinstance(node, ast.Attribute) and node.attr == "path":
            if isinstance(node.value, ast.Name) and node.value.id == "sys":
                found.append(f"line {node.lineno}: sys.path")
            continue
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.search(r"\b(from|import) tests\b", node.value):  # code run in a child process
                found.append(f"line {node.lineno}: a child imports tests")
            continue
        else:
            continue
        for name in names:
            head = name.split(".")[0]
            if head == "tests" or name.startswith(".") or head in bare:
                found.append(f"line {node.lineno}: import {name} (use benchmarks.<group>.<module>)")
    return found


@pytest.mark.parametrize("path", [p for p in scripts() if p.suffix == ".py"], ids=lambda p: p.stem)
def test_no_benchmark_imports_tests_or_edits_sys_path(path):
    assert offences(path) == [], path.relative_to(ROOT)


def test_the_import_check_catches_each_offence(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nsys.path.insert(0, '.')\nfrom tests.tiny_models import make_tiny_model_dir\n"
        "from model_shapes import TINY\nfrom . import runs\nCODE = 'from tests.integration import x'\n"
    )
    assert len(offences(bad)) == 5


def missing(text: str) -> list[str]:
    """Quoted benchmark paths (results, scripts, `-m` modules) that are not in the tree."""
    gone = []
    for match in QUOTED.finditer(text):
        quoted = match.group(0).rstrip(".,")
        if text[match.end() : match.end() + 1] == "<" or quoted in NOT_RUN_YET:
            continue  # a placeholder (`results/<group>/`), or a result still to come
        braces = re.fullmatch(r"(.*)\{(.*)\}(.*)", quoted)
        paths = [braces[1] + part + braces[3] for part in braces[2].split(",")] if braces else [quoted]
        gone += [path for path in paths if not glob.glob(str(ROOT / path))]
    for match in MODULE.finditer(text):
        if not (ROOT / (match.group(1).replace(".", "/") + ".py")).is_file():
            gone.append(match.group(1))
    return gone


@pytest.mark.parametrize("doc", docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_benchmark_path_exists(doc):
    assert missing(doc.read_text()) == [], doc.relative_to(ROOT)


def sources() -> list[Path]:
    """Code and configs whose comments point into benchmarks/ (the scripts themselves name results they
    have yet to write, and this file quotes paths that are gone on purpose)."""
    code = [*(ROOT / "tandemrl").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    examples = [p for p in (ROOT / "examples").rglob("*") if p.suffix in (".py", ".yaml", ".sh", ".md")]
    return sorted(
        p
        for p in [*code, *examples, ROOT / "Makefile", ROOT / "pyproject.toml"]
        if p != Path(__file__).resolve()
    )


def test_every_benchmark_path_quoted_in_code_exists():
    gone = {str(p.relative_to(ROOT)): missing(p.read_text()) for p in sources()}
    assert {path: paths for path, paths in gone.items() if paths} == {}


def test_the_path_check_finds_what_is_gone():
    text = (
        "`benchmarks/results/runner/colocated_cpu_prefill_{retract,gone}.json`, "
        "[x](benchmarks/results/engine/engine.json), `benchmarks/sync_vs_async.py`, "
        "`python -m benchmarks.runner.sync_vs_async`, `python -m benchmarks.sync_vs_async`"
    )
    assert missing(text) == [
        "benchmarks/results/runner/colocated_cpu_prefill_gone.json",
        "benchmarks/sync_vs_async.py",
        "benchmarks.sync_vs_async",
    ]


def test_not_run_yet_results_are_still_missing():
    """Once a result lands, it leaves NOT_RUN_YET and the check above covers it."""
    assert [path for path in NOT_RUN_YET if (ROOT / path).exists()] == []
