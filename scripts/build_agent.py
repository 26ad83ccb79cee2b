"""Build the embedded agent (models/tiny-dllm-agent) and its card.

The agent is the embedded dLLM fine-tuned on the solver's episodes of two environments (dllm_rl/envs/).
`python scripts/build_models.py --only agent` runs the same build (after the dLLM it starts from, when both are
built).

    python scripts/build_agent.py                       # from models/tiny-dllm into models/tiny-dllm-agent
    python scripts/build_agent.py --base /tmp/m/tiny-dllm --out /tmp/m   # from another dLLM
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # build_models, when imported from elsewhere

from build_models import precision_of  # noqa: E402
from dllm_rl.data.tokenizers import load_tokenizer  # noqa: E402
from dllm_rl.policy.adapters import wrap_model  # noqa: E402
from dllm_rl.policy.modeling import DiffusionLM  # noqa: E402
from dllm_rl.policy.schedule import MaskingSchedule  # noqa: E402
from dllm_rl.sft import diffusion_batch, diffusion_sft_loss, drop_overlong, train_sft  # noqa: E402

# The agent: the embedded dLLM fine-tuned on solver episodes of two environments (dllm_rl/envs/), one example per
# solver turn (the turn prompt with env.history=0, the action as the completion): a model that plays, with room
# for RL. History 0 because these environments show the whole state in each observation (and the turn prompts had
# to fit the 256-token context of the dLLM it was built from, the one before models/tiny-dllm's 512). Its own
# directory, so the task model's card and pins stay as they are.
# Each environment's share of the --agent-turns examples: FrozenLake (reading a position off a flattened map) is
# the harder one; at equal shares 300 steps gave held-out greedy success 0.50 / 0.00 (corridor / FrozenLake) and
# 700 steps 1.00 / 0.00 (sampled at T=1: 1.00 / 0.10): the corridor is learnt long before the lake.
AGENT_ENVS = {"corridor": 0.15, "frozen_lake": 0.85}
AGENT_WINDOW = 8  # the action window (the longest action, "right" or "pick", fits with its EOS)
AGENT_ROLLOUT = {"gen_length": AGENT_WINDOW, "block_length": AGENT_WINDOW, "steps": AGENT_WINDOW}


def evaluate_agent(out: Path, seeds: int) -> dict:
    """Each environment's held-out success, turns and invalid actions: greedy, and sampled at temperature 1 (what
    RL's rollouts see), one episode per seed (`dllm-rl eval env=<name>`'s own function)."""
    import tempfile

    from dllm_rl.envs.collect import run_env_eval
    from dllm_rl.envs.task import EnvConfig, EnvTask

    results = {}
    for name in AGENT_ENVS:
        task = EnvTask(EnvConfig(name=name, history=0))
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            with tempfile.TemporaryDirectory() as tmp:
                results.setdefault(name, {})[mode] = run_env_eval(
                    task, model=str(out), rollout={**AGENT_ROLLOUT, "temperature": temperature},
                    num_prompts=seeds, output_dir=tmp, device="cpu", print_fn=lambda *_: None)
    return results


def build_agent(out: Path, base: Path, steps: int, turns: int, eval_seeds: int, seed: int, command: str,
                eval_only: bool = False) -> dict:
    from dllm_rl.envs.task import EnvConfig, EnvTask
    from dllm_rl.sft import solver_examples

    start = time.perf_counter()
    if eval_only:
        previous = json.loads((out / "eval.json").read_text())
        log, seconds = previous["sft_log"], previous["build_seconds"]
    else:
        model, tokenizer = DiffusionLM.from_pretrained(base), load_tokenizer(str(base))
        policy = wrap_model(model, "native", tokenizer)
        schedule = MaskingSchedule.from_pretrained(base)
        data = [ex for name, share in AGENT_ENVS.items() for ex in solver_examples(
            EnvTask(EnvConfig(name=name, history=0)), round(turns * share), seed, tokenizer=tokenizer)]
        data = drop_overlong(data, tokenizer, AGENT_WINDOW)

        def loss_fn(batch, generator):
            ids, mask, prompt_length = diffusion_batch(tokenizer, batch, AGENT_WINDOW)
            return diffusion_sft_loss(policy, ids, mask, prompt_length, schedule, generator, weighting="masked_mean")

        model.train()
        log = train_sft(loss_fn, model.parameters(), data, steps=steps, batch_size=32, lr=1e-3, warmup=20, seed=seed)
        model.eval()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        schedule.save_pretrained(out)
        seconds = time.perf_counter() - start
    evals = evaluate_agent(out, eval_seeds)
    (out / "eval.json").write_text(json.dumps({"evals": evals, "sft_log": log, "build_seconds": seconds,
                                               "shares": AGENT_ENVS, "window": AGENT_WINDOW}, indent=2) + "\n")
    rows = "\n".join(f"| {name} | {r['greedy']['success']:.3f} | {r['greedy']['turns']:.1f} | "
                     f"{r['greedy']['invalid']:.3f} | {r['sampled']['success']:.3f} | {r['sampled']['invalid']:.3f} |"
                     for name, r in evals.items())
    (out / "README.md").write_text(f"""# tiny-dllm-agent: the embedded dLLM that plays

The embedded masked-diffusion policy (`{base.as_posix()}`) fine-tuned on the solver's episodes of
{' and '.join(AGENT_ENVS)} (dllm_rl/envs/): a multi-turn policy with room for RL.

- Parameters, architecture, tokenizer: those of `{base.as_posix()}`.
- Training data: the turns of the solver's episodes on the train seeds, {turns} in all (shares
  {', '.join(f'{name} {share:g}' for name, share in AGENT_ENVS.items())}), as
  `dllm-rl sft env=<name>` builds them: the turn prompt with `env.history=0` (these environments show the whole
  state in each observation), the action as the completion.
- Training: masked-diffusion SFT (mean CE over masked tokens), {steps} steps x 32 sequences, AdamW lr 1e-3
  cosine, {precision_of(log)}; action window {AGENT_WINDOW}.
- Built with `{command}` in {seconds / 60:.1f} minutes on {platform.processor() or platform.machine()}
  ({torch.get_num_threads()} threads, torch {torch.__version__}).

## Held-out seeds ({eval_seeds} per environment, one episode each)

| env | success (greedy) | turns | invalid actions | success (sampled, T=1) | invalid (sampled) |
|---|---|---|---|---|---|
{rows}

Reproduce: `dllm-rl eval env=<env> env.history=0 model={out.as_posix()} rollout.gen_length={AGENT_WINDOW} \
rollout.block_length={AGENT_WINDOW} rollout.steps={AGENT_WINDOW} num_prompts={eval_seeds}` (add
`rollout.temperature=1` for the sampled column).
""")
    return {name: {mode: round(r[mode]["success"], 3) for mode in r} for name, r in evals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="models", help="the agent goes to <out>/tiny-dllm-agent")
    parser.add_argument("--base", default=None, help="the dLLM to fine-tune (default <out>/tiny-dllm)")
    add_agent_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true", help="re-evaluate the agent already in --out")
    args = parser.parse_args()
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if k in ("agent_steps", "agent_turns", "agent_eval_seeds", "seed", "base")
               and v != parser.get_default(k)]
    out = Path(args.out)
    base = Path(args.base) if args.base else out / "tiny-dllm"
    if not (base / "config.json").is_file() and not args.eval_only:
        parser.error(f"--base {base}: expected a dLLM's model directory (with config.json) to fine-tune")
    print(json.dumps({"tiny-dllm-agent": build_agent(
        out / "tiny-dllm-agent", base, args.agent_steps,
        args.agent_turns, args.agent_eval_seeds, args.seed, " ".join(["python scripts/build_agent.py", *changed]),
        args.eval_only)}, indent=2))


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent build's settings (this script's and build_models.py's --only agent)."""
    parser.add_argument("--agent-steps", type=int, default=700)
    parser.add_argument("--agent-turns", type=int, default=10000, help="solver turns in all (AGENT_ENVS' shares)")
    parser.add_argument("--agent-eval-seeds", type=int, default=100)


if __name__ == "__main__":
    main()
