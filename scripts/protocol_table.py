"""The embedded dLLM under each evaluation protocol (`dllm-rl eval protocol=...`), as one table.

The protocols' own prompts (d1's instructions, over 500 tokens with the embedded character tokenizer) do not fit
the embedded model's context of 256, so every protocol runs here with the tasks' compact prompts
(`protocol.task.prompt_style=compact`) at the lengths that fit after them (default 64 and 128): the lengths,
steps, blocks, decoding and answer parsing are the protocol's. Prints a markdown table and writes JSON.

    python scripts/protocol_table.py                       # docs/protocol_table.json
    python scripts/protocol_table.py --prompts 16 --lengths 64 --json /tmp/p.json   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dllm_rl import cli  # noqa: E402

PROTOCOLS = ("d1", "justgrpo", "fast")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny-dllm"))
    parser.add_argument("--tasks", nargs="+", default=["sudoku", "countdown"])
    parser.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--out", default="runs/protocol_table")
    parser.add_argument("--json", default="docs/protocol_table.json")
    args = parser.parse_args()

    rows, started = [], time.perf_counter()
    for task in args.tasks:
        for protocol in args.protocols:
            out = Path(args.out) / f"{task}-{protocol}"
            lengths = "[" + ",".join(map(str, args.lengths)) + "]"
            code = cli.main(["eval", f"model={args.model}", f"task={task}", f"protocol={protocol}",
                             "++protocol.task.prompt_style=compact", f"protocol.lengths={lengths}",
                             f"num_prompts={args.prompts}", f"output_dir={out}"])
            if code != 0:
                raise SystemExit(f"dllm-rl eval failed for {task} under protocol={protocol} (exit {code})")
            summary = json.loads((out / "summary.json").read_text())
            for settings in summary["meta"]["settings"]:
                result = summary["lengths"][str(settings["gen_length"])][task]
                rows.append({"task": task, "protocol": protocol, "length": settings["gen_length"],
                             "steps": None if settings.get("threshold") else settings["steps"],
                             "pass@1": result["pass@1"], "format_rate": result["format_rate"],
                             "tokens": result["completion_tokens_mean"], "seconds": result["seconds"]})
            meta = summary["meta"]
    lines = ["| task | protocol | length | steps | pass@1 | format | tokens | s |", "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['protocol']} | {r['length']} | {r['steps'] or 'adaptive'} | "
                     f"{r['pass@1']:.3f} | {r['format_rate']:.3f} | {r['tokens']:.1f} | {r['seconds']:.0f} |")
    table = "\n".join(lines)
    print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "model": args.model, "prompts": args.prompts,
                                           "versions": meta["versions"], "device": meta["device_name"],
                                           "seconds": time.perf_counter() - started, "rows": rows, "table": table},
                                          indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
