"""The ERILS mixer: external rows of a step (triggers, length control, provenance) and the trainer around it."""

import json
from dataclasses import dataclass

import pytest
import torch

from dllm_rl.data import build_task
from dllm_rl.data.task import render_prompt
from dllm_rl.errors import ConfigError
from dllm_rl.external.mixer import ExternalMixer, MixingConfig, build_mixer, external_likelihood
from dllm_rl.likelihood.estimators import Estimator, build_estimator
from dllm_rl.external.sources import ExternalRollout
from dllm_rl.train import train

SUDOKU = build_task("sudoku")
MEAN_FIELD = build_estimator({"name": "mean_field"})


@dataclass
class FixedSource:
    """Hands every prompt the same texts (formatted with the example's answer)."""

    templates: tuple[str, ...]
    name: str = "fixed"

    def rollouts(self, task, examples, count, seeds):
        return [[ExternalRollout(i, t.format(answer=ex.answer), self.name, -1.0) for t in self.templates[:count]]
                for i, ex in enumerate(examples)]


def step_rows(mixer, tokenizer, correct_BG, examples, window=40):
    texts = [render_prompt(SUDOKU.prompt(ex), tokenizer) for ex in examples]
    rows, metrics = mixer.rows(step=0, seed=0, task=SUDOKU, examples=examples, prompt_texts=texts,
                               correct_BG=correct_BG, tokenizer=tokenizer, window=window,
                               eos_id=tokenizer.eos_token_id, max_length=128)
    if rows is not None:
        rows.mask_seeds = [list(range(len(rows)))]
    return rows, metrics


def test_all_failed_trigger_adds_rows_only_for_failed_prompts(char_tokenizer):
    examples = SUDOKU.examples("train", 3, 0)
    mixer = ExternalMixer(FixedSource(("<answer>{answer}</answer>",)),
                          MixingConfig(per_prompt=1, trigger="all_failed"), MEAN_FIELD)
    correct_BG = torch.tensor([[False, True], [False, False], [False, False]])
    rows, metrics = step_rows(mixer, char_tokenizer, correct_BG, examples)
    assert rows.prompt_N.tolist() == [1, 2] and metrics["external/prompts"] == 2
    assert rows.source == "external" and rows.version == -1 and rows.order_NC is None
    assert all(r.correct for r in rows.rewards)
    # provenance: each row's prompt is its own example's prompt, the window holds the text then EOS fill
    for n, b in enumerate(rows.prompt_N.tolist()):
        completion = rows.ids_NL[n, rows.prompt_length:].tolist()
        assert char_tokenizer.decode(completion[: len(rows.texts[n])]) == f"<answer>{examples[b].answer}</answer>"
        assert set(completion[len(rows.texts[n]):]) == {char_tokenizer.eos_token_id}


@dataclass
class MeteredSource(FixedSource):
    """A FixedSource that reports metrics about its last call, as the speculative causal_lm source does."""

    calls: int = 0

    def rollouts(self, task, examples, count, seeds):
        self.calls += 1
        return super().rollouts(task, examples, count, seeds)

    def step_metrics(self):
        return {"spec_acceptance": 0.25 * self.calls}


def test_a_source_step_metrics_are_logged_under_external(char_tokenizer):
    examples = SUDOKU.examples("train", 2, 0)
    mixer = ExternalMixer(MeteredSource(("<answer>{answer}</answer>",)), MixingConfig(per_prompt=1), MEAN_FIELD)
    _, metrics = step_rows(mixer, char_tokenizer, torch.zeros(2, 2, dtype=torch.bool), examples)
    assert metrics["external/spec_acceptance"] == 0.25
    quiet = ExternalMixer(MeteredSource(("x",)), MixingConfig(per_prompt=1, trigger="all_failed"), MEAN_FIELD)
    _, metrics = step_rows(quiet, char_tokenizer, torch.ones(2, 2, dtype=torch.bool), examples)
    assert "external/spec_acceptance" not in metrics and quiet.source.calls == 0  # no prompt fired, no call


def test_drop_keeps_overlong_rollouts_out_and_truncate_rescores(char_tokenizer):
    examples = SUDOKU.examples("train", 2, 0)
    templates = ("reasoning " * 5 + "<answer>{answer}</answer>", "<answer>{answer}</answer>")
    correct_BG = torch.zeros(2, 2, dtype=torch.bool)
    drop = ExternalMixer(FixedSource(templates), MixingConfig(per_prompt=2, keep="all"), MEAN_FIELD)
    rows, metrics = step_rows(drop, char_tokenizer, correct_BG, examples)
    assert metrics["external/too_long"] == 2 and len(rows) == 2
    assert all(len(t) <= 40 for t in rows.texts) and rows.mask_NC.sum(-1).max() <= 40

    truncate = ExternalMixer(FixedSource(templates), MixingConfig(per_prompt=2, keep="all", length_rule="truncate"),
                             MEAN_FIELD)
    rows, metrics = step_rows(truncate, char_tokenizer, correct_BG, examples)
    assert metrics["external/truncated"] == 2 and len(rows) == 4
    assert [r.correct for r in rows.rewards] == [False, True, False, True]  # the cut text lost its answer

    uncontrolled = ExternalMixer(FixedSource(templates), MixingConfig(per_prompt=2, length_rule="none"),
                                 MEAN_FIELD)
    rows, _ = step_rows(uncontrolled, char_tokenizer, correct_BG, examples)
    assert rows.ids_NL.shape[1] - rows.prompt_length == len(templates[0].format(answer="x" * 16))
    # on data-parallel ranks the window is the widest over all ranks (`widest` stands in for the all-gather)
    texts = [render_prompt(SUDOKU.prompt(ex), char_tokenizer) for ex in examples]
    rows, _ = uncontrolled.rows(step=0, seed=0, task=SUDOKU, examples=examples, prompt_texts=texts,
                                correct_BG=correct_BG, tokenizer=char_tokenizer, window=40,
                                eos_id=char_tokenizer.eos_token_id, max_length=128, widest=lambda n: n + 7)
    assert rows.ids_NL.shape[1] - rows.prompt_length == len(templates[0].format(answer="x" * 16)) + 7


@dataclass
class PerTokenSource(FixedSource):
    """A FixedSource whose rollouts carry per-token log-probs, one character per token (-0.1 each), as a served
    model's do; `per_token=False` gives only the whole text's sum."""

    per_token: bool = True

    def rollouts(self, task, examples, count, seeds):
        out = []
        for i, ex in enumerate(examples):
            texts = [t.format(answer=ex.answer) for t in self.templates[:count]]
            out.append([ExternalRollout(i, t, self.name, -0.1 * len(t),
                                        tuple((k + 1, -0.1) for k in range(len(t))) if self.per_token else None)
                        for t in texts])
        return out


def test_a_truncated_rollout_keeps_the_log_prob_of_the_text_it_kept(char_tokenizer):
    """With length_rule=truncate and correction=is, a cut row's behaviour log-prob is its 40 kept characters'
    (-4.0), not the whole text's (which would inflate its weight by 1/mu(cut part | kept part)); a whole row keeps
    its own; a source with no per-token values loses its cut rows (counted), and a JSONL source is refused."""
    examples = SUDOKU.examples("train", 2, 0)
    templates = ("reasoning " * 5 + "<answer>{answer}</answer>", "<answer>{answer}</answer>")
    whole = [len(t.format(answer=examples[0].answer)) for t in templates]
    assert whole[0] > 40 >= whole[1]
    config = MixingConfig(per_prompt=2, keep="all", length_rule="truncate", correction="is")
    rows, metrics = step_rows(ExternalMixer(PerTokenSource(templates), config, MEAN_FIELD), char_tokenizer,
                              torch.zeros(2, 2, dtype=torch.bool), examples)
    assert metrics["external/truncated"] == 2 and metrics["external/no_prefix_logp"] == 0
    assert rows.behaviour_logp_N.tolist() == pytest.approx([-4.0, -0.1 * whole[1]] * 2)

    rows, metrics = step_rows(ExternalMixer(PerTokenSource(templates, per_token=False), config, MEAN_FIELD),
                              char_tokenizer, torch.zeros(2, 2, dtype=torch.bool), examples)
    assert metrics["external/no_prefix_logp"] == 2 and len(rows) == 2
    assert rows.behaviour_logp_N.tolist() == pytest.approx([-0.1 * whole[1]] * 2)

    plain = MixingConfig(per_prompt=2, keep="all", length_rule="truncate")  # no weights: nothing needs it
    rows, metrics = step_rows(ExternalMixer(PerTokenSource(templates, per_token=False), plain, MEAN_FIELD),
                              char_tokenizer, torch.zeros(2, 2, dtype=torch.bool), examples)
    assert len(rows) == 4 and metrics["external/no_prefix_logp"] == 0


def test_a_row_with_a_non_finite_behaviour_log_prob_is_dropped_and_counted(char_tokenizer):
    @dataclass
    class NaNSource(FixedSource):
        def rollouts(self, task, examples, count, seeds):
            return [[ExternalRollout(i, f"<answer>{ex.answer}</answer>", self.name, logp)
                     for logp in (float("nan"), -1.0)] for i, ex in enumerate(examples)]

    examples = SUDOKU.examples("train", 2, 0)
    mixer = ExternalMixer(NaNSource(()), MixingConfig(per_prompt=2, correction="is"), MEAN_FIELD)
    rows, metrics = step_rows(mixer, char_tokenizer, torch.zeros(2, 2, dtype=torch.bool), examples)
    assert metrics["external/bad_logp"] == 2 and rows.behaviour_logp_N.tolist() == [-1.0, -1.0]


def test_truncate_with_is_refuses_a_source_of_whole_text_log_probs_by_name(tmp_path):
    from dllm_rl.external.sources import JsonlSource

    file = tmp_path / "rollouts.jsonl"
    file.write_text(json.dumps({"uid": "a", "completion": "x", "behaviour_logp": -1.0}) + "\n")
    with pytest.raises(ConfigError, match="mixing.length_rule=truncate with mixing.correction=is .* jsonl source"):
        ExternalMixer(JsonlSource(str(file)), MixingConfig(length_rule="truncate", correction="is"), MEAN_FIELD)
    ExternalMixer(JsonlSource(str(file)), MixingConfig(length_rule="drop", correction="is"), MEAN_FIELD)


def test_prefix_logp_sums_the_tokens_inside_the_kept_text():
    from dllm_rl.external.base import prefix_logp

    rollout = ExternalRollout(0, "abcdef", "s", -6.0, ((2, -1.0), (3, -2.0), (6, -3.0)))  # "ab" "c" "def"
    assert prefix_logp(rollout, "abcdef") == -6.0
    assert prefix_logp(rollout, "abc") == -3.0
    assert prefix_logp(rollout, "abcd") == -3.0  # "def" is split by the cut: left out (mu is not made smaller)
    assert prefix_logp(rollout, "abx") is None  # not a prefix of what the source wrote
    assert prefix_logp(ExternalRollout(0, "abcdef", "solver", 0.0), "ab") == 0.0  # deterministic: every prefix too
    assert prefix_logp(ExternalRollout(0, "abcdef", "s", -6.0), "ab") is None


def test_uncontrolled_rollouts_beyond_the_context_are_a_clear_error(char_tokenizer):
    examples = SUDOKU.examples("train", 1, 0)
    mixer = ExternalMixer(FixedSource(("x" * 200 + "<answer>{answer}</answer>",)),
                          MixingConfig(per_prompt=1, length_rule="none"), MEAN_FIELD)
    with pytest.raises(ConfigError, match="exceed the dLLM's context of 128; use mixing.length_rule=drop"):
        step_rows(mixer, char_tokenizer, torch.zeros(1, 2, dtype=torch.bool), examples)


def test_external_rows_never_use_a_trajectory_estimator():
    assert external_likelihood({"name": "ordered", "group": 4}, None) == {"name": "left_to_right", "group": 4}
    assert external_likelihood({"name": "elbo", "num_masks": 2}, None) == {"name": "elbo", "num_masks": 2}
    with pytest.raises(ConfigError, match="needs a denoising trajectory"):
        external_likelihood({"name": "mean_field"}, {"name": "ordered"})
    assert (external_likelihood({"name": "ordered"}, {"name": "elbo", "num_masks": 2})
            == {"name": "elbo", "num_masks": 2})


def test_bad_mixing_values_are_named():
    with pytest.raises(ConfigError, match="unknown mixing.processing 'together'"):
        MixingConfig(processing="together")
    with pytest.raises(ConfigError, match="mixing.per_prompt must be >= 1"):
        MixingConfig(per_prompt=0)
    with pytest.raises(ConfigError, match="unknown config key 'mixing.ratio'"):
        build_mixer({"name": "solver"}, {"ratio": 0.5}, MEAN_FIELD)
    assert build_mixer({"name": "none"}, {"ratio": 0.5}, MEAN_FIELD) is None


# ------------------------------------------------------------------------------------------ the trainer

SMALL = dict(
    rollout={"gen_length": 48, "block_length": 48, "steps": 12, "temperature": 1.0},
    algo={"advantage": "mean", "eps_low": 0.2, "eps_high": 0.2, "beta": 0.0},
    prompts_per_step=2, group_size=3, minibatch_size=6, eval_every=0, sample_every=1, tensorboard=False,
    lr=1e-3, print_fn=lambda *_: None, steps=1,
)


def samples_of(run):
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_trainer_separate_vs_joint_processing(saved_model, tmp_path):
    """Step 1 starts from the same model and seeds, so the on-policy rollouts are the same in every run."""
    runs = {}
    for name, external, mixing in [("none", {"name": "none"}, {}),
                                   ("separate", {"name": "solver"}, {"per_prompt": 2}),
                                   ("joint", {"name": "solver"}, {"per_prompt": 2, "processing": "joint"})]:
        run = tmp_path / name
        metrics = train(SUDOKU, model=saved_model, run_dir=str(run), external=external, mixing=mixing,
                        likelihood={"name": "mean_field"}, **SMALL)
        runs[name] = (metrics, samples_of(run))
    on = {k: [s["advantage"] for s in v[1] if s["source"] == "on_policy"] for k, v in runs.items()}
    # a random model never solves Sudoku: every on-policy advantage is 0 alone and under separate processing;
    # joint processing pools in the correct external rows and makes them negative
    assert on["none"] == on["separate"] == [0.0, 0.0]
    assert all(a < 0 for a in on["joint"])
    for name in ("separate", "joint"):
        metrics, samples = runs[name]
        ext = [s for s in samples if s["source"] == "external"]
        assert len(ext) == 4 and all(s["reward"] == 1.0 and s["version"] == -1 for s in ext)
        assert metrics["reward/external"] == 1.0 and metrics["external/rows"] == 4
        assert metrics["policy/updates"] == 1  # external rows give a signal where on-policy rollouts had none
    assert runs["none"][0]["policy/updates"] == 0


@pytest.mark.slow
def test_trainer_scores_external_rows_with_the_dllm_and_no_trajectory(saved_model, tmp_path, monkeypatch):
    calls = []
    real = Estimator.logp

    def spy(self, policy, ids_NL, *args, order_NC=None, **kwargs):
        calls.append((self.name, order_NC is not None, ids_NL.shape[0]))
        return real(self, policy, ids_NL, *args, order_NC=order_NC, **kwargs)

    monkeypatch.setattr(Estimator, "logp", spy)
    metrics = train(SUDOKU, model=saved_model, run_dir=str(tmp_path / "run"), external={"name": "solver"},
                    mixing={"per_prompt": 1, "correction": "is", "likelihood": None},
                    likelihood={"name": "ordered", "group": 8}, **SMALL)
    # on-policy rows (6) are scored with their trajectory; external rows (2) left to right, without one
    assert {c for c in calls if c[0] == "ordered"} == {("ordered", True, 6)}
    assert {c for c in calls if c[0] == "left_to_right"} == {("left_to_right", False, 2)}
    # correction=is scores the old log-probs of the external rows with the dLLM (not the behaviour policy)
    assert 0 < metrics["external/ess"] <= 1 and "external/is_clip_frac" in metrics
