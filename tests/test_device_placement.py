"""Every tensor the package makes names its device, so a missed placement fails here on a CPU-only machine
before anyone has a GPU (the rule and its CPU-side exceptions: dllm_rl/device.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dllm_rl.device import default_device, device_of, resolve_device
from dllm_rl.errors import ConfigError
from dllm_rl.precision import resolve_bf16

PACKAGE = Path(__file__).resolve().parents[1] / "dllm_rl"

# torch functions that make a tensor (or a generator) on the default device unless told otherwise; the
# `*_like` and `Tensor.new_*` forms inherit their argument's device and are fine.
FACTORIES = {"zeros", "ones", "full", "empty", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
             "randperm", "linspace", "logspace", "eye", "Generator", "from_numpy", "normal", "bernoulli"}
MARK = "# cpu:"


def unplaced_calls(source: str, filename: str = "<snippet>") -> list[str]:
    """'file:line torch.name(...)' for each factory call that names no device and is not marked `# cpu: why`
    (on its own lines, or in a comment line right above it)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg == "device" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
               for k in node.keywords):  # device=None is the default device: not a placement
            continue
        nearby = lines[node.lineno - 1: node.end_lineno]
        above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
        nearby += [above] if above.startswith("#") else []
        if any(MARK in line and line.split(MARK, 1)[1].strip() for line in nearby):
            continue
        found.append(f"{filename}:{node.lineno} torch.{node.func.attr}(...)")
    return found


def test_every_tensor_factory_in_the_package_names_its_device():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 40
    missed = [hit for f in files for hit in unplaced_calls(f.read_text(), str(f.relative_to(PACKAGE.parent)))]
    assert not missed, ("tensors made without naming a device (add device=..., or mark a deliberate CPU tensor "
                        "with '# cpu: <why>'):\n" + "\n".join(missed))


def test_the_checker_catches_an_unplaced_tensor_and_accepts_the_two_ways_out():
    snippet = (
        "import torch\n"
        "a = torch.zeros(3)\n"                          # flagged
        "b = torch.zeros(3, device=x.device)\n"         # placed
        "# cpu: read back into Python at once\n"
        "c = torch.tensor([1, 2])\n"                    # marked on the line above
        "d = torch.arange(4)  # cpu: a plan\n"          # marked on its line
        "e = torch.randperm(4)  # cpu:\n"               # a mark without a reason does not count
        "f = torch.zeros_like(b)\n"                     # inherits b's device
        "g = torch.Generator()\n"                       # flagged
        "h = torch.ones(2, device=None)\n"              # flagged: None is the default device
    )
    assert [hit.split()[0] for hit in unplaced_calls(snippet)] == ["<snippet>:2", "<snippet>:7", "<snippet>:9",
                                                                  "<snippet>:10"]


def test_every_cpu_mark_says_why():
    for file in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if MARK in line:
                assert len(line.split(MARK, 1)[1].strip()) >= 10, f"{file}:{number}: '# cpu:' needs a reason"


def test_device_options_resolve_or_name_the_bad_value(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="device='gpu0': expected auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")
    with pytest.raises(ConfigError, match="device='mps'"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device='cuda:0', but torch finds no CUDA GPU"):
            resolve_device("cuda:0")
        assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # keeps a process on the CPU even where there is a GPU
    assert default_device() == torch.device("cpu")


def test_bf16_auto_asks_the_device_it_runs_on(monkeypatch):
    from dllm_rl import precision

    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_bf16("auto", "cpu") is True
    assert resolve_bf16("auto", torch.device("cuda", 0)) is False  # the GPU's answer, not the CPU's
    assert resolve_bf16(True, "cuda") is True


def test_device_of_looks_through_policies_wrappers_and_engines():
    from dllm_rl.policy.adapters import DiffusionPolicy
    from dllm_rl.policy.lora import AdapterOff

    net = torch.nn.Linear(2, 2)
    assert device_of(net) == torch.device("cpu")
    assert DiffusionPolicy(net, "native", mask_id=0).device == torch.device("cpu")

    class Engine(torch.nn.Module):  # DeepSpeed's engine names its device
        device = torch.device("meta")

    assert device_of(DiffusionPolicy(Engine(), "native", mask_id=0)) == torch.device("meta")
    assert device_of(AdapterOff(net)) == torch.device("cpu")
    assert device_of(torch.nn.Linear(2, 2, device="meta")) == torch.device("meta")


def test_one_process_per_gpu_takes_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device() == torch.device("cuda", 3)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("RANK", "5")  # a launcher that sets RANK only (one node)
    assert default_device() == torch.device("cuda", 5)
    monkeypatch.setenv("LOCAL_RANK", "9")
    with pytest.raises(ConfigError, match="LOCAL_RANK=9, but this machine has 8 GPU"):
        default_device()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert default_device() == torch.device("cpu")
