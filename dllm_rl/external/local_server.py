"""Start and stop a local OpenAI-compatible server on a model directory, for the served external source's tests
and benchmarks (and for trying `external=openai` on a laptop): `transformers serve`, or vLLM from its own
environment. Each runs on a free loopback port in its own process group; `stop` ends the whole group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Served:
    """An OpenAI-compatible server process on a free loopback port, in its own process group, ready when its
    `/health` answers; `stop` ends the group."""

    gives_logprobs = False

    def __init__(self, command: list[str], model: str, env: dict[str, str], ready_s: float):
        self.model = model
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = tempfile.TemporaryFile()  # its output, shown where it fails to start
        self.process = subprocess.Popen(command, stdout=self.log, stderr=self.log, env={**os.environ, **env},
                                        start_new_session=True)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {self.process.returncode} before it was ready:\n"
                                   f"{self.output()[-3000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{' '.join(command[:3])} was not ready within {ready_s} s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


class TransformersServe(Served):
    """`transformers serve <model>` (the `[serving]` extra of the project's own transformers)."""

    def __init__(self, model: Path | str, ready_s: float = 120.0):
        self.port = free_port()
        cli = Path(sys.executable).with_name("transformers")
        super().__init__([str(cli), "serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port",
                          str(self.port)], str(model), {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}, ready_s)


VLLM_PYTHON = "DLLM_RL_VLLM_PYTHON"


class VLLMServe(Served):
    """vLLM's OpenAI server in its own environment (its python named by $DLLM_RL_VLLM_PYTHON; docs/external.md
    says how to make the CPU build's): float32, eager, a `max_model_len` context (tiny-ar has 256 positions), 1 GiB
    of KV cache on a CPU."""

    gives_logprobs = True

    def __init__(self, model: Path | str, ready_s: float = 300.0, max_model_len: int = 256):
        self.port = free_port()
        super().__init__([os.environ[VLLM_PYTHON], "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                          "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len),
                          "--host", "127.0.0.1", "--port", str(self.port)], str(model),
                         {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}, ready_s)
