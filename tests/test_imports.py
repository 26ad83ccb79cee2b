"""The rules of the design, checked by parsing every module: configs stay at the edge (only the CLI sees
hydra/omegaconf), only `engine` (and `distributed`) touch deepspeed, task/reward modules import no torch or
transformers, `algo` imports only torch and the package's errors, and no function grows past one screen."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dllm_rl"


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def modules():
    return {p.relative_to(PACKAGE).as_posix(): imported_roots(p) for p in PACKAGE.rglob("*.py")}


def test_only_the_cli_sees_configs():
    offenders = [m for m, roots in modules().items() if roots & {"hydra", "omegaconf"} and m != "cli.py"]
    assert offenders == []


def test_only_engine_and_distributed_import_deepspeed():
    offenders = [m for m, roots in modules().items()
                 if "deepspeed" in roots and not m.startswith(("engine/", "distributed/"))]
    assert offenders == []


def test_tasks_and_rewards_import_no_torch():
    light = [m for m in modules() if m.startswith("data/") and m not in ("data/tokenizers.py",)]
    assert "data/countdown.py" in light and "data/answers.py" in light
    offenders = {m: modules()[m] & {"torch", "transformers"} for m in light if modules()[m] & {"torch", "transformers"}}
    assert offenders == {}


def test_algo_is_pure_tensor_math():
    offenders = {m: roots - {"torch", "dllm_rl", "__future__", "typing", "math", "dataclasses"}
                 for m, roots in modules().items() if m.startswith("algo/")}
    assert {m: r for m, r in offenders.items() if r} == {}


def test_no_function_is_longer_than_80_lines():
    long = [f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert long == []
