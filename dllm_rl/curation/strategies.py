"""The curation strategies that decide before generating (GRESO, SERA, DARTS, dynamic sampling) and `Curation`,
the composed strategies as the step sees them (hooks: dllm_rl/curation/base.py; after the advantages:
dllm_rl/curation/teach.py)."""

from __future__ import annotations

import dataclasses

from typing import Any

import torch

from dllm_rl.curation import darts, dynamic_sampling, greso, sera
from dllm_rl.curation.base import GroupRecord, Strategy, epoch_of
from dllm_rl.curation.teach import Bandit, Echo, GrpoDropout, Hindsight
from dllm_rl.seeds import derive_seed

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
        self.closed_at: int | None = None  # the step whose first round last closed epochs

    def skip_probability(self, example_id: int) -> float:
        streak = self.streak.get(example_id, 0)
        return greso.skip_probability(streak, self.p[self.kind.get(example_id, "hard")], self.config.floor)

    def allocate(self, step: int, drawn: list, counts: list[int]) -> list[int]:
        # epochs close at a step's first round only: a later round (dynamic sampling) may draw from the next
        # epoch before this step's groups of the current one are observed
        if drawn and step != self.closed_at:
            self.closed_at = step
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
            kind = greso.group_kind(r.correct, self.config.easy_mean, self.config.hard_mean)
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
        self.asleep: dict[int, int] = {}  # example id -> its inactive visits in a row
        self.inactive = self.revived = 0

    def success_rate(self, example_id: int) -> float:
        alpha, beta = self.posterior.get(example_id, (self.config.prior, self.config.prior))
        return alpha / (alpha + beta)

    def close_epochs(self, current: int) -> None:
        """Every epoch before `current` that had groups: each prompt's evidence discounted (observed in it or
        not: a prompt left out drifts back toward the prior), then the epoch's outcomes added."""
        for epoch in sorted(e for e in self.pending if e < current):
            tallies = self.pending.pop(epoch)
            for example_id in sorted(set(self.posterior) | set(tallies)):
                s, f = tallies.get(example_id, (0, 0))
                alpha, beta = self.posterior.get(example_id, (self.config.prior, self.config.prior))
                self.posterior[example_id] = sera.posterior_update(alpha, beta, s, f, self.config.discount,
                                                                   self.config.prior)

    def allocate(self, step: int, drawn: list, counts: list[int]) -> list[int]:
        if drawn:  # SERA never has a second round: dynamic sampling is refused beside it
            self.close_epochs(epoch_of(min(d.prompt_id for d in drawn), self.pool_size))
        p = [self.success_rate(d.example_id) for d in drawn]
        asked = [i for i, n in enumerate(counts) if n > 0]
        active = []
        for i in asked:
            key = drawn[i].example_id
            if sera.mixed_chance(p[i], self.n_max) >= self.config.active_min:
                self.asleep.pop(key, None)
                active.append(i)
            elif self.asleep.get(key, 0) + 1 >= self.config.revisit_every:
                self.asleep.pop(key, None)  # revisited: observed again, whatever its posterior says
                self.revived += 1
                active.append(i)
            else:
                self.asleep[key] = self.asleep.get(key, 0) + 1
        if asked and not active:  # no prompt of the step is active: all are, so the budget is spent
            self.revived += len(asked)
            for i in asked:
                self.asleep.pop(drawn[i].example_id, None)
            active = asked
        self.inactive += len(asked) - len(active)
        budget = self.group_size * len(asked)
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
        on.weigh("sera", self.group_size / sizes[on.prompt_N])

    def observe(self, records: list[GroupRecord]) -> None:
        for r in records:
            tally = self.pending.setdefault(epoch_of(r.prompt_id, self.pool_size), {}).setdefault(r.example_id, [0, 0])
            tally[0] += sum(r.correct)
            tally[1] += len(r.correct) - sum(r.correct)

    def metrics(self) -> dict[str, float]:
        out = {"curation/sera_inactive": float(self.inactive), "curation/sera_revived": float(self.revived)}
        self.inactive = self.revived = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"posterior": {k: list(v) for k, v in self.posterior.items()},
                "pending": {e: {k: list(v) for k, v in d.items()} for e, d in self.pending.items()},
                "asleep": dict(self.asleep)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.posterior = {int(k): tuple(v) for k, v in state["posterior"].items()}
        self.pending = {int(e): {int(k): list(v) for k, v in d.items()} for e, d in state["pending"].items()}
        self.asleep = {int(k): int(v) for k, v in state.get("asleep", {}).items()}


# ------------------------------------------------------------------------------------------ DARTS


class Darts(Strategy):
    """G + delta rollouts per prompt, the best G kept, delta adapted per prompt (dllm_rl/curation/darts.py)."""

    name, config_class = "darts", darts.DartsConfig

    def __init__(self, config: darts.DartsConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False):
        self.config, self.group_size = config, group_size
        self.delta: dict[int, int] = {}  # example id -> its extra rollouts
        self.changed: dict[int, bool] = {}  # this step's prompt ids (this rank's) -> the extras changed the kept set

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
            self.changed[batch.prompt_ids[b]] = any(rollouts[n] >= self.group_size for n in kept)
        batch.rows["on_policy"] = on.select(keep_N)

    def annotate(self, records: list[GroupRecord]) -> list[GroupRecord]:
        changed, self.changed = self.changed, {}  # the step's, this rank's: gathered with the records
        return [dataclasses.replace(r, changed=changed.get(r.prompt_id, False)) for r in records]

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



STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (Greso, DynamicSampling, Sera, Darts, GrpoDropout, Echo,
                                                             Hindsight, Bandit)}


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

    def annotate(self, records: list[GroupRecord]) -> list[GroupRecord]:
        """This rank's groups of the step with what the strategies noted about them (their own state), before
        every rank's are gathered for `observe`."""
        for s in self.strategies:
            records = s.annotate(records)
        return records

    def observe(self, records: list[GroupRecord]) -> None:
        for s in self.strategies:
            s.observe(sorted(records, key=lambda r: r.prompt_id))

    def after_update(self, batch) -> None:
        for s in self.strategies:
            s.after_update(batch)

    @property
    def replays(self) -> bool:
        """Whether a strategy picks replayed rows (the "replay" source, dllm_rl/curation/replay.py) for the step."""
        return any(isinstance(s, Bandit) for s in self.strategies)

    def replayed(self) -> list[dict]:
        """The replay buffer entries picked for this step (by `reweight`), in the same order on every rank."""
        return [e for s in self.strategies if isinstance(s, Bandit) for e in s.replayed]

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
