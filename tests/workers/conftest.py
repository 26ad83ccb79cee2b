"""One real local Ray for the worker tests: 2 logical CPUs, the object store capped, its own temp dir; after the
session no process of it may remain."""

import os
from pathlib import Path

import pytest


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile
    return found


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    from dllm_rl.workers.ray_pool import start_ray, stop_ray

    temp = tmp_path_factory.mktemp("ray")
    start_ray(num_cpus=2, object_store_mb=128, temp_dir=str(temp))
    yield temp
    stop_ray()
    left = processes_mentioning(str(temp))
    assert not left, f"Ray processes left after ray.shutdown(): {left}"
