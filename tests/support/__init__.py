"""Builders and helpers shared by the tests: plain functions and classes, no fixtures and no tests.

Fixtures live in tests/conftest.py and tests/support/fixtures.py (registered by conftest's `pytest_plugins`);
test modules import from here, never from each other or from conftest (tests/test_tiers.py checks it).
"""
