"""Run the tensor tests on one torch thread, as the model tests do: the tiny layers and models
gain nothing from intra-op threads, and on a busy 2-core machine OpenMP workers waiting for a
core make them many times slower (the multi-rank workers already use one thread each)."""

import pytest

from parallax.testing import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield
