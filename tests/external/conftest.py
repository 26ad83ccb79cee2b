import pytest

from tests.external.servers import Hostile, TransformersServe, alive


@pytest.fixture(scope="session")
def served_tiny_ar():
    """The real `transformers serve` on models/tiny-ar for the whole session, stopped (process group and all) at
    its end, whatever the tests did."""
    server = TransformersServe()
    try:
        yield server
    finally:
        server.stop()
        assert not alive(server.process.pid)


@pytest.fixture
def hostile():
    server = Hostile()
    try:
        yield server
    finally:
        server.stop()
