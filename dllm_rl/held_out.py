"""Held-out measurements taken during a run: `HeldOut`, the periodic evaluation (greedy pass@1, sampled
best-of-k, the provenance split), and `HeldOutProbe`, the cheap held-out metric the contextual rollout bandit is
rewarded by. Both read only held-out prompts and run in the rollouts' inference context; every rank computes
the same values (at ZeRO-3 every rank must take part in the parameter gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from dllm_rl.data.task import Task, draw_examples, render_prompt
from dllm_rl.errors import require
from dllm_rl.evaluate import evaluate_task
from dllm_rl.external.provenance import split_pass1
from dllm_rl.likelihood.estimators import build_estimator


@dataclass
class HeldOut:
    """Greedy pass@1 on held-out prompts; with `samples` = k, also k samples at the rollout temperature
    (sampled pass@1, best-of-k); with `external_solved` (uid -> whether the external policy solves it,
    dllm_rl/external/provenance.py), greedy pass@1 on each side too. Every rank evaluates the same prompts
    (identical results): ZeRO-3 needs all ranks in the parameter gather."""

    greedy: Any  # TextGenerator at temperature 0
    sampler: Any  # the rollout TextGenerator
    task: Task
    tokenizer: Any
    prompts: int
    samples: int
    seed: int
    inference: Callable[[], ContextManager]
    external_solved: dict[str, bool] | None = None
    correct: dict[str, int] | None = None  # the last evaluation's greedy result per prompt (uid -> 0/1)

    def examples(self) -> list:
        """The held-out prompts, as `evaluate_task` draws them."""
        return draw_examples(self.task, "test", self.prompts, self.seed, "eval_prompts")

    def __call__(self) -> dict[str, float]:
        common = dict(num_prompts=self.prompts, prompts_key="eval_prompts", batch_size=64, seed=self.seed,
                      tokenizer=self.tokenizer, print_fn=lambda *_: None)
        with self.inference():
            summary, records = evaluate_task(self.greedy, self.task, **common)
            # per prompt, for paired standard errors between evaluations (held_out.jsonl, dllm_rl/analysis.py)
            self.correct = {r["uid"]: int(bool(r["correct"])) for r in records}
            out = {"eval/pass@1": summary["pass@1"], "eval/reward": summary["reward_mean"],
                   "eval/format_rate": summary["format_rate"], "eval/len": summary["completion_tokens_mean"]}
            if self.external_solved is not None:
                out.update(split_pass1(records, self.external_solved))
            if self.samples > 0:
                sampled, _ = evaluate_task(self.sampler, self.task, num_samples=self.samples, **common)
                out.update({"eval/sampled_pass@1": sampled["pass@1"],
                            f"eval/best_of_{self.samples}": sampled[f"best_of_{self.samples}"]})
        return out


# deterministic: the whole window masked, the prompt clean
CLEAN_PROMPT = build_estimator({"name": "mean_field", "prompt_mask_prob": 0.0})


@dataclass
class HeldOutProbe:
    """A cheap held-out metric (the contextual bandit's reward, dllm_rl/curation/bandit.py): the policy's mean
    per-token log-likelihood of verified-correct completions of held-out prompts, by the mean-field estimator (one
    forward over the rows, the whole window masked, the prompt clean), in the rollouts' inference context. The
    same rows and value on every rank."""

    policy: Any
    ids_NL: torch.Tensor
    attention_mask_NL: torch.Tensor
    prompt_length: int
    mask_NC: torch.Tensor
    inference: Callable[[], ContextManager]

    def __call__(self) -> float:
        with torch.no_grad(), self.inference():
            logp_NC = CLEAN_PROMPT.logp(self.policy, self.ids_NL, self.attention_mask_NL, self.prompt_length,
                                        seeds_N=[0] * len(self.ids_NL))
        return float((logp_NC.double() * self.mask_NC).sum() / self.mask_NC.sum())


def build_probe(task: Task, tokenizer, policy, window: int, count: int, seed: int,
                inference: Callable[[], ContextManager]) -> HeldOutProbe:
    """The probe over the first `count` held-out prompts with a worked solution (the task's solver, or a file
    task's reference) that fits the window with its EOS: with its steps, or else the answer alone."""
    from dllm_rl.data.task import render_completion
    from dllm_rl.sft import SFTExample, completion_tokens, diffusion_batch, worked_solution

    pairs = []
    for ex in draw_examples(task, "test", count, seed, "curation.bandit.probe_prompts"):
        solution = worked_solution(task, ex)
        for written in [] if solution is None else [solution, type(solution)(solution.answer)]:
            pair = SFTExample(render_prompt(task.prompt(ex), tokenizer), render_completion(written, task.prompt_style))
            if completion_tokens(tokenizer, pair) < window:
                pairs.append(pair)
                break
    require(pairs, f"curation=bandit: none of {count} held-out {task.name} prompts has a worked solution that fits "
            f"the window of {window} tokens (the probe, its reward, needs some)")
    ids_NL, attention_NL, P = diffusion_batch(tokenizer, pairs, window, device=policy.device)
    lengths_N1 = torch.tensor([[completion_tokens(tokenizer, p) + 1] for p in pairs], device=policy.device)
    mask_NC = (torch.arange(window, device=policy.device)[None] < lengths_N1).double()
    return HeldOutProbe(policy, ids_NL, attention_NL, P, mask_NC, inference)
