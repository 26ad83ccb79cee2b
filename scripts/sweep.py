"""What the sweep scripts share (scripts/curation_benchmark.py, scripts/long_runs.py): one `dllm-rl train` run per
(task, arm, seed) as a subprocess that continues an interrupted run from its checkpoint, and the small JSON each
finished run's numbers are kept in (committed with the docs, so a sweep longer than one machine's life continues on
the next)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def launch(path: Path, overrides: list[str], threads: int) -> None:
    """`dllm-rl train run_dir=path *overrides`, or `resume=path` where a run was started there (from its last
    checkpoint, or again from the start where it stopped before its first); its output goes to path.log beside
    the run."""
    command = [sys.executable, "-m", "dllm_rl.cli", "train", f"run_dir={path}", *overrides]
    if (path / "config.json").is_file():  # an interrupted run: continue it
        command = [sys.executable, "-m", "dllm_rl.cli", "train", f"resume={path}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.log", "a") as log:
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def kept(path: Path, wanted: dict) -> dict | None:
    """A finished run's kept numbers, or None where there are none or they were made with other settings."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record["numbers"] if record.get("settings") == wanted else None


def keep(path: Path, settings: dict, numbers: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "numbers": numbers}, default=float) + "\n")


def run_all(plan: list[tuple], kept_path: dict, settings: Callable[..., dict], run_path: Callable[..., Path],
            overrides: Callable[..., list[str]], numbers: Callable[[Path], dict], steps: int, threads: int, jobs: int,
            only_kept: bool = False) -> dict:
    """Every planned run's numbers (None where missing): the kept ones as they are, the others launched (`jobs` at
    a time, each a subprocess with `threads` OMP threads; an interrupted one continues), read and kept."""
    from concurrent.futures import ThreadPoolExecutor

    from dllm_rl import analysis

    runs = {p: kept(kept_path[p], settings(*p)) for p in plan}
    todo = [] if only_kept else [p for p in plan if runs[p] is None]

    def work(item):
        if not analysis.finished(run_path(*item), steps):
            print(f"running {' '.join(map(str, item))} ...", flush=True)
            launch(run_path(*item), overrides(*item), threads)
        runs[item] = numbers(run_path(*item))
        keep(kept_path[item], settings(*item), runs[item])
        print(f"finished {' '.join(map(str, item))}: {kept_path[item]}", flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(work, todo))
    return runs


def write_report(path: str, started: float, plan: list[tuple], runs: dict, results: list[dict], text: str,
                 steps: int) -> None:
    """The sweep's JSON: the command, steps per run, its seconds, the planned runs still missing, every run's
    numbers, the table."""
    import time

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"command": " ".join(sys.argv), "steps": steps,
                                      "sweep_seconds": time.perf_counter() - started,
                                      "missing": [list(p) for p in plan if runs[p] is None],
                                      "runs": results, "table": text}, indent=1) + "\n")


def add_arguments(parser, out: str, report: str, keep: str) -> None:
    """The options every resumable sweep takes: how many runs at a time, where runs, report and kept numbers go."""
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per run")
    parser.add_argument("--out", default=out)
    parser.add_argument("--json", default=report)
    parser.add_argument("--keep", default=keep, help="each finished run's numbers")
    parser.add_argument("--only-kept", action="store_true", help="tabulate the kept runs only; run nothing")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
