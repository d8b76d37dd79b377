"""Session-wide set-up shared by every test package."""

from kiln.model import kernels


def pytest_sessionstart(session) -> None:
    # Build the C++ kernels before any test runs: a background build finishing mid-test would switch
    # numerics between two runs that a test compares.
    kernels.load()
