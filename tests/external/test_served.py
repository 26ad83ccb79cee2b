"""The served external source (`external=openai`) against the real `transformers serve` on models/tiny-ar, and
against a hostile stand-in for the faults a real server will not produce on demand."""

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.data import build_task
from dllm_rl.errors import ConfigError, RunStopped
from dllm_rl.external.mixer import build_mixer
from dllm_rl.external.served import OpenAISource, ServerRefused
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.train import train
from tests.conftest import DigitShare
from dllm_rl.external.local_server import TransformersServe, alive, free_port
from tests.external.servers import ROOT, TINY_AR

SECRET = "sk-test-3f9a1c7e"


def seeds_for(n: int, count: int, base: int = 0) -> list[list[int]]:
    return [[base + 100 * i + j for j in range(count)] for i in range(n)]


@pytest.mark.slow
def test_served_rollouts_arrive_verify_and_honour_seeds(served_tiny_ar):
    sudoku, countdown = build_task("sudoku"), build_task("countdown")
    source = OpenAISource(served_tiny_ar.base_url, served_tiny_ar.model, concurrency=1, max_new_tokens=64)
    try:
        assert source.behaviour_logp is served_tiny_ar.gives_logprobs  # transformers serve returns none, vLLM does
        puzzles = sudoku.examples("train", 4, 0)
        rows = source.rollouts(sudoku, puzzles, 2, seeds_for(4, 2))
        assert [len(r) for r in rows] == [2, 2, 2, 2]
        logps = [r.behaviour_logp for rs in rows for r in rs]
        assert all((lp is not None and lp < 0) if served_tiny_ar.gives_logprobs else lp is None for lp in logps)
        assert sum(sudoku.reward(r.text, puzzles[i]).correct for i, rs in enumerate(rows) for r in rs) >= 4
        assert source.step_metrics()["requests"] == 8 and source.step_metrics()["failed_requests"] == 0
        numbers = countdown.examples("train", 3, 0)
        first = source.rollouts(countdown, numbers, 4, seeds_for(3, 4))
        again = source.rollouts(countdown, numbers, 4, seeds_for(3, 4))
        other = source.rollouts(countdown, numbers, 4, seeds_for(3, 4, base=7))
        texts = lambda rows: [[r.text for r in rs] for rs in rows]  # noqa: E731
        assert texts(first) == texts(again)  # one request at a time: transformers serve honours the seed
        assert texts(first) != texts(other)
    finally:
        source.close()


@pytest.mark.slow
def test_served_start_up_refuses_a_wrong_model_and_options_that_need_log_probs(served_tiny_ar):
    url, model = served_tiny_ar.base_url, served_tiny_ar.model
    with pytest.raises(ConfigError, match=r"external.model='qwen'.*serves \[") as error:
        OpenAISource(url, "qwen")
    assert model in str(error.value)
    with pytest.raises(ConfigError, match=r"external.base_url='http://127.0.0.1:\d+/v1': no OpenAI-compatible"):
        OpenAISource(f"http://127.0.0.1:{free_port()}/v1", model, retries=1, backoff=0.01)
    if served_tiny_ar.gives_logprobs:  # vLLM: what needs them is accepted
        OpenAISource(url, model, require_behaviour_logp=True).close()
        return
    with pytest.raises(ConfigError, match="require_behaviour_logp=true.*no per-token log-probs"):
        OpenAISource(url, model, require_behaviour_logp=True)
    with pytest.raises(ConfigError, match="mixing.correction=is needs each external rollout's behaviour log-prob"):
        build_mixer({"name": "openai", "base_url": url, "model": model}, {"correction": "is"},
                    build_estimator({"name": "mean_field"}))


@pytest.mark.slow
def test_a_training_run_with_a_served_external_policy(served_tiny_ar, tmp_path, monkeypatch, capsys):
    """Two steps on the embedded dLLM with the served tiny-ar as ERILS's external policy: the requests start before
    the dLLM's rollouts (all prefetched), their rows verify and train, and the API key is nowhere on disk."""
    monkeypatch.setenv("DLLM_RL_TEST_KEY", SECRET)
    run = tmp_path / "run"
    train(build_task("sudoku"), model=str(ROOT / "models" / "tiny-dllm"), run_dir=str(run), steps=2,
          checkpoint_every=2, prompts_per_step=2, group_size=2, minibatch_size=4, eval_every=0, tensorboard=False,
          rollout={"gen_length": 48, "block_length": 48, "steps": 12, "temperature": 1.0},
          external={"name": "openai", "base_url": served_tiny_ar.base_url, "model": served_tiny_ar.model,
                    "api_key_env": "DLLM_RL_TEST_KEY", "max_new_tokens": 48},
          mixing={"per_prompt": 2}, print_fn=print)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["external/requests"] for m in lines] == [4.0, 4.0]
    assert [m["external/prefetched"] for m in lines] == [4.0, 4.0]
    assert all(m["external/failed_requests"] == 0 for m in lines) and sum(m["external/rows"] for m in lines) >= 2
    assert all(m["reward/external"] == 1.0 for m in lines if m["external/rows"])  # keep=correct: verified rows only
    before = load_file(str(ROOT / "models" / "tiny-dllm" / "model.safetensors"))
    after = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    config = json.loads((run / "config.json").read_text())
    assert config["external"]["api_key_env"] == "DLLM_RL_TEST_KEY"
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    assert not any(SECRET.encode() in f.read_bytes() for f in run.rglob("*") if f.is_file())


@pytest.mark.vllm
def test_vllm_log_probs_equal_the_models_teacher_forced_log_probs(served_tiny_ar):
    """vLLM's returned per-token log-probs (temperature 1, so the raw and the sampling distribution agree) against
    the tiny AR model's own teacher-forced log-softmax over the same token ids: within 1e-4 per token."""
    if not served_tiny_ar.gives_logprobs:
        pytest.skip("transformers serve returns no log-probs; this compares vLLM's")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(served_tiny_ar.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(served_tiny_ar.model)
    task = build_task("countdown")
    source = OpenAISource(served_tiny_ar.base_url, served_tiny_ar.model, max_new_tokens=48)
    try:
        for k, example in enumerate(task.examples("train", 3, 0)):
            prompt = task.prompt(example)
            reply = source.client.completions.create(model=source.model, prompt=prompt, max_tokens=48, temperature=1.0,
                                                     seed=k, logprobs=0, extra_body={"return_token_ids": True})
            choice = reply.choices[0]
            prompt_ids = getattr(choice, "prompt_token_ids", None) or reply.model_extra.get("prompt_token_ids") \
                or tokenizer(prompt)["input_ids"]
            completion_ids = choice.token_ids
            ids = torch.tensor([prompt_ids + completion_ids])
            with torch.no_grad():
                logp = model(ids).logits[0, len(prompt_ids) - 1 : -1].log_softmax(-1)
            forced = logp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]
            served = torch.tensor(choice.logprobs.token_logprobs, dtype=torch.float32)
            assert torch.allclose(served, forced, atol=1e-4), (served - forced).abs().max()
            rows = source.rollouts(task, [example], 1, [[k]])
            assert rows[0][0].behaviour_logp == pytest.approx(float(served.sum()), abs=1e-6)
    finally:
        source.close()


def test_a_server_started_for_a_test_leaves_no_process(tmp_path):
    server = TransformersServe(TINY_AR)
    pid = server.process.pid
    server.stop()
    assert not alive(pid)


# ---------------------------------------------------------------------------------------------- faults


def stub_source(hostile, **options) -> OpenAISource:
    options = {"model": hostile.model, "timeout": 0.5, "retries": 2, "backoff": 0.05, **options}
    return OpenAISource(hostile.base_url, **options)


def bound(source: OpenAISource, slack: float = 3.0) -> float:
    """The longest a request may take: every attempt timing out, plus the backoffs."""
    timeout = source.client.timeout
    return (source.retries + 1) * timeout + sum(source.backoff * 2**k for k in range(source.retries)) + slack


@pytest.mark.parametrize("mode", ["error500", "stall", "garbage", "truncated", "no_choices"])
def test_a_failing_request_is_retried_then_counted_and_skipped_within_its_bound(hostile, mode):
    task = DigitShare()
    source = stub_source(hostile)
    try:
        hostile.mode, hostile.stall_s = mode, 3.0
        started = time.monotonic()
        with pytest.warns(UserWarning, match="all 2 requests of this step failed"):
            rows = source.rollouts(task, task.examples("train", 2, 0), 1, seeds_for(2, 1))
        assert time.monotonic() - started < bound(source)
        assert rows == [[], []]
        metrics = source.step_metrics()
        assert metrics["failed_requests"] == 2 and metrics["retries"] == 4 and metrics["requests"] == 2
        hostile.mode = "ok"  # back: the next step has its rows again, and the count of failed steps restarts
        assert [len(r) for r in source.rollouts(task, task.examples("train", 2, 0), 1, seeds_for(2, 1))] == [1, 1]
        assert source.failed_steps == 0
    finally:
        source.close()


def test_a_transient_failure_is_retried_into_a_rollout(hostile):
    task = DigitShare()
    source = stub_source(hostile)
    hostile.fail_first = 1
    rows = source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1))
    assert [r.text for r in rows[0]] == [hostile.text]
    assert source.step_metrics()["retries"] == 1 and source.step_metrics()["failed_requests"] == 0


def test_an_empty_completion_is_no_rollout_and_is_counted(hostile):
    task = DigitShare()
    source = stub_source(hostile)
    hostile.mode = "empty"
    assert source.rollouts(task, task.examples("train", 2, 0), 2, seeds_for(2, 2)) == [[], []]
    assert source.step_metrics()["empty"] == 4 and source.step_metrics()["failed_requests"] == 0


def test_a_refused_request_mid_run_stops_at_once(hostile):
    task = DigitShare()
    source = stub_source(hostile, retries=5, backoff=1.0)
    hostile.mode = "unauthorized"
    started = time.monotonic()
    with pytest.raises(ServerRefused, match="HTTP 401"):
        source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1))
    assert time.monotonic() - started < 1.0  # not retried


def test_start_up_faults_are_named_errors(hostile):
    with pytest.raises(ConfigError, match=r"external.model='other'.*serves \['stub'\]"):
        stub_source(hostile, model="other")
    hostile.mode = "garbage"
    with pytest.raises(ConfigError, match="the probe completion failed after 1 retries .malformed reply"):
        stub_source(hostile, retries=1)
    hostile.mode = "unauthorized"
    with pytest.raises(ConfigError, match="external.model='stub'.*HTTP 401"):
        stub_source(hostile)
    with pytest.raises(ConfigError, match="external.api_key_env='DLLM_RL_UNSET_KEY': that environment variable"):
        stub_source(hostile, api_key_env="DLLM_RL_UNSET_KEY")
    with pytest.raises(ConfigError, match="external.base_url='127.0.0.1:8000'"):
        OpenAISource("127.0.0.1:8000", "stub")


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_returned_log_probs_become_the_behaviour_log_prob_and_the_key_is_sent(hostile, monkeypatch, api):
    monkeypatch.setenv("DLLM_RL_TEST_KEY", SECRET)
    hostile.logprobs = [-0.5, -0.25, -1.0]
    task = DigitShare()
    source = stub_source(hostile, api=api, api_key_env="DLLM_RL_TEST_KEY", require_behaviour_logp=True)
    rows = source.rollouts(task, task.examples("train", 1, 0), 2, seeds_for(1, 2))
    assert source.behaviour_logp is True and [r.behaviour_logp for r in rows[0]] == [-1.75, -1.75]
    assert hostile.keys and all(key == f"Bearer {SECRET}" for key in hostile.keys)


def test_a_reply_that_drips_in_is_given_up_at_its_deadline(hostile):
    """A 200 whose body comes one byte every 0.2 s (hours for a whole reply): each attempt is given up at
    `timeout` after its start, not kept alive by every byte resetting the client's read timeout."""
    task = DigitShare()
    source = stub_source(hostile, timeout=1.0, retries=1)
    try:
        hostile.mode, hostile.drip_s = "drip", 0.2
        started = time.monotonic()
        with pytest.warns(UserWarning, match="all 1 requests of this step failed .TooSlow: no whole reply within "
                                             "external.timeout=1s"):
            assert source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1)) == [[]]
        assert time.monotonic() - started < 2 * (1.0 + 0.2) + 0.05 + 1.0  # two attempts, a byte's wait past each
    finally:
        source.close()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_per_token_log_probs_that_spell_the_text_are_kept_and_bad_ones_are_a_failed_request(hostile, api):
    """Tokens that spell the completion give each token's end and log-prob (what a cut rollout's log-prob is made
    of); a NaN or positive log-prob is no log-prob: at start-up a named error, mid-run a failed request."""
    task = DigitShare()
    hostile.text, hostile.tokens = "<answer>0</answer>", ["<answer>", "0", "</answer>"]
    hostile.logprobs = [-1.0, -0.5, -0.25]
    source = stub_source(hostile, api=api)
    try:
        (rollout,), = source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1))
        assert rollout.behaviour_logp == -1.75 and rollout.token_logps == ((8, -1.0), (9, -0.5), (18, -0.25))
        hostile.tokens = ["<answer>", "1", "</answer>"]  # they do not spell it: the sum alone
        (rollout,), = source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1))
        assert rollout.behaviour_logp == -1.75 and rollout.token_logps is None
        for bad in (float("nan"), 0.5):
            hostile.logprobs = [-1.0, bad, -0.25]
            with pytest.warns(UserWarning, match=f"external server at {hostile.base_url}: all 1 requests .*malformed "
                                                 f"reply .Malformed: token log-prob {bad!r} is not a log-probability"):
                assert source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1)) == [[]]
    finally:
        source.close()
    hostile.logprobs = [float("nan")] * 3
    with pytest.raises(ConfigError, match="probe completion failed .* token log-prob nan is not a log-probability"):
        stub_source(hostile, api=api)


def test_max_failed_steps_in_a_row_stop_the_run(hostile):
    task = DigitShare()
    source = stub_source(hostile, retries=0, max_failed_steps=2)
    hostile.stop()  # the server goes away: connections are refused
    with pytest.warns(UserWarning, match="ConnectionError|APIConnectionError"):
        source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1))
    with pytest.raises(RunStopped, match="failed every request for 2 steps in a row"):
        source.rollouts(task, task.examples("train", 1, 0), 1, seeds_for(1, 1))


@pytest.mark.slow
def test_a_server_that_goes_away_mid_run_neither_hangs_nor_crashes_the_run(hostile, saved_model, tmp_path):
    """The stand-in answers the first step's requests, then its port refuses: the run finishes its four steps, the
    lost requests counted, and keeps training on its own rollouts."""
    task, run = DigitShare(), tmp_path / "run"
    answered = {"n": 0}
    original = OpenAISource.complete

    def complete(self, prompt, seed, max_tokens=None):
        reply = original(self, prompt, seed, max_tokens)
        answered["n"] += 1
        if answered["n"] == 5:  # the probe and the first step's four requests
            hostile.stop()
        return reply

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OpenAISource, "complete", complete)
        with pytest.warns(UserWarning, match="requests of this step failed"):
            train(task, model=saved_model, run_dir=str(run), steps=4, prompts_per_step=2, group_size=4,
                  minibatch_size=8, eval_every=0, tensorboard=False, lr=1e-3, warmup=0, print_fn=lambda *_: None,
                  rollout={"gen_length": 32, "block_length": 16, "steps": 8, "temperature": 1.0},
                  likelihood={"name": "mean_field"}, mixing={"per_prompt": 2, "keep": "all"},
                  external={"name": "openai", "base_url": hostile.base_url, "model": hostile.model,
                            "timeout": 0.5, "retries": 1, "backoff": 0.05})
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["external/failed_requests"] for m in lines] == [0.0, 4.0, 4.0, 4.0]
    assert lines[0]["external/rows"] == 4 and all("external/rows" not in m or m["external/rows"] == 0
                                                     for m in lines[1:])
    assert all(m["policy/updates"] >= 1 for m in lines)
    assert Path(run / "metrics.jsonl").exists()
