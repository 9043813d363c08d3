"""System programs some tests need (Debian's chromium, redis-server): found, or the test says why not.

``need(name, path, apt)``: outside CI a missing program skips the test with the reason (the
program and the ``apt-get install`` line that brings it); in CI (``$CI`` set and not ``0`` /
``false``, as ``.ci/run`` sets ``CI=true``) it fails: CI installs them, so missing is a defect.
"""

from __future__ import annotations

import os

import pytest

APT_LINE = "apt-get install -y python3-venv gcc libc6-dev redis-server chromium fonts-dejavu-core"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_message(name: str, package: str) -> str:
    return (f"{name} is not installed: this test runs a real {name} (apt-get install -y {package}; "
            f"everything the full suite needs: {APT_LINE})")


def need(name: str, path: str | None, package: str) -> str:
    """``path`` when the program is there; else skip (fail in CI) naming it and the install line."""
    if path and os.path.exists(path):
        return path
    message = missing_message(name, package)
    if in_ci():
        pytest.fail(message + "; CI requires it")
    pytest.skip(message)
