"""ERILS in the trainer: turn a step's prompts into external rows of the mixed buffer, and give every row
of the step its advantage and loss weight.

Order inside a step: the on-policy rollouts are scored first (the trigger may depend on them), then the
triggered prompts ask the source for `per_prompt * candidates` rollouts each, which are bridged into the
dLLM's vocabulary, length-controlled, verified by the task's reward, filtered (`keep`) and selected
(`select`). The external rows are then scored by the dLLM with a trajectory-free estimator (they have no
denoising order): the on-policy estimator when it needs none, otherwise left_to_right, or any
trajectory-free estimator named by `mixing.likelihood`. The levels may differ: a sequence-level row (ELBO)
enters the shared loss as one unit whose value is the sum over its tokens, so under token aggregation its
tokens weigh what a token-level row's tokens weigh.
"""

from __future__ import annotations

import contextlib
import math

import warnings
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dllm_rl.algo import mixing
from dllm_rl.buffer import MINIBATCH_MIXES, Rows
from dllm_rl.data.task import Example, Task
from dllm_rl.errors import ConfigError, check_kwargs, check_ranges, check_types, pick, require
from dllm_rl.external.base import prefix_logp
from dllm_rl.external.bridge import LENGTH_RULES, bridge, control_length, select, window_row
from dllm_rl.external.sources import ExternalSource, build_source
from dllm_rl.likelihood.estimators import Estimator, build_estimator
from dllm_rl.rollout.sampler import completion_mask, left_pad
from dllm_rl.seeds import derive_seed

KEEP = ("correct", "all")

# (this rank's tensor) -> (the concatenation over ranks in rank order, where this rank's part starts)
Gather = Callable[[torch.Tensor], tuple[torch.Tensor, int]]


def local_only(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t, 0


@dataclass
class MixingConfig:
    """How external rollouts enter the step (every field is a `mixing.*` key of configs/train.yaml, and the
    defaults are the YAML's)."""

    per_prompt: int = 2
    candidates: int = 1
    trigger: str = "always"
    decay_steps: int = 30
    keep: str = "correct"
    length_rule: str = "drop"
    processing: str = "separate"
    statistic: str = "constant"
    constant: float = 1.0
    baseline_decay: float = 0.9
    weight: float = 1.0
    correction: str = "none"
    shaping_gamma: float = 0.1
    is_cap: float = 2.0
    is_self_normalize: bool = True
    # the estimator for external rows; None = the on-policy one (left_to_right if that needs a trajectory).
    # The ELBO beat mean-field for external rows (docs/erils.md: mean-field trains only the all-masked state)
    likelihood: dict[str, Any] | None = field(default_factory=lambda: {"name": "elbo", "num_masks": 2, "eps": 0.001,
                                                                       "masking": "fixed_count"})
    minibatch_mix: str = "stratified"

    def __post_init__(self) -> None:
        check_types(MixingConfig, dataclasses.asdict(self), "mixing")
        require(self.per_prompt >= 1, f"mixing.per_prompt must be >= 1, got {self.per_prompt}")
        require(self.candidates >= 1, f"mixing.candidates must be >= 1, got {self.candidates}")
        require(self.decay_steps >= 1, f"mixing.decay_steps must be >= 1, got {self.decay_steps}")
        check_ranges(dataclasses.asdict(self), {"weight": "non_negative", "constant": "finite",
                                                "shaping_gamma": "positive", "is_cap": "positive"}, "mixing")
        require(0 <= self.baseline_decay < 1, f"mixing.baseline_decay must be in [0, 1), got {self.baseline_decay}")
        for key, names in (("trigger", mixing.TRIGGERS), ("keep", KEEP), ("length_rule", LENGTH_RULES),
                           ("processing", mixing.PROCESSING), ("statistic", mixing.STATISTICS),
                           ("correction", mixing.CORRECTIONS), ("minibatch_mix", MINIBATCH_MIXES)):
            pick({n: n for n in names}, getattr(self, key), f"mixing.{key}")


def external_likelihood(on_policy: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    """The estimator config for external rows (see the module docstring)."""
    if override:
        name = override.get("name")
        require(not build_estimator({"name": name}, "mixing.likelihood").needs_trajectory,
                f"mixing.likelihood.name={name!r} needs a denoising trajectory, which external rollouts do not have; "
                "use mean_field, elbo, coupled or left_to_right")
        build_estimator(override, "mixing.likelihood")
        return dict(override)
    if not build_estimator(on_policy).needs_trajectory:
        return dict(on_policy)
    return {"name": "left_to_right", **{k: v for k, v in on_policy.items() if k == "group"}}


class ExternalMixer:
    def __init__(self, source: ExternalSource, config: MixingConfig, on_policy: Estimator):
        self.source, self.config = source, config
        self.estimator = build_estimator(external_likelihood(on_policy.config, config.likelihood), "mixing.likelihood")
        if config.correction == "shaping":
            require(self.estimator.level == "token",
                    "mixing.correction=shaping works on per-token probabilities; the likelihood estimator "
                    f"{self.estimator.name!r} is per sequence")
        require(not (config.correction == "is" and self.estimator.name in ("espo", "spg")),
                f"mixing.correction=is weighs external rows by exp(log pi - log mu) over the whole sequence; the "
                f"{self.estimator.name} estimator gives another quantity (a normalised ELBO, a bound chosen by the "
                f"advantage): choose another mixing.likelihood")
        require(not (config.correction == "is" and getattr(source, "behaviour_logp", True) is False),
                f"mixing.correction=is needs each external rollout's behaviour log-prob; the {source.name} source "
                f"at {getattr(source, 'base_url', '?')} returns none (transformers serve gives none; vLLM and SGLang "
                f"do): choose mixing.correction=none or shaping")
        require(not (config.correction == "is" and config.length_rule == "truncate"
                     and getattr(source, "prefix_logps", True) is False),
                f"mixing.length_rule=truncate with mixing.correction=is needs the log-prob of the kept part of a cut "
                f"rollout; the {source.name} source gives one log-prob per whole rollout: choose mixing.length_rule="
                f"drop or shortest, or mixing.correction=none")
        self.baseline = 0.0  # running mean of external rewards (statistic=running); saved with checkpoints
        self.held: list[torch.Tensor] | None = None  # a piped step's external rewards, while `baseline_held`
        self.warned: set[str] = set()

    def check_source(self, examples: list[Example], print_fn=print) -> None:
        """A source that only covers some prompts (a JSONL file) says how many of the train prompts it covers,
        and stops the run when it covers none (the file of another task)."""
        covered = getattr(self.source, "covered", None)
        if covered is not None:
            print_fn(f"external source {self.source.name}: "
                     f"rollouts for {covered(examples)} of {len(examples)} train prompts")

    # ------------------------------------------------------------------------------------ external rows

    def seeds(self, seed: int, step: int, prompt_ids: list[int]) -> list[list[int]]:
        """The source's seed for each rollout asked of each prompt (by global prompt id)."""
        asked = self.config.per_prompt * self.config.candidates
        return [[derive_seed(seed, "external", step, q, j) for j in range(asked)] for q in prompt_ids]

    def prefetch(self, *, step: int, seed: int, task: Task, examples: list[Example], prompt_ids: list[int]) -> None:
        """Start the source's work for these prompts before the dLLM's rollouts, where the source can (a served
        model) and the trigger fires for every prompt whatever the rollouts do (`always`)."""
        if self.config.trigger == "always" and hasattr(self.source, "prefetch") and examples:
            self.source.prefetch(task, examples, self.config.per_prompt * self.config.candidates,
                                 self.seeds(seed, step, prompt_ids))

    def fired(self, step: int, seed: int, correct_BG: torch.Tensor, prompt_ids: list[int]) -> list[int]:
        """The indices of the prompts the trigger fires for, from their on-policy groups' correctness."""
        c = self.config
        # cpu: seeded uniforms, decided on in Python (the same on every device)
        uniform_B = torch.tensor([derive_seed(seed, "trigger", step, q) / 2**63 for q in prompt_ids])
        fire_B = mixing.triggered(correct_BG, c.trigger, step=step, decay_steps=c.decay_steps, uniform_B=uniform_B)
        return fire_B.nonzero().squeeze(-1).tolist()

    def rows(self, *, step: int, seed: int, task: Task, examples: list[Example], prompt_texts: list[str],
             correct_BG: torch.Tensor, tokenizer, window: int, eos_id: int, max_length: int | None,
             prompt_ids: list[int] | None = None, widest: Callable[[int], int] = lambda n: n,
             device: torch.device | str = "cpu") -> tuple[Rows | None, dict[str, float]]:
        """The step's external rows (None if no prompt fired or nothing survived) and their metrics. The caller
        sets their `mask_seeds`. `prompt_ids` are the prompts' global ids (`StepBatch.prompt_ids`; default
        0, 1, ...): trigger and source seeds depend on them only, and they key the rows.
        `widest` maps this rank's longest kept rollout to the longest over all ranks (called on every rank with
        length_rule=none), so the window, and every estimator draw shaped by it, is the single-process one.
        The rows' tensors are made on `device` (the policy's)."""
        c = self.config
        ids = list(range(len(examples))) if prompt_ids is None else list(prompt_ids)
        chosen = self.fired(step, seed, correct_BG, ids)
        asked = c.per_prompt * c.candidates
        seeds = self.seeds(seed, step, [ids[b] for b in chosen])
        got = self.source.rollouts(task, [examples[b] for b in chosen], asked, seeds) if chosen else []

        kept: list[tuple[int, Any, Any, float | None]] = []  # (prompt, bridged, reward, behaviour logp)
        counts = {"candidates": 0, "too_long": 0, "truncated": 0, "unrepresentable": 0, "incorrect": 0,
                  "no_prefix_logp": 0, "bad_logp": 0}
        source_lengths: list[int] = []
        for b, rollouts in zip(chosen, got):
            counts["candidates"] += len(rollouts)
            bridged = []
            for r in rollouts:
                item = bridge(r.text, tokenizer)
                if item.lost:
                    counts["unrepresentable"] += 1
                    if item.lost not in self.warned:
                        self.warned.add(item.lost)
                        warnings.warn(f"external rollout dropped: the dLLM tokenizer cannot represent {item.lost!r} "
                                      f"(text {r.text[:60]!r})")
                    continue
                bridged.append((item, r))
                source_lengths.append(len(item.ids))
            survivors, n = control_length([item for item, _ in bridged], lambda text: task.reward(text, examples[b]),
                                          rule=c.length_rule, window=window, tokenizer=tokenizer)
            counts["too_long"] += n["too_long"]
            counts["truncated"] += n["truncated"]
            ok = [(k, item, rw) for k, item, rw in survivors if c.keep == "all" or rw.correct]
            counts["incorrect"] += len(survivors) - len(ok)
            for j in select([len(item.ids) for _, item, _ in ok], c.per_prompt, c.length_rule):
                k, item, rw = ok[j]
                # a cut rollout's behaviour log-prob is its kept part's, not the whole text's
                logp = prefix_logp(bridged[k][1], item.text) if item.truncated else bridged[k][1].behaviour_logp
                if logp is None and item.truncated and c.correction == "is":
                    counts["no_prefix_logp"] += 1  # the source's tokens do not spell the text: no weight for it
                    continue
                if logp is not None and not (math.isfinite(logp) and logp <= 0):
                    counts["bad_logp"] += 1  # a source's bad number costs its row, not the step's update
                    continue
                kept.append((b, item, rw, logp))

        metrics = {f"external/{k}": float(v) for k, v in counts.items()}
        if chosen and hasattr(self.source, "step_metrics"):
            metrics |= {f"external/{k}": v for k, v in self.source.step_metrics().items()}
        metrics["external/prompts"] = float(len(chosen))
        metrics["external/rows"] = float(len(kept))
        if source_lengths:
            metrics["external/candidate_len"] = sum(source_lengths) / len(source_lengths)
        width = window
        if c.length_rule == "none":
            width = max(window, widest(max((len(i.ids) for _, i, _, _ in kept), default=0)))
        if not kept:
            return None, metrics
        return self.to_rows(kept, prompt_texts, tokenizer, width, eos_id, max_length, device, ids), metrics

    def to_rows(self, kept: list[tuple], prompt_texts: list[str], tokenizer, width: int, eos_id: int,
                max_length: int | None, device: torch.device | str = "cpu",
                prompt_ids: list[int] | None = None) -> Rows:
        """The kept (prompt, bridged, reward, behaviour logp) tuples as buffer rows on `device`: each prompt in
        the dLLM's tokens, left-padded, then a completion window of `width` holding the text and EOS fill; keyed
        by (the prompt's global id, the row's index among that prompt's kept rows)."""
        encoded = [tokenizer(prompt_texts[b], add_special_tokens=False)["input_ids"] for b, *_ in kept]
        ids_EP, mask_EP = left_pad(encoded, tokenizer.pad_token_id, device)
        P = ids_EP.shape[1]
        if max_length is not None and P + width > max_length:
            raise ConfigError(f"external rollouts of up to {width} tokens after a {P}-token prompt exceed the dLLM's "
                              f"context of {max_length}; use mixing.length_rule=drop, truncate or shortest")
        window_EC = torch.tensor([window_row(i.ids, width, eos_id) for _, i, _, _ in kept], dtype=torch.long,
                                 device=device)
        behaviour = [lp for *_, lp in kept]
        return Rows(
            source="external",
            ids_NL=torch.cat([ids_EP, window_EC], 1),
            attention_mask_NL=torch.cat([mask_EP, torch.ones_like(window_EC)], 1),
            prompt_length=P,
            mask_NC=completion_mask(window_EC, eos_id),
            order_NC=None,
            prompt_N=torch.tensor([b for b, *_ in kept], device=device),
            prompt_id_N=torch.tensor([b if prompt_ids is None else prompt_ids[b] for b, *_ in kept], device=device),
            rewards=[rw for _, _, rw, _ in kept],
            texts=[i.text for _, i, _, _ in kept],
            version=-1,
            estimator=self.estimator,
            behaviour_logp_N=(torch.tensor(behaviour, dtype=torch.float64, device=device)
                              if all(x is not None for x in behaviour) else None),
            shaped=self.config.correction == "shaping",
        )

    # ------------------------------------------------------------------------------------ advantages

    def assign_advantages(self, on: Rows, ext: Rows | None, advantage: str, gather: Gather = local_only) -> None:
        """Set `adv_N` (and `weight_N` of the external rows) for the step, per `processing` and `statistic`,
        over each prompt's rows whatever their number (`advantages`; every rank calls this, its on-policy rows a
        stand-in where it has none)."""
        device = on.ids_NL.device
        on_rewards = on.rewards_N[:0] if on.inert else on.rewards_N
        on_prompt = on.prompt_N[:0] if on.inert else on.prompt_N
        ext_rewards = ext.rewards_N if ext is not None else torch.zeros(0, device=device)
        ext_prompt = ext.prompt_N if ext is not None else torch.zeros(0, dtype=torch.long, device=device)
        adv_on, adv_ext = self.advantages(on_rewards, on_prompt, ext_rewards, ext_prompt, advantage, gather)
        if not on.inert:
            on.adv_N = adv_on
        if ext is not None:
            ext.adv_N = adv_ext.to(torch.float32)
            self.weigh(ext)

    def weigh(self, ext: Rows) -> None:
        """The external rows' loss weight `mixing.weight`."""
        ext.weigh("mixing", torch.full((len(ext),), self.config.weight, device=ext.ids_NL.device))

    def advantages(self, on_rewards_N: torch.Tensor, on_prompt_N: torch.Tensor, ext_rewards_E: torch.Tensor,
                   ext_prompt_E: torch.Tensor, advantage: str,
                   gather: Gather = local_only) -> tuple[torch.Tensor, torch.Tensor]:
        """(adv_on_N, adv_ext_E) of rewards keyed by their prompt (rows' rewards, or a multi-turn step's episode
        returns), per `processing` and `statistic`. The running baseline moves by the mean over all ranks'
        external rewards (`gather`: every rank calls this, with rewards or without)."""
        c = self.config
        if c.processing == "joint":
            adv_on, adv_ext = mixing.joint_advantages(on_rewards_N, on_prompt_N, ext_rewards_E, ext_prompt_E,
                                                      advantage=advantage)
        else:
            adv_on, adv_ext = mixing.separate_advantages(on_rewards_N, on_prompt_N, ext_rewards_E, ext_prompt_E,
                                                         advantage=advantage, statistic=c.statistic,
                                                         constant=c.constant, baseline=self.baseline)
        rewards = gather(ext_rewards_E)[0]
        if self.held is not None:
            self.held.append(rewards)
        else:
            self.baseline = mixing.running_baseline(self.baseline, rewards, c.baseline_decay)
        return adv_on, adv_ext

    @contextlib.contextmanager
    def baseline_held(self):
        """Complete-group pipelining: while a step's groups take their advantages one at a time, the running
        baseline stays at its value at the step's start (A = r - b uses the baseline of earlier steps only), and
        when the step's last group is in it moves once by the mean of all their external rewards: the synchronous
        step's baseline, the same advantages (tested). Left unmoved if the step fails part way."""
        self.held = []
        yield
        held, self.held = self.held, None
        if held:
            self.baseline = mixing.running_baseline(self.baseline, torch.cat(held), self.config.baseline_decay)

    def importance_weights(self, ext: Rows | None, gather: Gather = local_only) -> dict[str, float]:
        """Multiply the external rows' weights by the capped importance weights pi_old / mu (correction=is),
        computed over the step's rows on all ranks (`gather`; every rank calls this, with rows or without)."""
        if ext is None:
            # cpu: nothing of this rank's is weighted; it only takes part in the gather
            log_w_all, _ = gather(torch.zeros(0, dtype=torch.float64))
            return self._weights_metrics(log_w_all)[1]
        require(ext.behaviour_logp_N is not None,
                f"mixing.correction=is needs the behaviour log-prob of every external rollout; source "
                f"{self.source.name!r} did not give one for all (a JSONL source needs 'behaviour_logp' on each line)")
        old_logp = ext.old_logp[0]
        per_token = ext.estimator.level == "token"
        level_logp_N = (old_logp * ext.mask_NC).sum(-1) if per_token else old_logp[:, 0]
        log_w_all, start = gather(level_logp_N.double() - ext.behaviour_logp_N)
        w_all, metrics = self._weights_metrics(log_w_all)
        ext.weigh("importance", w_all[start:start + len(ext)].float())
        return metrics

    def _weights_metrics(self, log_w_N: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        w_N, metrics = mixing.importance_weights(log_w_N, torch.zeros_like(log_w_N), cap=self.config.is_cap,
                                                 self_normalize=self.config.is_self_normalize)
        return w_N, {f"external/{k}": v for k, v in metrics.items()}


def build_mixer(external: dict[str, Any] | None, mixing_options: dict[str, Any] | None,
                on_policy: Estimator, device: torch.device | str = "cpu") -> ExternalMixer | None:
    """None when `external.name` is "none" (on-policy GRPO only). A source that runs a model runs it on `device`
    (the policy's) unless its own `external.device` says otherwise."""
    external = dict(external or {"name": "none"})
    name = external.pop("name", "none")
    if name == "none":
        return None
    check_kwargs(MixingConfig, mixing_options or {}, "mixing")
    config = MixingConfig(**(mixing_options or {}))
    return ExternalMixer(build_source(name, policy_device=device, **external), config, on_policy)
