"""The packages depend on each other in one direction: a request crosses each boundary once.

eaglectl (the CLI) -> deploy, bench, jobs -> cluster -> eagle_worker. The engine imports nothing
from the fleet, jobs, CLI or benchmarks, and the fleet reaches it only through its contract
(`eagle_worker.engine_api`); nothing but the CLI imports the CLI.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("eagle_worker", "cluster", "jobs", "deploy", "bench", "eaglectl")
ALLOWED = {                  # package -> what it may import from the others (a package, or one module)
    "eagle_worker": set(),
    "cluster": {"eagle_worker.engine_api"},
    "jobs": {"cluster", "eagle_worker.engine_api"},
    "deploy": {"cluster", "jobs"},
    "bench": {"eagle_worker", "cluster", "jobs"},
    "eaglectl": {"eagle_worker", "cluster", "jobs", "deploy", "bench"},
}


def imports_of(package: str) -> list[tuple[str, str]]:
    """(file, imported module) for every absolute import of another package, at any depth."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [(str(path.relative_to(ROOT)), n) for n in names
                      if n.split(".")[0] in PACKAGES and n.split(".")[0] != package]
    return found


def allowed(package: str, module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in ALLOWED[package])


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layering(package):
    bad = [(f, m) for f, m in imports_of(package) if not allowed(package, m)]
    assert not bad, f"{package} may import only {sorted(ALLOWED[package])}: {bad}"


def test_the_check_sees_imports_inside_functions():
    """Heavy imports live inside functions; the check must still see them."""
    assert ("eaglectl/main.py", "eaglectl.jobs") not in imports_of("eaglectl")     # own package: not listed
    assert any(m.startswith("eagle_worker") for _, m in imports_of("bench"))
