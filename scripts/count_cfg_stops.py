"""How far the run's config travels: the functions of dllm_rl that are handed the `TrainConfig` object itself (an
argument or local holding it when the function is entered) during `dllm-rl train` of one step, and their modules.

A profiler hook sees every call of a function defined under `dllm_rl/` (the config's own methods left out) and
records it where one of its locals at entry is the run's `TrainConfig` (`cfg`) or holds it as `.cfg` (the `Run`):
the functions that can read any key of the config; and, from a hook on the config's attribute reads, the functions
that do read a key of it (and which). Fewer stops: fewer places a key's meaning can hide.
Run it against another revision with `PYTHONPATH=<a worktree of it>` (scripts/bench_revisions.py makes them).

    python scripts/count_cfg_stops.py --out cfg_stops.json [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="cfg_stops.json")
    args, overrides = parser.parse_known_args()
    import dllm_rl
    from dllm_rl.cli import main as cli

    package = str(Path(dllm_rl.__file__).resolve().parent)
    stops: dict[tuple[str, str], int] = {}

    def hook(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(package):
            return
        if frame.f_code.co_qualname.startswith("TrainConfig."):
            return  # the config's own methods
        handed = [v for v in frame.f_locals.values() if type(v).__name__ == "TrainConfig"
                  or type(getattr(v, "cfg", None)).__name__ == "TrainConfig"]
        if handed:
            kind = "cfg" if any(type(v).__name__ == "TrainConfig" for v in handed) else "run"
            stops[(frame.f_globals.get("__name__", "?"), frame.f_code.co_qualname)] = kind

    from dllm_rl.train_config import TrainConfig

    fields = set(TrainConfig.__dataclass_fields__)
    reads: dict[tuple[str, str], set[str]] = {}
    plain = TrainConfig.__getattribute__

    def reading(self, name):  # who reads which key: the caller of each attribute read of a config field
        if name in fields:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(package) and not caller.f_code.co_qualname.startswith("TrainConfig."):
                reads.setdefault((caller.f_globals.get("__name__", "?"), caller.f_code.co_qualname), set()).add(name)
        return plain(self, name)

    TrainConfig.__getattribute__ = reading
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = ["dllm-rl", "train", "steps=1", "eval_every=0", f"run_dir={tmp}/run", *overrides]
        sys.setprofile(hook)
        try:
            cli()
        except SystemExit:
            pass
        finally:
            sys.setprofile(None)
    modules = sorted({m for m, _ in stops})
    direct = {k for k, kind in stops.items() if kind == "cfg"}
    print(f"\n{len(stops)} functions in {len(modules)} modules are handed the run's config ({len(direct)} in "
          f"{len({m for m, _ in direct})} modules the TrainConfig itself, the rest something holding it as .cfg):")
    for module in modules:
        print(f"  {module}: {', '.join(sorted(f + ('' if stops[m, f] == 'cfg' else ' (.cfg)') for m, f in stops if m == module))}")
    readers = sorted({m for m, _ in reads})
    print(f"\n{len(reads)} functions in {len(readers)} modules read a key of it:")
    for module in readers:
        print(f"  {module}: {', '.join(sorted(f for m, f in reads if m == module))}")
    Path(args.out).write_text(json.dumps({"package": package, "functions": len(stops), "modules": len(modules),
                                          "reading_functions": len(reads), "reading_modules": len(readers),
                                          "reads": {f"{m}:{f}": sorted(k) for (m, f), k in sorted(reads.items())},
                                          "functions_handed_cfg": len(direct),
                                          "modules_handed_cfg": len({m for m, _ in direct}),
                                          "stops": sorted(f"{m}:{f} ({kind})" for (m, f), kind in stops.items())},
                                         indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
