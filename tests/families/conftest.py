"""Run the model tests on one torch thread: the tiny models gain nothing from intra-op threads,
and on a busy 2-core CI machine OpenMP workers waiting for a core make them many times slower
(the multi-rank workers already use one thread each)."""

import pytest

from parallax.testing import one_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield
