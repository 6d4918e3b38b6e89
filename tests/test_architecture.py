"""The project's shape: imports run one way (import-linter's contracts in pyproject.toml, no cycles between the
modules of a package), and nothing outside the sandbox reaches into the env's controller."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sandbox", "textworld_env", "agent", "reward_engine", "distill", "sft", "rl", "evaluation", "pipeline")
# lint-imports on the pyproject.toml of the working directory, whose packages come first on the path
LINT = ("import sys; sys.path.insert(0, '.'); from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(no_cache=True, no_logo=True))")


def test_imports_follow_the_layers_and_no_package_has_a_cycle():
    """`lint-imports` with the contracts of pyproject.toml: sandbox -> agent -> reward_engine -> the stages ->
    pipeline, and acyclic modules within each package."""
    r = subprocess.run([sys.executable, "-c", LINT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout


def test_the_linter_catches_an_import_against_the_layers(tmp_path):
    """The contract is not vacuous: a sandbox module importing the agent package breaks it."""
    import shutil
    copy = tmp_path / "project"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__", "data", "scenes"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    with open(copy / "sandbox" / "skills.py", "a") as f:
        f.write("\nfrom agent.parser import parse_action  # noqa: E402,F401\n")
    r = subprocess.run([sys.executable, "-c", LINT], cwd=copy, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "sandbox.skills -> agent.parser" in r.stdout, r.stdout[-3000:]


def test_nothing_outside_the_sandbox_reaches_into_the_controller():
    """The env is the contract: `reset`/`step` return in `info` what the loop, the judges and the prompt builder
    need, so no module outside `sandbox/` (tests aside) touches `env.ctrl`."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("sandbox", "tests", ".venv", "build") or ".venv" in rel.parts:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\.ctrl\b", line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
