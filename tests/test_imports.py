"""The import rules of the design, checked by parsing every module: configs stay at the edge (only the
CLI sees hydra/omegaconf), only `engine` (and `distributed`) touch deepspeed, and task/reward modules
import no torch or transformers."""

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
