"""The compiled kernels for the kernel tests (skipped, with the reason, where they cannot run)."""

from __future__ import annotations

import pytest

from eyas import kernels


@pytest.fixture(scope="module")
def k():
    compiled = kernels.load()
    if compiled is None:
        pytest.skip(f"Eyas's CPU kernels do not run here: {kernels.why_not()}")
    return compiled
