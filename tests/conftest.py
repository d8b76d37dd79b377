"""Session-wide set-up shared by every test package."""

import pytest

from kiln.model import kernels, loader


def pytest_sessionstart(session) -> None:
    # Build the C++ kernels before any test runs: a background build finishing mid-test would switch
    # numerics between two runs that a test compares.
    kernels.load()


@pytest.fixture
def blocks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny GGUF would keep a dense copy beside its blocks (loader.DENSE_COPY_MAX_BYTES): hold only
    the blocks, as a real-size model does."""
    monkeypatch.setattr(loader, "DENSE_COPY_MAX_BYTES", 0)
