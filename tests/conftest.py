"""Fixtures shared across test modules."""

import pytest

from tests import warm


@pytest.fixture(scope="session")
def warm_server():
    """One warm interpreter that forks each Python command's processes (``tests/warm.py``);
    its commands run in :func:`tests.warm.command_env`, which it was started in (parallax reads
    some variables, ``PARALLAX_TIMEOUT_S``, at import)."""
    server = warm.Server(warm.command_env())
    yield server
    server.close()
