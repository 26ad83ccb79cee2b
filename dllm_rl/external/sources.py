"""External policies whose rollouts ERILS mixes into the dLLM's GRPO buffer, behind one protocol.

ERILS, "Beyond On-Policy Exploration: Integrating External Policy Rollouts for RL in Diffusion LMs"
(arXiv 2608.01717): when the dLLM's own rollouts rarely succeed, high-reward rollouts of a stronger external
policy supply the missing positive signal. A source returns, for each prompt of a step, a list of
`ExternalRollout`s: text in the source's own words, plus where it came from and, when the source knows it,
its behaviour log-probability log mu(y | x) (needed by the capped importance-weight correction).

| name      | what                                                | behaviour log-prob                     |
|-----------|-----------------------------------------------------|----------------------------------------|
| causal_lm | a Hugging Face causal LM from a local path, batched | sum of the sampled tokens' log-probs   |
| jsonl     | precomputed rollouts, one JSON object per line      | the line's `behaviour_logp`, if given  |
| solver    | the task's exact solver (Sudoku, Countdown, ...)    | 0 (a deterministic policy: mu(y|x)=1)  |
| openai    | a model behind an OpenAI-compatible server (`served.py`) | the returned tokens' log-probs, or None |

Every source is deterministic given the seeds it is handed, so a resumed run sees the same external rows (a served
model only where its server honours per-request seeds: vLLM does, `transformers serve` with one request at a time).
"""

from __future__ import annotations

import inspect
import json
import math
import random
from pathlib import Path
from typing import Callable, Sequence

import torch

from dllm_rl.data.task import Example, Solution, Task, render_completion, render_prompt
from dllm_rl.external.base import ExternalRollout, ExternalSource, token_ends
from dllm_rl.external.served import OpenAISource
from dllm_rl.errors import ConfigError, check_kwargs, check_ranges, check_types, pick, require
from dllm_rl.rollout.sampler import first_eos
from dllm_rl.rollout.causal import SpeculativeStats
from dllm_rl.rollout.speculative import DraftForest


class CausalLMSource:
    """Samples from a local causal LM (e.g. models/tiny-ar, a Qwen checkpoint), in its own tokenizer and chat
    template. The behaviour log-prob is the sum of log mu over the sampled tokens up to and including the
    first EOS, under the sampling distribution (softmax of logits / temperature)."""

    name = "causal_lm"

    def __init__(self, path: str, temperature: float = 1.0, max_new_tokens: int = 128, dtype: str = "float32",
                 batch_size: int = 64, trust_remote_code: bool = False, device: str | None = None,
                 draft_tokens: int = 0, draft_match: int = 4, draft_history: int = 16,
                 draft_capacity: int = 1_000_000):
        """`device`: where the model runs; None (the default) is the trainer's policy device. `draft_tokens` > 0
        samples by speculative decoding (SRT) with up to that many tokens per forward drafted from a tree of the
        prompt's last `draft_history` rollouts, matching up to `draft_match` tokens of context, the trees of all
        prompts holding at most `draft_capacity` tokens (least recently used prompts dropped first); the
        rollouts are the same as with `draft_tokens=0`, token for token (one sampling rule), in fewer forwards."""
        from dllm_rl.rollout.generate import load_generator

        check_ranges(dict(temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                          draft_tokens=draft_tokens, draft_match=draft_match, draft_history=draft_history,
                          draft_capacity=draft_capacity),
                     {"temperature": "non_negative", "max_new_tokens": "at_least_1", "batch_size": "at_least_1",
                      "draft_tokens": "non_negative", "draft_match": "at_least_1", "draft_history": "at_least_1",
                      "draft_capacity": "at_least_1"}, "external")
        self.generator = load_generator(path, kind="causal", dtype=dtype, trust_remote_code=trust_remote_code,
                                        device=device or "cpu", key="external.path", gen_length=max_new_tokens,
                                        temperature=temperature)
        self.path, self.batch_size = path, batch_size
        self.draft_tokens = draft_tokens
        # per prompt uid, in memory only: a resumed run starts with empty trees, which changes its speed, not its rows
        self.trees = DraftForest(draft_match, draft_history, draft_capacity)
        self.stats = SpeculativeStats()

    def rollouts(self, task, examples, count, seeds):
        jobs = [(i, j) for i in range(len(examples)) for j in range(count)]
        out: list[list[ExternalRollout]] = [[] for _ in examples]
        tokenizer, eos_id = self.generator.tokenizer, self.generator.eos_id
        self.stats = SpeculativeStats()
        for lo in range(0, len(jobs), self.batch_size):
            batch = jobs[lo : lo + self.batch_size]
            prompts = [render_prompt(task.prompt(examples[i]), tokenizer) for i, _ in batch]
            samples = self.sample(prompts, [seeds[i][j] for i, j in batch], [examples[i].uid for i, _ in batch])
            ends = first_eos(samples.completion_BC, eos_id).tolist()
            for (i, _), row_C, prob_C, end in zip(batch, samples.completion_BC.tolist(), samples.confidence_BC, ends):
                logp_C = prob_C[: end + 1].double().log()
                logp = float(logp_C.sum())  # the EOS (if any) is a sampled token too
                text = tokenizer.decode(row_C[:end], skip_special_tokens=True)
                out[i].append(ExternalRollout(i, text, self.name, logp, per_token(tokenizer, row_C[:end], text,
                                                                                   logp_C[:end].tolist())))
        return out

    def sample(self, prompts: list[str], seeds: list[int], uids: list[str]):
        """One batch: plainly, or speculatively with each prompt's tree, which then takes in the new rollouts."""
        with torch.no_grad():
            if not self.draft_tokens:
                return self.generator.sample(prompts, seeds)
            eos_id, k = self.generator.eos_id, self.draft_tokens
            trees = [self.trees.tree(uid) for uid in uids]
            samples, stats = self.generator.speculate(prompts, seeds, lambda row, tokens: trees[row].draft(
                tokens, k, stop=eos_id), k)
        self.stats.add(stats)
        ends = first_eos(samples.completion_BC, eos_id).tolist()
        for uid, row_C, end in zip(uids, samples.completion_BC.tolist(), ends):
            self.trees.insert(uid, row_C[: end + 1])
        return samples

    def step_metrics(self) -> dict[str, float]:
        """Speculative decoding's acceptance rate and tokens per forward over the last `rollouts` call."""
        return self.stats.metrics() if self.draft_tokens else {}


def per_token(tokenizer, ids: list[int], text: str, logps: list[float]) -> tuple[tuple[int, float], ...] | None:
    """`ExternalRollout.token_logps` of a completion decoded to `text`: where its tokens decoded one by one spell
    the text (byte-level BPE tokenizers, Qwen's), each token's end offset and log-prob; else None."""
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    return tuple(zip(token_ends(pieces), logps)) if "".join(pieces) == text else None


class JsonlSource:
    """Precomputed rollouts: one JSON object per line with `uid` (the example's key, as `dllm-rl eval` writes
    it in samples.jsonl), `completion`, and optionally `behaviour_logp`. A prompt with more stored rollouts
    than asked for gets a seeded choice of them; one with none gets none."""

    name = "jsonl"
    prefix_logps = False  # one log-prob per stored rollout: a cut one has none (mixing.length_rule=truncate with is)

    def __init__(self, path: str):
        file = Path(path).expanduser()
        require(file.is_file(), f"external.path={path!r}: expected a JSONL file of external rollouts")
        self.path, self.by_uid = path, {}
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(f"external.path={path!r}: not UTF-8 text ({error})") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            require(isinstance(row, dict) and isinstance(row.get("uid"), str) and
                    isinstance(row.get("completion"), str),
                    f"{path}:{number}: expected an object with string fields 'uid' and 'completion', got {line[:80]!r}")
            logp = row.get("behaviour_logp")
            require(logp is None or (isinstance(logp, (int, float)) and not isinstance(logp, bool)
                                     and math.isfinite(logp) and logp <= 0),
                    f"{path}:{number}: behaviour_logp must be a finite log-probability (<= 0), got {logp!r}")
            self.by_uid.setdefault(row["uid"], []).append((row["completion"], None if logp is None else float(logp)))
        require(self.by_uid, f"external.path={path!r} holds no rollouts")

    def covered(self, examples: Sequence[Example]) -> int:
        """How many of `examples` have stored rollouts; none at all means the file is another task's."""
        covered = sum(ex.uid in self.by_uid for ex in examples)
        require(covered > 0, f"external.path={self.path!r}: none of its {len(self.by_uid)} uids is the uid of a train "
                f"prompt of this task (e.g. {next(iter(self.by_uid))!r} against {examples[0].uid!r}); is it the file "
                f"of another task?")
        return covered

    def rollouts(self, task, examples, count, seeds):
        out = []
        for i, ex in enumerate(examples):
            stored = self.by_uid.get(ex.uid, [])
            chosen = random.Random(seeds[i][0] if seeds[i] else 0).sample(stored, min(count, len(stored)))
            out.append([ExternalRollout(i, text, self.name, logp) for text, logp in chosen])
        return out


class SolverSource:
    """The task's exact solver, written in the task's completion format. `trace_steps` sets the length: -1
    keeps every reasoning step, k keeps the first k, 0 gives the answer alone. Deterministic, so the
    behaviour log-prob is 0 and the `count` rollouts of a prompt are the same text."""

    name = "solver"

    def __init__(self, trace_steps: int = 0):
        require(isinstance(trace_steps, int) and trace_steps >= -1,
                "external.trace_steps must be -1 (all steps), 0 (answer only) or a positive count, "
                f"got {trace_steps!r}")
        self.trace_steps = trace_steps

    def completion(self, task: Task, example: Example) -> str | None:
        solution = task.solve(example)
        if solution is None:
            return None
        steps = solution.steps if self.trace_steps < 0 else solution.steps[: self.trace_steps]
        return render_completion(Solution(solution.answer, steps), task.prompt_style)

    def rollouts(self, task, examples, count, seeds):
        out = []
        for i, ex in enumerate(examples):
            text = self.completion(task, ex)
            out.append([] if text is None else [ExternalRollout(i, text, self.name, 0.0) for _ in range(count)])
        return out


SOURCES: dict[str, Callable[..., ExternalSource]] = {
    "causal_lm": CausalLMSource,
    "jsonl": JsonlSource,
    "solver": SolverSource,
    "openai": OpenAISource,
}


def build_source(name: str, policy_device: torch.device | str = "cpu", **options) -> ExternalSource:
    """The source `SOURCES[name]` built from its flat config options (unknown keys are named). A source that runs
    a model and has no `device` option set runs it on `policy_device` (the trainer passes the policy's)."""
    cls = check_source_options(name, options)
    if "device" in inspect.signature(cls.__init__).parameters and options.get("device") is None:
        options["device"] = str(policy_device)
    return cls(**options)


def check_source_options(name: str, options: dict) -> Callable[..., ExternalSource]:
    """The source class `name`, with its options checked by name and type (nothing is loaded)."""
    cls = pick(SOURCES, name, "external.name")
    check_kwargs(cls.__init__, options, "external")
    check_types(cls.__init__, options, "external")
    return cls

