"""The test suite's own rules: every test has exactly one tier, and test modules import only tests/support/.

Tiers come from the fixtures a test uses (tests/conftest.py), so these checks hold for tests added later too.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "process", "e2e")


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    wrong = {item.nodeid: tiers for item in request.session.items
             if len(tiers := [t for t in TIERS if item.get_closest_marker(t) is not None]) != 1}
    assert wrong == {}


def test_the_tier_follows_the_fixtures(request: pytest.FixtureRequest) -> None:
    tiers = {item.nodeid.split("::")[-1]: [t for t in TIERS if item.get_closest_marker(t)]
             for item in request.session.items}
    assert tiers.get("test_the_tier_follows_the_fixtures", ["unit"]) == ["unit"]
    for name, tier in (("test_flows_under_prefect", "e2e"), ("test_help_lists_the_commands", "process")):
        assert tiers.get(name, [tier]) == [tier], name  # (absent when only some files are collected)


def _imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_no_test_module_imports_another_test_module_or_conftest() -> None:
    """Shared builders live in tests/support/ and fixtures in conftest.py: a test module imports neither another
    test module nor conftest, so each one can be moved, split or run alone."""
    local = {p.stem for p in TESTS.glob("*.py")}
    wrong = []
    for path in sorted([*TESTS.glob("*.py"), *TESTS.glob("support/*.py")]):
        for module in sorted(_imported_modules(path)):
            top = module.split(".")[0]
            if module.startswith(".") or top in local or top == "tests":
                wrong.append(f"{path.relative_to(TESTS)} imports {module}")
    assert wrong == []


def test_unit_tests_cannot_start_children() -> None:
    import subprocess
    import sys

    from _pytest.outcomes import Failed

    with pytest.raises(Failed, match="ask for the `children` fixture"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_under_xdist_a_test_runs_in_its_modules_group(request: pytest.FixtureRequest) -> None:
    """The suite's two workers take whole groups (tests/conftest.py); were grouping not in effect (as under pytest
    9.2 with xdist 3.8), node ids would carry no group and module fixtures would be rebuilt per test."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("not under pytest-xdist (-n 0)")
    assert request.node.nodeid.endswith("@tests/test_tiers.py"), request.node.nodeid
