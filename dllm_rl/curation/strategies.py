"""The curation strategies' state and their place in the step (see dllm_rl/curation/__init__.py).

`Curation` is what the step talks to; each strategy implements the hooks it needs:
- `allocate(step, drawn, counts)`: rollouts per drawn prompt (0 = none), before generating; the same on every
  rank (a function of the drawn prompts, the state and seeds);
- `select(batch)`: this rank's freshly generated rows (whole groups), before verifying: rows to keep, weights;
- `reweight(batch)`: this rank's rows (whole groups) once their advantages are set: advantages, loss weights,
  auxiliary SFT rows (`StepBatch.auxiliary`);
- `observe(records)`: every rank's groups of the step (`GroupRecord`, gathered, in prompt id order);
- `state_dict()` / `load_state_dict()`: plain values, saved with every checkpoint.
Dynamic sampling is not a hook of one batch but the loop around them (`more`, `finish`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from dllm_rl.algo.auxiliary import AuxRows
from dllm_rl.buffer import Rows
from dllm_rl.curation import darts, dynamic_sampling, echo, greso, grpo_dropout, hindsight, sera
from dllm_rl.data.task import render_prompt
from dllm_rl.rollout.sampler import left_pad
from dllm_rl.errors import check_kwargs, check_types, require
from dllm_rl.seeds import derive_seed


@dataclass
class GroupRecord:
    """One prompt's group of a step, as every rank learns about it (plain data)."""

    prompt_id: int
    example_id: int
    rewards: list[float]
    correct: list[bool]
    external: int = 0  # kept external rows of the prompt (ERILS)
    changed: bool = False  # DARTS: the extra rollouts changed the kept set


def config_of(cls, options: dict[str, Any], name: str):
    check_kwargs(cls, options, f"curation.{name}")
    check_types(cls, options, f"curation.{name}")
    return cls(**options)


class Strategy:
    name = ""
    config_class: Any = None

    @classmethod
    def check(cls, options: dict[str, Any]):
        return config_of(cls.config_class, options, cls.name)

    @classmethod
    def build(cls, options: dict[str, Any], **context) -> Strategy:
        """The strategy from its options and the run's context (group_size, seed, pool_size, external, task,
        tokenizer), of which it takes what its `__init__` names."""
        wanted = inspect.signature(cls.__init__).parameters
        return cls(cls.check(options), **{k: v for k, v in context.items() if k in wanted})

    def allocate(self, step: int, drawn: list, counts: list[int]) -> list[int]:
        return counts

    def select(self, batch) -> None:
        pass

    def reweight(self, batch) -> None:
        pass

    def observe(self, records: list[GroupRecord]) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def epoch_of(prompt_id: int, pool_size: int) -> int:
    return prompt_id // pool_size


# ------------------------------------------------------------------------------------------ GRESO


class Greso(Strategy):
    """Skip a prompt before rollout with probability 1 - max(p^k, floor) (dllm_rl/curation/greso.py)."""

    name, config_class = "greso", greso.GresoConfig

    def __init__(self, config: greso.GresoConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False):
        self.config, self.seed, self.pool_size = config, seed, pool_size
        self.exempt = config.exempt_external and external
        self.p = {"easy": config.p_start, "hard": config.p_start}
        self.streak: dict[int, int] = {}  # example id -> flat visits in a row
        self.kind: dict[int, str] = {}  # example id -> the kind of its last flat group
        self.epochs: dict[int, list[int]] = {}  # epoch -> [groups, easy flat, hard flat] (adapted when it is over)
        self.skipped = 0

    def skip_probability(self, example_id: int) -> float:
        streak = self.streak.get(example_id, 0)
        return greso.skip_probability(streak, self.p[self.kind.get(example_id, "hard")], self.config.floor)

    def allocate(self, step: int, drawn: list, counts: list[int]) -> list[int]:
        if drawn:
            self.close_epochs(epoch_of(min(d.prompt_id for d in drawn), self.pool_size))
        out = []
        for d, n in zip(drawn, counts):
            uniform = derive_seed(self.seed, "greso", step, d.prompt_id) / 2**63
            skip = n > 0 and uniform < self.skip_probability(d.example_id)
            self.skipped += int(skip)
            out.append(0 if skip else n)
        return out

    def close_epochs(self, current: int) -> None:
        """Adapt p after every epoch before `current` (in order) from its share of flat groups."""
        c = self.config
        for epoch in sorted(e for e in self.epochs if e < current):
            groups, easy, hard = self.epochs.pop(epoch)
            for kind, flat, target in (("easy", easy, c.target * c.easy_share),
                                       ("hard", hard, c.target * (1 - c.easy_share))):
                self.p[kind] = greso.adapt(self.p[kind], flat / groups, target, c.step, c.p_min, c.p_max)

    def observe(self, records: list[GroupRecord]) -> None:
        for r in records:
            kind = greso.group_kind(r.correct, r.rewards)
            if self.exempt and r.external > 0:
                kind = "mixed"  # external rows gave the prompt a signal
            self.streak[r.example_id] = greso.next_streak(self.streak.get(r.example_id, 0), kind)
            if kind != "mixed":
                self.kind[r.example_id] = kind
            tally = self.epochs.setdefault(epoch_of(r.prompt_id, self.pool_size), [0, 0, 0])
            tally[0] += 1
            tally[1] += kind == "easy"
            tally[2] += kind == "hard"

    def metrics(self) -> dict[str, float]:
        out = {"curation/greso_p_easy": self.p["easy"], "curation/greso_p_hard": self.p["hard"],
               "curation/greso_skipped": float(self.skipped)}
        self.skipped = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"p": dict(self.p), "streak": dict(self.streak), "kind": dict(self.kind),
                "epochs": {e: list(v) for e, v in self.epochs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.p, self.streak, self.kind = dict(state["p"]), dict(state["streak"]), dict(state["kind"])
        self.epochs = {int(e): list(v) for e, v in state["epochs"].items()}


# ------------------------------------------------------------------------------------------ SERA


class Sera(Strategy):
    """Each prompt's group size from its success posterior, loss weight N0 / N_q (dllm_rl/curation/sera.py)."""

    name, config_class = "sera", sera.SeraConfig

    def __init__(self, config: sera.SeraConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False):
        self.config, self.group_size, self.pool_size = config, group_size, pool_size
        self.n_max = config.n_max if config.n_max is not None else 4 * group_size
        self.posterior: dict[int, tuple[float, float]] = {}  # example id -> (alpha, beta)
        self.pending: dict[int, dict[int, list[int]]] = {}  # epoch -> example id -> [successes, failures]
        self.inactive = 0

    def success_rate(self, example_id: int) -> float:
        alpha, beta = self.posterior.get(example_id, (self.config.prior, self.config.prior))
        return alpha / (alpha + beta)

    def close_epochs(self, current: int) -> None:
        for epoch in sorted(e for e in self.pending if e < current):
            for example_id, (s, f) in sorted(self.pending.pop(epoch).items()):
                alpha, beta = self.posterior.get(example_id, (self.config.prior, self.config.prior))
                self.posterior[example_id] = sera.posterior_update(alpha, beta, s, f, self.config.discount)

    def allocate(self, step: int, drawn: list, counts: list[int]) -> list[int]:
        if drawn:
            self.close_epochs(epoch_of(min(d.prompt_id for d in drawn), self.pool_size))
        p = [self.success_rate(d.example_id) for d in drawn]
        active = [i for i, n in enumerate(counts) if n > 0
                  and sera.mixed_chance(p[i], self.group_size) >= self.config.active_min]
        self.inactive += sum(1 for n in counts if n > 0) - len(active)
        budget = self.group_size * sum(1 for n in counts if n > 0)
        sizes = sera.allocate([p[i] for i in active], budget, self.config.n_min, self.n_max)
        out = [0] * len(drawn)
        for i, n in zip(active, sizes):
            out[i] = n
        return out

    def select(self, batch) -> None:
        on = batch.real("on_policy")
        if on is None:
            return
        sizes = torch.tensor(batch.group_sizes, dtype=torch.float32, device=on.ids_NL.device)
        weight_N = self.group_size / sizes[on.prompt_N]
        on.weight_N = weight_N if on.weight_N is None else on.weight_N * weight_N

    def observe(self, records: list[GroupRecord]) -> None:
        for r in records:
            tally = self.pending.setdefault(epoch_of(r.prompt_id, self.pool_size), {}).setdefault(r.example_id, [0, 0])
            tally[0] += sum(r.correct)
            tally[1] += len(r.correct) - sum(r.correct)

    def metrics(self) -> dict[str, float]:
        out = {"curation/sera_inactive": float(self.inactive)}
        self.inactive = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"posterior": {k: list(v) for k, v in self.posterior.items()},
                "pending": {e: {k: list(v) for k, v in d.items()} for e, d in self.pending.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.posterior = {int(k): tuple(v) for k, v in state["posterior"].items()}
        self.pending = {int(e): {int(k): list(v) for k, v in d.items()} for e, d in state["pending"].items()}


# ------------------------------------------------------------------------------------------ DARTS


class Darts(Strategy):
    """G + delta rollouts per prompt, the best G kept, delta adapted per prompt (dllm_rl/curation/darts.py)."""

    name, config_class = "darts", darts.DartsConfig

    def __init__(self, config: darts.DartsConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False):
        self.config, self.group_size = config, group_size
        self.delta: dict[int, int] = {}  # example id -> its extra rollouts

    def delta_of(self, example_id: int) -> int:
        return self.delta.get(example_id, self.config.delta)

    def allocate(self, step: int, drawn: list, counts: list[int]) -> list[int]:
        return [n + self.delta_of(d.example_id) if n > 0 else 0 for d, n in zip(drawn, counts)]

    def select(self, batch) -> None:
        on = batch.real("on_policy")
        if on is None:
            return
        c = self.config
        score_N = darts.scores(on.sampler_logp_NC.float(), on.mask_NC.float(), c.certainty_weight,
                               c.length_weight).tolist()
        keep_N = torch.zeros(len(on), dtype=torch.bool, device=on.ids_NL.device)
        prompts, rollouts = on.prompt_N.tolist(), on.rollout_N.tolist()
        for b in sorted(set(prompts)):
            rows = sorted((n for n in range(len(on)) if prompts[n] == b), key=lambda n: rollouts[n])
            kept = [rows[k] for k in darts.keep_best([score_N[n] for n in rows], self.group_size)]
            keep_N[kept] = True
            batch.darts_changed[batch.prompt_ids[b]] = any(rollouts[n] >= self.group_size for n in kept)
        batch.rows["on_policy"] = on.select(keep_N)

    def observe(self, records: list[GroupRecord]) -> None:
        c = self.config
        for r in records:
            self.delta[r.example_id] = darts.next_delta(self.delta_of(r.example_id), r.changed, c.delta_min,
                                                        c.delta_max)

    def metrics(self) -> dict[str, float]:
        mean = sum(self.delta.values()) / len(self.delta) if self.delta else float(self.config.delta)
        return {"curation/darts_delta": mean}  # over the prompts seen so far

    def state_dict(self) -> dict[str, Any]:
        return {"delta": dict(self.delta)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.delta = {int(k): int(v) for k, v in state["delta"].items()}


# ------------------------------------------------------------------------------------------ dynamic sampling


class DynamicSampling(Strategy):
    """Drop flat groups and draw more prompts until the step has B that teach (dllm_rl/curation/dynamic_sampling.py).
    Its decisions are the loop's (`Curation.more`, `Curation.finish`); it has no state between steps."""

    name, config_class = "dynamic_sampling", dynamic_sampling.DynamicSamplingConfig

    def __init__(self, config, *, group_size: int, seed: int, pool_size: int, external: bool = False):
        self.config = config


# ------------------------------------------------------------------------------------------ GRPODropout


class GrpoDropout(Strategy):
    """Drop the entropy-lowering positive rollouts of each on-policy group, recentre the rest
    (dllm_rl/curation/grpo_dropout.py)."""

    name, config_class = "grpo_dropout", grpo_dropout.GrpoDropoutConfig

    def __init__(self, config: grpo_dropout.GrpoDropoutConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False):
        self.config = config

    def reweight(self, batch) -> None:
        on = batch.real("on_policy")
        if on is None:
            batch.metrics.update({"curation/dropout_dropped": 0.0, "curation/dropout_positive": 0.0})
            return
        require(on.sampler_logp_NC is not None, "curation=grpo_dropout reads each rollout's surprisal from the "
                "sampler's record (Rows.sampler_logp_NC), and these on-policy rows have none")
        s_N = grpo_dropout.surprisal(on.sampler_logp_NC, on.mask_NC).cpu()
        adv_N = on.adv_N.detach().cpu().clone()  # the groups' decisions are taken in Python, row by row
        keep_N = torch.ones(len(on), dtype=torch.bool)  # cpu: beside adv_N and s_N, read back into Python
        for prompt in sorted(set(on.prompt_N.tolist())):
            rows = (on.prompt_N.cpu() == prompt).nonzero().squeeze(-1)
            keep_G = grpo_dropout.keep_mask(adv_N[rows], s_N[rows])
            if not bool(keep_G.all()):
                adv_N[rows] = grpo_dropout.recentred(adv_N[rows], s_N[rows], keep_G)
                keep_N[rows] = keep_G
        # this step's counts, in this step's metrics (summed over ranks: stages.COUNTS)
        batch.metrics.update({"curation/dropout_dropped": float((~keep_N).sum()),
                              "curation/dropout_positive": float((on.adv_N > 0).sum())})
        on.adv_N = adv_N.to(on.adv_N.device)
        keep = keep_N.to(on.adv_N.device, on.adv_N.dtype)
        on.weight_N = keep if on.weight_N is None else on.weight_N * keep


class Echo(Strategy):
    """EchoRL's echo clips: a prefix of a rollout of each all-correct group, up to its hardest denoising step,
    becomes an auxiliary masked-diffusion SFT row (dllm_rl/curation/echo.py); with `external`, a correct external
    row of a group whose on-policy rollouts all failed does too, whole."""

    name, config_class = "echo", echo.EchoConfig

    def __init__(self, config: echo.EchoConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False):
        self.config, self.seed = config, seed

    def reweight(self, batch) -> None:
        on, ext = batch.real("on_policy"), batch.real("external")
        picked: dict[str, tuple[Rows | None, list[tuple[int, torch.Tensor]]]] = {"echo": (on, []),
                                                                              "echo_external": (ext, [])}
        if on is not None:
            require(on.order_NC is not None and on.entropy_NC is not None, "curation=echo reads each rollout's "
                    "denoising steps and the entropy of its tokens from the sampler's record (Rows.order_NC, "
                    "Rows.entropy_NC), and these on-policy rows have none")
            for n in echo.all_correct_groups(on.prompt_N, [r.correct for r in on.rewards], on.rollout_N).values():
                clip_C = echo.clip_mask(on.order_NC[n], on.entropy_NC[n], on.mask_NC[n])
                if clip_C.any():
                    picked["echo"][1].append((n, clip_C))
        if self.config.external and ext is not None:
            failed = {p for p, ok in group_outcomes(on).items() if not ok} if on is not None else set()
            first: dict[int, int] = {}  # prompt -> its correct external row of the lowest rollout index
            for n, (p, r, k) in enumerate(zip(ext.prompt_N.tolist(), ext.rewards, ext.rollout_N.tolist())):
                if p in failed and r.correct and (p not in first or k < int(ext.rollout_N[first[p]])):
                    first[p] = n
            picked["echo_external"][1].extend((n, ext.mask_NC[n] != 0) for _, n in sorted(first.items()))
        for name, (rows, clips) in picked.items():
            batch.auxiliary[name] = self.aux_rows(name, rows, clips, batch.step) if clips else None
            batch.metrics[f"curation/{name}_clips"] = float(len(clips))
            batch.metrics[f"curation/{name}_tokens"] = float(sum(int(c.sum()) for _, c in clips))

    def aux_rows(self, name: str, rows: Rows, clips: list[tuple[int, torch.Tensor]], step: int) -> AuxRows:
        idx = torch.tensor([n for n, _ in clips], device=rows.ids_NL.device)
        seeds = [derive_seed(self.seed, name, step, *rows.keys[n]) for n, _ in clips]
        return AuxRows(name, rows.ids_NL[idx], rows.attention_mask_NL[idx], rows.prompt_length,
                       torch.stack([c for _, c in clips]), seeds, self.config.weight, self.config.weighting)


class Hindsight(Strategy):
    """Failed on-policy rollouts that exactly solve another problem the task could pose become auxiliary SFT rows
    of that problem (dllm_rl/curation/hindsight.py)."""

    name, config_class = "hindsight", hindsight.HindsightConfig

    def __init__(self, config: hindsight.HindsightConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False, task=None, tokenizer=None):
        hindsight.check_task(task)
        require(tokenizer is not None, "curation=hindsight renders relabelled prompts: it needs the dLLM's tokenizer")
        self.config, self.seed, self.task, self.tokenizer = config, seed, task, tokenizer

    def reweight(self, batch) -> None:
        on = batch.real("on_policy")
        found: list[tuple[int, str]] = []  # (row, relabelled prompt text)
        per_prompt: dict[int, int] = {}
        order = [] if on is None else sorted(range(len(on)), key=lambda n: on.keys[n])
        for n in order:
            b = int(on.prompt_N[n])
            if on.rewards[n].correct or per_prompt.get(b, 0) >= self.config.per_prompt:
                continue
            other = hindsight.relabelled(self.task, on.texts[n], batch.examples[b])
            if other is not None:
                per_prompt[b] = per_prompt.get(b, 0) + 1
                found.append((n, render_prompt(self.task.prompt(other), self.tokenizer)))
        batch.auxiliary["hindsight"] = self.aux_rows(on, found, batch.step) if found else None
        batch.metrics["curation/hindsight_rows"] = float(len(found))
        batch.metrics["curation/hindsight_failed"] = float(0 if on is None else sum(not r.correct for r in on.rewards))

    def aux_rows(self, on: Rows, found: list[tuple[int, str]], step: int) -> AuxRows:
        """The relabelled prompts, left-padded, before the rollouts' own windows; the counted tokens are the targets."""
        device = on.ids_NL.device
        idx = torch.tensor([n for n, _ in found], device=device)
        encoded = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for _, text in found]
        ids_NP, mask_NP = left_pad(encoded, self.tokenizer.pad_token_id, device)
        window_NC = on.ids_NL[idx, on.prompt_length:]
        seeds = [derive_seed(self.seed, "hindsight", step, *on.keys[n]) for n, _ in found]
        return AuxRows("hindsight", torch.cat([ids_NP, window_NC], 1), torch.cat([mask_NP, torch.ones_like(window_NC)], 1),
                       ids_NP.shape[1], on.mask_NC[idx] != 0, seeds, self.config.weight, self.config.weighting)


def group_outcomes(rows: Rows) -> dict[int, bool]:
    """prompt -> whether any of its rows is correct."""
    out: dict[int, bool] = {}
    for p, r in zip(rows.prompt_N.tolist(), rows.rewards):
        out[p] = out.get(p, False) or r.correct
    return out


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (Greso, DynamicSampling, Sera, Darts, GrpoDropout, Echo,
                                                             Hindsight)}


# ------------------------------------------------------------------------------------------ the step's view


class Curation:
    """The chosen strategies, composed, as the step sees them. With none, every drawn prompt gets `group_size`
    rollouts and nothing else happens."""

    def __init__(self, strategies: list[Strategy], *, group_size: int, prompts_per_step: int):
        self.strategies, self.group_size, self.prompts_per_step = strategies, group_size, prompts_per_step
        self.dynamic = next((s for s in strategies if isinstance(s, DynamicSampling)), None)
        darts_on = next((s for s in strategies if isinstance(s, Darts)), None)
        self.per_prompt_max = group_size + (darts_on.config.delta_max if darts_on else 0)
        self.counters: dict[str, float] = {}

    @property
    def on(self) -> bool:
        return bool(self.strategies)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.strategies]

    def begin(self) -> None:
        self.counters = {"prompts_drawn": 0.0, "prompts_skipped": 0.0, "rollouts_generated": 0.0, "rounds": 0.0,
                         "rows_dropped": 0.0}

    def allocate(self, step: int, drawn: list) -> list[int]:
        counts = [self.group_size] * len(drawn)
        for s in self.strategies:
            counts = s.allocate(step, drawn, counts)
        self.counters["prompts_drawn"] += len(drawn)
        self.counters["prompts_skipped"] += sum(1 for n in counts if n == 0)
        self.counters["rollouts_generated"] += sum(counts)
        self.counters["rounds"] += 1
        return counts

    def reweight(self, batch) -> None:
        for s in self.strategies:
            s.reweight(batch)

    def select(self, batch) -> None:
        before = len(batch.real("on_policy") or [])
        for s in self.strategies:
            s.select(batch)
        self.counters["rows_dropped"] += before - len(batch.real("on_policy") or [])

    def more(self, informative: list[tuple[int, bool]]) -> int:
        """Prompts the next round draws (dynamic sampling; 0 without it): `informative` is every rank's groups so
        far as (prompt id, rewards differ)."""
        if self.dynamic is None or self.counters["rounds"] >= self.dynamic.config.max_rounds:
            return 0
        kept = sum(ok for _, ok in informative)
        budget = self.prompts_per_step * self.group_size + self.dynamic.config.max_extra
        return dynamic_sampling.next_round(kept, self.prompts_per_step, int(self.counters["rollouts_generated"]),
                                           budget, self.per_prompt_max, self.dynamic.config.oversample)

    def keep(self, informative: list[tuple[int, bool]]) -> set[int] | None:
        """The prompt ids whose groups stay (dynamic sampling), or None (all stay)."""
        if self.dynamic is None:
            return None
        return dynamic_sampling.groups_to_keep(informative, self.prompts_per_step)

    def observe(self, records: list[GroupRecord]) -> None:
        for s in self.strategies:
            s.observe(sorted(records, key=lambda r: r.prompt_id))

    def metrics(self) -> dict[str, float]:
        """What curation did this step (the same on every rank)."""
        if not self.on:
            return {}
        c = self.counters
        out = {f"curation/{k}": v for k, v in c.items()}
        out["curation/rollouts_saved"] = self.prompts_per_step * self.group_size - c["rollouts_generated"]
        for s in self.strategies:
            out.update(s.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {s.name: s.state_dict() for s in self.strategies}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        for s in self.strategies:
            if state and s.name in state:
                s.load_state_dict(state[s.name])
