"""The strategies that decide which rollouts teach, after the advantages (`reweight`): GRPODropout, EchoRL's echo
clips, hindsight relabelling, and the contextual rollout bandit with replay (see dllm_rl/curation/__init__.py)."""

from __future__ import annotations

import torch

from dllm_rl.algo.auxiliary import AuxRows
from dllm_rl.buffer import Rows
from dllm_rl.curation import bandit, echo, grpo_dropout, hindsight
from dllm_rl.curation.replay import clip_of, entry_of
from dllm_rl.curation.base import Strategy
from dllm_rl.data.task import render_prompt
from dllm_rl.errors import require
from dllm_rl.rollout.sampler import left_pad
from dllm_rl.seeds import derive_seed


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
        on.weigh("dropout", keep)


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
        return AuxRows("hindsight", torch.cat([ids_NP, window_NC], 1),
                       torch.cat([mask_NP, torch.ones_like(window_NC)], 1),
                       ids_NP.shape[1], on.mask_NC[idx] != 0, seeds, self.config.weight, self.config.weighting)


def group_outcomes(rows: Rows) -> dict[int, bool]:
    """prompt -> whether any of its rows is correct."""
    out: dict[int, bool] = {}
    for p, r in zip(rows.prompt_N.tolist(), rows.rewards):
        out[p] = out.get(p, False) or r.correct
    return out



class Bandit(Strategy):
    """The contextual rollout bandit with replay (dllm_rl/curation/bandit.py). Its decisions are global: every
    rank gathers every rank's candidates and takes the same choice; the replay buffer is the same on every rank
    (gathered after each update). It decides; the replay stage (`dllm_rl.curation.replay.ReplaySource`) turns
    the picked buffer entries (`replayed`) into the step's "replay" rows."""

    name, config_class = "bandit", bandit.BanditConfig

    def __init__(self, config: bandit.BanditConfig, *, group_size: int, seed: int, pool_size: int,
                 external: bool = False, dp=None, probe=None):
        require(probe is not None, "curation=bandit needs the trainer's held-out probe")
        self.config, self.probe = config, probe
        self.gather = (lambda obj: [obj]) if dp is None else dp.gather_objects
        self.scorer = bandit.LinearScorer(len(bandit.FEATURES), config.ridge,
                                          config.alpha if config.scorer == "ucb" else 0.0)
        self.buffer: list[dict] = []  # plain entries (`replay.entry_of`), key order, the same on every rank
        self.last_probe: float | None = None
        # the step's decision, until its update is done: the picks' features (their reward is the probe's change),
        # their keys, the buffer entries picked for replay (global order), this rank's rows dropped before the bandit
        self.picked: list[list[float]] = []
        self.picked_keys: set[tuple[str, tuple[int, int]]] = set()
        self.replayed: list[dict] = []
        self.dropped: set[tuple[str, tuple[int, int]]] = set()

    def reweight(self, batch) -> None:
        if self.last_probe is None:  # before the first update (and after a resume, from the checkpoint)
            self.last_probe = self.probe()
        # a row an earlier strategy dropped (weight 0: GRPODropout) is neither a candidate nor kept for replay
        self.dropped = {(rows.source, key) for source in ("on_policy", "external") for rows in [batch.real(source)]
                        if rows is not None and rows.weight_N is not None
                        for key, w in zip(rows.keys, rows.weight_N.tolist()) if w == 0}
        mine = [self.candidate(rows, n, batch.step) for source in ("on_policy", "external")
                for rows in [batch.real(source)] if rows is not None for n in range(len(rows))
                if (source, rows.keys[n]) not in self.dropped]
        current = sorted((c for part in self.gather(mine) for c in part), key=lambda c: (c.source, c.key))
        replay = [self.replay_candidate(e, batch.step) for e in self.buffer]
        candidates = current + replay
        count = min(self.config.rows or len(current), len(candidates))
        picked = bandit.select(candidates, self.scorer.scores([c.features for c in candidates]), count,
                               self.config.entropy_guard)
        self.picked = [candidates[i].features for i in picked]
        self.picked_keys = {(candidates[i].source, candidates[i].key) for i in picked}
        for source in ("on_policy", "external"):
            rows = batch.real(source)
            if rows is not None:
                keep_N = torch.tensor([(source, key) in self.picked_keys for key in rows.keys],
                                      device=rows.ids_NL.device, dtype=torch.float32)
                rows.weigh("bandit", keep_N)
        self.replayed = [self.buffer[i - len(current)] for i in picked if i >= len(current)]
        batch.metrics.update({"curation/bandit_picked": float(len(picked)),
                              "curation/bandit_replayed": float(len(self.replayed)),
                              "curation/bandit_left_out": float(len(current) - (len(picked) - len(self.replayed))),
                              "curation/bandit_age_mean": sum(batch.step - e["version"] for e in self.replayed)
                              / max(len(self.replayed), 1)})

    def candidate(self, rows: Rows, n: int, step: int) -> bandit.Candidate:
        counted = rows.mask_NC[n] != 0
        entropy = (0.0 if rows.entropy_NC is None
                   else float(rows.entropy_NC[n][counted].mean()) if counted.any() else 0.0)
        return bandit.Candidate(rows.source, rows.keys[n], bandit.features(
            age=0, max_age=self.config.max_age, uses=0, external=rows.source == "external",
            reward=rows.rewards[n].score, advantage=float(rows.adv_N[n]),
            length=float(counted.sum()) / rows.mask_NC.shape[1], entropy=entropy, clip=0.0), entropy)

    def replay_candidate(self, e: dict, step: int) -> bandit.Candidate:
        counted = [h for h, m in zip(e["entropy"], e["mask"]) if m]
        entropy = sum(counted) / len(counted) if counted else 0.0
        return bandit.Candidate("replay", tuple(e["key"]), bandit.features(
            age=step - e["version"], max_age=self.config.max_age, uses=e["uses"], external=False,
            reward=e["reward"][0], advantage=e["adv"], length=sum(e["mask"]) / len(e["mask"]), entropy=entropy,
            clip=e["clip"]), entropy)

    def after_update(self, batch) -> None:
        """The probe's change is the reward of the step's picks; then the buffer takes the step's on-policy rows
        (gathered from every rank) and the replayed rows' new use counts and clip fractions."""
        probe = self.probe()
        reward, self.last_probe = probe - self.last_probe, probe
        self.scorer.update(self.picked, reward)
        on, replay = batch.real("on_policy"), batch.real("replay")
        new = [] if on is None else [entry_of(on, n, (("on_policy", on.keys[n]) in self.picked_keys))
                                     for n in range(len(on)) if ("on_policy", on.keys[n]) not in self.dropped]
        used = {} if replay is None else {tuple(k): clip_of(replay, n) for n, k in enumerate(replay.keys)}
        parts = self.gather((new, used))
        updates = {k: c for _, u in parts for k, c in u.items()}
        for e in self.buffer:
            if tuple(e["key"]) in updates:
                e["uses"], e["clip"] = e["uses"] + 1, updates[tuple(e["key"])]
        fresh = [e for n, _ in parts for e in n]
        self.buffer = bandit.kept(self.buffer + fresh, batch.step, self.config.capacity, self.config.max_age)
        batch.metrics.update({"curation/bandit_probe": probe, "curation/bandit_reward": reward,
                              "curation/bandit_buffer": float(len(self.buffer))})

    def state_dict(self) -> dict:
        return {"scorer": self.scorer.state_dict(), "buffer": self.buffer, "last_probe": self.last_probe}

    def load_state_dict(self, state: dict) -> None:
        self.scorer.load_state_dict(state["scorer"])
        self.buffer, self.last_probe = [dict(e) for e in state["buffer"]], state["last_probe"]

