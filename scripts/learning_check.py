"""The learning tests' runs (tests/test_learning.py), each with its rise, and the two broken variants the tests
must catch: the learning rate at 0 (no update) and the update's sign flipped (the loss negated, so the step
ascends it). Prints one table and writes JSON; docs/learning.md quotes it.

    python scripts/learning_check.py --variants normal,lr0,flipped --erils --json docs/learning_check_fp32.json
    python scripts/learning_check.py --estimators mean_field --variants normal,lr0,flipped --erils
    python scripts/learning_check.py --bf16 false   # fp32, as a CPU without native bf16 runs the tests

docs/learning_check_fp32.json was measured on a CPU without native bf16 (where `auto` is fp32).

The flipped sign is made here, by wrapping the loss the learner calls (`dllm_rl.learner.grpo_loss`): no option of
the trainer flips it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm_rl import learner  # noqa: E402
from tests import test_learning as spec  # noqa: E402

VARIANTS = ("normal", "lr0", "flipped")


@contextlib.contextmanager
def flipped_sign():
    original = learner.grpo_loss

    def negated(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        return -loss, metrics

    learner.grpo_loss = negated
    try:
        yield
    finally:
        learner.grpo_loss = original


def one(name: str, variant: str, external: bool, workdir: Path, bf16: str) -> dict:
    settings, steps, lr = {**spec.ESTIMATORS, **spec.LEFT_OUT}[name]
    options = dict(steps=steps, lr=1e-12 if variant == "lr0" else lr, **settings)  # lr must be > 0: 1e-12 moves nothing
    options["bf16"] = {"auto": "auto", "true": True, "false": False}[bf16]
    if external:
        options["external"] = {"name": "solver"}
    start = time.perf_counter()
    with flipped_sign() if variant == "flipped" else contextlib.nullcontext():
        values = spec.run_here(workdir, f"{name}-{variant}-{'erils' if external else 'grpo'}", **options)
    return {"estimator": name, "variant": variant, "source": "erils" if external else "grpo", "bf16": bf16,
            "steps": steps, "lr": lr,
            "rise": spec.rise(values), "passes": spec.rise(values) >= spec.MARGIN, "rewards": values,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimators", default=",".join([*spec.ESTIMATORS, *spec.LEFT_OUT]))
    parser.add_argument("--variants", default="normal", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--erils", action="store_true",
                        help=f"also the ERILS test's runs (external=solver, with {spec.ERILS_ESTIMATOR})")
    parser.add_argument("--bf16", default="auto", choices=("auto", "true", "false"),
                        help="the runs' precision (false: what a CPU without native bf16 runs under auto)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    print(f"margin {spec.MARGIN}: the mean of the last {spec.WINDOW} steps over the first step")
    print(f"{'estimator':<14} {'variant':<8} {'source':<6} {'rise':>7} {'passes':>6} {'s':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.estimators.split(","):
            for variant in args.variants.split(","):
                for external in (False, True) if args.erils and name == spec.ERILS_ESTIMATOR else (False,):
                    r = one(name, variant, external, Path(tmp), args.bf16)
                    results.append(r)
                    print(f"{name:<14} {variant:<8} {r['source']:<6} {r['rise']:>+7.3f} {str(r['passes']):>6} "
                          f"{r['seconds']:>6}", flush=True)
                    if args.json:
                        meta = {"command": "python scripts/learning_check.py " + " ".join(sys.argv[1:]),
                                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                                "torch": torch.__version__, "margin": spec.MARGIN, "window": spec.WINDOW}
                        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
