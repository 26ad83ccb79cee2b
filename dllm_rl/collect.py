"""The step's batch, and how its on-policy rollouts are collected: choose prompts -> (curation: allocate) ->
generate -> (curation: select) -> verify, in rounds where dynamic sampling asks for more (`CollectRollouts`);
then, after the external rows, `observe_curation` gives the curation strategies every rank's groups.

Rows are keyed by (the global id of their prompt, their index among its rollouts), never by position: a prompt
may get any number of rollouts (0 leaves it out of the step) and a filter may drop any rows (`Rows.select`).
The later stages are in `dllm_rl/stages.py`, whose docstring has the table of all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable

import torch

from dllm_rl.algo.auxiliary import AuxRows
from dllm_rl.buffer import Rows, concat_rows
from dllm_rl.curation import Curation, GroupRecord
from dllm_rl.data.task import Example, Reward, Task, render_prompt, train_examples_up_to
from dllm_rl.data_parallel import DataParallel
from dllm_rl.engine import Engine
from dllm_rl.errors import require
from dllm_rl.likelihood.estimators import Estimator
from dllm_rl.rollout.diversity import distinct_share, pairwise_agreement
from dllm_rl.rollout.sampler import completion_mask, completion_texts
from dllm_rl.seeds import derive_seed


@dataclass
class StepBatch:
    """What flows between the stages of one step, on one rank. Each field has one writer (`dllm_rl.step.OWNERS`):
    the collect stage the prompts, the on-policy rows and the visits; the external, replay and reweight stages
    their rows; every stage its own keys of `metrics`."""

    step: int
    examples: list[Example]  # this rank's prompts
    prompt_texts: list[str]  # as the dLLM reads them (chat template applied)
    prompt_ids: list[int]  # each prompt's global id (`Drawn.prompt_id`): what its rows are keyed by
    group_sizes: list[int]  # on-policy rollouts asked for each prompt (a row filter may keep fewer)
    example_ids: list[int] = field(default_factory=list)  # each prompt's index in the train pool (`Drawn`)
    template: str = ""  # a prompt text of the step: a rank with no prompts makes its stand-in row from it
    rows: dict[str, Rows] = field(default_factory=dict)  # per source: "on_policy" first, "external", "replay"
    metrics: dict[str, float] = field(default_factory=dict)  # what the stages measured (external/*, ...)
    visits: list[GroupRecord] = field(default_factory=list)  # every group this rank generated (curation learns)
    # auxiliary SFT rows by kind (echo clips): a kind a strategy makes is here on every rank, None where it has none
    auxiliary: dict[str, AuxRows | None] = field(default_factory=dict)
    episodes: list = field(default_factory=list)  # a multi-turn step's episodes, one per group member (dllm_rl/envs/)
    external_episodes: list = field(default_factory=list)  # and the external policy's kept ones (ERILS)

    def real(self, source: str) -> Rows | None:
        """A source's rows, or None where this rank has none (or only a data-parallel stand-in)."""
        rows = self.rows.get(source)
        return None if rows is None or rows.inert else rows


# ------------------------------------------------------------------------------------------ choose prompts


@dataclass(frozen=True)
class Drawn:
    """One of the step's prompts, as every rank draws it."""

    prompt_id: int  # its position in the run's stream of prompts: unique in a run; keys its rows and seeds
    example_id: int  # its index in the train pool: the same example in every epoch (what curation remembers)
    example: Example


class PromptSource:
    """The step's prompts: the train split's first `pool` examples (all of a smaller split) in a fresh seeded
    order every epoch; `batch` gives this rank its whole groups of them. `position` (prompts drawn) is its state
    (saved with checkpoints), with `skip`: prompt ids beyond it already trained on, which a checkpoint of
    asynchronous rollouts may hold (dllm_rl/workers/pipelined.py) and a synchronous resume of it never draws."""

    def __init__(self, task: Task, tokenizer, dp: DataParallel, per_step: int, pool: int, seed: int,
                 position: int = 0, skip: Iterable[int] = ()):
        self.examples = train_examples_up_to(task, pool, seed)  # a small train file: all of it
        self.task, self.tokenizer, self.dp, self.per_step = task, tokenizer, dp, per_step
        self.seed, self.position, self.skip = seed, position, set(skip)

    def draw(self, count: int) -> list[Drawn]:
        """The next `count` prompts of the stream (the same on every rank), passing over `skip`."""
        out = []
        while len(out) < count:
            epoch, index = divmod(self.position, len(self.examples))
            order = list(range(len(self.examples)))
            random.Random(f"{self.seed}|epoch{epoch}").shuffle(order)
            if self.position not in self.skip:
                out.append(Drawn(self.position, order[index], self.examples[order[index]]))
            self.position += 1
        return out

    def trained_after(self) -> list[int]:
        """The prompt ids beyond `position` trained on already (saved with checkpoints beside it)."""
        return sorted(q for q in self.skip if q >= self.position)

    def __call__(self, step: int) -> list[Drawn]:
        return self.draw(self.per_step)

    def batch(self, step: int, drawn: list[Drawn], counts: list[int]) -> StepBatch:
        """This rank's part of the step: its run of the prompts that get rollouts (`counts` per drawn prompt;
        0 leaves one out), balanced over ranks by rollouts (`DataParallel.assign`)."""
        require(len(counts) == len(drawn), f"{len(counts)} rollout counts for {len(drawn)} prompts")
        kept = [(d, n) for d, n in zip(drawn, counts) if n > 0]
        mine = [kept[i] for i in self.dp.assign([n for _, n in kept])]
        render = lambda ex: render_prompt(self.task.prompt(ex), self.tokenizer)  # noqa: E731
        return StepBatch(step, [d.example for d, _ in mine], [render(d.example) for d, _ in mine],
                         [d.prompt_id for d, _ in mine], [n for _, n in mine], [d.example_id for d, _ in mine],
                         template=render(drawn[0].example) if drawn else "")


# ------------------------------------------------------------------------------------------ generate, verify


@contextlib.contextmanager
def eval_mode(network: torch.nn.Module):
    """`network` in eval mode for the duration (no dropout), back in the mode it was in after."""
    was_training = network.training
    network.eval()
    try:
        yield
    finally:
        network.train(was_training)


@contextlib.contextmanager
def inference(net: torch.nn.Module, engine: Engine, autocast: ContextManager):
    """Eval mode, autocast and (ZeRO-3) the full parameters for the duration: how the policy generates."""
    net.eval()
    try:
        with autocast, engine.gathered():
            yield
    finally:
        net.train()


@dataclass
class InProcessRollouts:
    """Each prompt's rollouts (`StepBatch.group_sizes`) from the current policy, sampled in this process.
    Rollout g of the prompt with global id q draws from seed (seed, "rollout", step, q, g): not from the rank,
    the batch, or how many rollouts other prompts get. A rank with no prompts returns a stand-in row."""

    generator: Any  # a TextGenerator over the policy: sample(prompts, seeds) -> Samples
    estimator: Estimator
    seed: int
    inference: Callable[[], ContextManager]

    def __call__(self, batch: StepBatch) -> Rows:
        keys = rollout_keys(batch)
        with self.inference():  # at ZeRO-3 a collective (the parameter gather): a rank without prompts joins too
            if not keys:
                return self.stand_in(batch)
            samples = self.generator.sample([batch.prompt_texts[b] for b, _, _ in keys], self.seeds(batch, keys))
        rows = self.rows_of(samples, keys, version=batch.step)
        batch.metrics.update(rollout_metrics(rows, float(samples.forwards)))
        return rows

    def seeds(self, batch: StepBatch, keys: list[tuple[int, int, int]]) -> list[int]:
        """Each rollout's seed: (seed, "rollout", step, prompt id, rollout index)."""
        return [derive_seed(self.seed, "rollout", batch.step, q, g) for _, q, g in keys]

    def rows_of(self, samples, keys: list[tuple[int, int, int]], version: int) -> Rows:
        """The on-policy rows of `samples`, rollout i being `keys[i]` = (batch index, prompt id, rollout index)."""
        tokenizer, eos_id = self.generator.tokenizer, self.generator.eos_id
        device = samples.sequences_BL.device
        return Rows("on_policy", samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length,
                    completion_mask(samples.completion_BC, eos_id), samples.unmask_step_BC,
                    torch.tensor([b for b, _, _ in keys], device=device), [],
                    completion_texts(tokenizer, samples.completion_BC, eos_id), version=version,
                    estimator=self.estimator, sampler_logp_NC=samples.logp_BC, entropy_NC=samples.entropy_BC,
                    prompt_id_N=torch.tensor([q for _, q, _ in keys], device=device),
                    rollout_N=torch.tensor([g for _, _, g in keys], device=device))

    def stand_in(self, batch: StepBatch) -> Rows:
        """One on-policy row that counts for nothing (the step's template prompt, a window of EOS): what a rank
        that got no prompts takes every stage's calls with (ZeRO-3's forwards are collective)."""
        eos_id, C = self.generator.eos_id, self.generator.gen_length
        ids_P, mask_P = self.generator.encode([batch.template], [0])[:2]
        window_C = torch.full((1, C), eos_id, dtype=torch.long, device=ids_P.device)
        zeros = torch.zeros(1, C, device=ids_P.device)
        return Rows("on_policy", torch.cat([ids_P, window_C], 1), torch.cat([mask_P, torch.ones_like(window_C)], 1),
                    ids_P.shape[1], zeros, torch.zeros_like(window_C), torch.zeros(1, dtype=torch.long,
                    device=ids_P.device), [Reward(0.0, False, False, "stand-in")], [""], version=batch.step,
                    estimator=self.estimator, sampler_logp_NC=zeros.clone(), entropy_NC=zeros.clone(),
                    adv_N=zeros[:, 0].clone(),
                    weight_N=zeros[:, 0].clone(), inert=True,
                    prompt_id_N=torch.full((1,), -1, device=ids_P.device), rollout_N=torch.zeros(1, dtype=torch.long,
                    device=ids_P.device))


def rollout_keys(batch: StepBatch) -> list[tuple[int, int, int]]:
    """(batch index, prompt id, rollout index) of every rollout the batch asks for, prompt by prompt."""
    return [(b, q, g) for b, (q, n) in enumerate(zip(batch.prompt_ids, batch.group_sizes)) for g in range(n)]


def rollout_metrics(rows: Rows, forwards: float) -> dict[str, float]:
    """rollout/forwards (the sampler's), the groups' diversity (distinct completions, pairwise agreement) and
    `policy/entropy`: the mean, over the scored completion tokens, of the entropy (nats) of the distribution each
    token was committed from, as the sampler recorded it (at temperature 1, the mask token excluded): what the
    exploration claims (GRPODropout's, fast decoding's in RL) are read from."""
    completion_NC = rows.ids_NL[:, rows.prompt_length:]
    out = {"rollout/forwards": forwards, "rollout/distinct": distinct_share(completion_NC, rows.prompt_N),
           "rollout/agreement": pairwise_agreement(completion_NC, rows.prompt_N)}
    if rows.entropy_NC is not None:
        out["policy/entropy"] = float((rows.entropy_NC * rows.mask_NC).sum() / rows.mask_NC.sum().clamp(min=1))
    return out


def verify(batch: StepBatch, task: Task) -> None:
    """The task's verifiable reward of every row that has none yet."""
    for rows in batch.rows.values():
        if not rows.rewards and not rows.inert:
            rows.rewards = [task.reward(text, batch.examples[int(p)]) for text, p in zip(rows.texts, rows.prompt_N)]


def group_records(batch: StepBatch) -> list[GroupRecord]:
    """One record per prompt of the batch that has on-policy rows: what curation learns from."""
    on = batch.real("on_policy")
    if on is None:
        return []
    prompts = on.prompt_N.tolist()
    return [GroupRecord(batch.prompt_ids[b], batch.example_ids[b] if batch.example_ids else batch.prompt_ids[b],
                        [on.rewards[n].score for n in range(len(on)) if prompts[n] == b],
                        [on.rewards[n].correct for n in range(len(on)) if prompts[n] == b])
            for b in sorted(set(prompts))]


def merge_batches(first: StepBatch, later: StepBatch, pad_id: int) -> StepBatch:
    """Two generation rounds of one step (dynamic sampling) as one batch: the prompts one after the other, the
    on-policy rows of both (prompts re-padded to the wider round), rollout metrics over both."""
    offset = len(first.examples)
    mine, theirs = first.real("on_policy"), later.real("on_policy")
    if theirs is not None:
        theirs.prompt_N = theirs.prompt_N + offset
    parts = [r for r in (mine, theirs) if r is not None]
    rows = concat_rows(parts, pad_id) if parts else first.rows["on_policy"]
    n1, n2 = len(mine or []), len(theirs or [])
    metrics = dict(first.metrics)
    for key, value in later.metrics.items():
        if key in ("rollout/forwards", "rollout/publish_s") or (key.startswith("pool/") and key.endswith("/rollouts")):
            metrics[key] = metrics.get(key, 0.0) + value  # counts and seconds of the step: both rounds'
        elif key in metrics and n1 + n2 > 0:  # a mean over rows (diversity): weighted by each round's rows
            metrics[key] = (metrics[key] * n1 + value * n2) / (n1 + n2)
        else:
            metrics[key] = value
    return StepBatch(first.step, first.examples + later.examples, first.prompt_texts + later.prompt_texts,
                     first.prompt_ids + later.prompt_ids, first.group_sizes + later.group_sizes,
                     first.example_ids + later.example_ids, first.template, {"on_policy": rows}, metrics,
                     first.visits + later.visits)


@dataclass
class CollectRollouts:
    """Choose prompts, allocate their rollouts, generate, select and verify: one round, or (dynamic sampling)
    rounds until the step has its groups that teach. Every decision is taken alike on every rank (the curation
    strategies' allocations are functions of the drawn prompts; dynamic sampling's from every rank's groups)."""

    prompts: PromptSource
    rollouts: InProcessRollouts
    task: Task
    curation: Curation
    dp: DataParallel
    pad_id: int
    # called with each round's prompts before they are generated (ERILS's served source starts its requests)
    before_generate: Callable[[StepBatch], None] | None = None

    def __call__(self, step: int) -> StepBatch:
        cur = self.curation
        cur.begin()
        drawn, batch = self.prompts(step), None
        while drawn:
            part = self.prompts.batch(step, drawn, cur.allocate(step, drawn))
            if self.before_generate is not None:
                self.before_generate(part)
            part.rows["on_policy"] = self.rollouts(part)
            cur.select(part)
            verify(part, self.task)
            part.visits = group_records(part)
            batch = part if batch is None else merge_batches(batch, part, self.pad_id)
            informative = self.informative(batch) if cur.dynamic is not None else []
            drawn = self.prompts.draw(cur.more(informative))
        keep = cur.keep(self.informative(batch)) if cur.dynamic is not None else None
        if keep is not None:
            self.keep_groups(batch, keep)
        if cur.on:
            batch.metrics.update(cur.metrics())
        return batch

    def informative(self, batch: StepBatch) -> list[tuple[int, bool]]:
        """(prompt id, rewards differ) of every rank's groups so far, in prompt id order."""
        mine = [(v.prompt_id, len(set(v.rewards)) > 1) for v in batch.visits]
        return sorted(x for part in self.dp.gather_objects(mine) for x in part)

    def keep_groups(self, batch: StepBatch, keep: set[int]) -> None:
        on = batch.real("on_policy")
        if on is None:
            return
        keep_N = torch.tensor([q in keep for q in on.prompt_id_N.tolist()], dtype=torch.bool,
                              device=on.ids_NL.device)
        self.curation.counters["rows_dropped"] += len(on) - int(keep_N.sum())
        batch.rows["on_policy"] = on.select(keep_N) if bool(keep_N.any()) else self.rollouts.stand_in(batch)


def observe_curation(batch: StepBatch, curation: Curation, dp: DataParallel) -> None:
    """After the external rows: every rank's groups of the step (with their kept external rows) to the
    curation strategies, which update their state alike on every rank."""
    if not curation.on:
        return
    ext = batch.real("external")
    external = {} if ext is None else {q: ext.prompt_id_N.tolist().count(q) for q in set(ext.prompt_id_N.tolist())}
    mine = curation.annotate([dataclasses.replace(v, external=external.get(v.prompt_id, 0)) for v in batch.visits])
    curation.observe([record for part in dp.gather_objects(mine) for record in part])
