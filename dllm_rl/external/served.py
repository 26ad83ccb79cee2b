"""The external policy behind an OpenAI-compatible server (`external=openai`): vLLM, SGLang, `transformers serve`.

ERILS's external policy is frozen, so a stock serving engine can hold it, shared by many runs, with no weight sync
and no memory taken from the learner. This source sends one request per rollout (the rollout's own seed, so a
server that honours seeds gives a resumed run the same rows) through the `openai` client, `concurrency` at a time
on a thread pool; `prefetch` starts a step's requests before the dLLM generates, so they are in flight during the
on-policy rollouts (`ExternalRollouts.prefetch`, with `mixing.trigger=always`, the only trigger known before them).

Prompts: `api=completions` sends the task's prompt text as it is (like `causal_lm` with a tokenizer that has no chat
template); `api=chat` sends it as one user message, so the server applies the model's chat template.

Behaviour log-probs: each request asks for the sampled tokens' log-probs; where the server returns them (vLLM,
SGLang) a row's `behaviour_logp` is their sum, where it does not (`transformers serve`) it is None. A start-up probe
finds out which; with `require_behaviour_logp=true`, or `mixing.correction=is`, a server without them is refused
by name. vLLM returns the model's raw log-probs by default: they are the sampling distribution's only at
temperature 1 with top_p 1, or with the server started with `--logprobs-mode processed_logprobs`.

What goes wrong, and what happens (docs/external.md has the table):
- at start-up (the probe: the model list, then one 1-token completion): any failure is a `ConfigError` naming
  `external.base_url` or `external.model` and the server's answer, after the bounded retries;
- mid-run, connection refused, a stall past `timeout`, HTTP 408/429/5xx, malformed JSON or a reply without a
  completion: retried `retries` times with exponential backoff (`backoff` * 2^k seconds), then a counted skip (the
  rollout is missing: `external/failed_requests`); a step whose every request failed warns, and `max_failed_steps`
  such steps in a row stop the run (`RunStopped`; the last checkpoint resumes it once the server is back);
- mid-run, any other HTTP 4xx (a model the server no longer has, a refused key, a bad request): stops the run at
  once (`ServerRefused`), since no retry can fix it;
- an empty completion is no rollout (`external/empty`); one cut at `max_new_tokens` is a rollout like any other
  (`external/length_stopped`), judged by length control and the task's reward.

The API key is read from the environment variable named by `api_key_env` and held only by the client: never in
the config, a log line or a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from dllm_rl.errors import ConfigError, RunStopped, check_ranges, pick, require
from dllm_rl.external.base import ExternalRollout, token_ends

APIS = ("completions", "chat")
PROBE_PROMPT = "Hello"


class ServerRefused(RunStopped):
    """The server answered a request with an HTTP 4xx other than 408/429: a retry cannot fix it."""


LOGP_SLACK = 1e-4  # a served log-prob above 0 by less than this is rounding; above it, or NaN, the reply is malformed


class Loose(SimpleNamespace):
    """A reply's JSON object as attributes; a field the server left out is None (as the client's models have it)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class TooSlow(Exception):
    """A reply still arriving at its deadline."""


class Malformed(ValueError):
    """A 200 reply that is not a completion (no choices, no text)."""


@dataclass(frozen=True)
class Reply:
    """One request's outcome: `text` None when it failed after its retries (`error` says why)."""

    text: str | None
    logp: float | None
    finish: str | None
    seconds: float
    retries: int
    error: str | None = None
    token_logps: tuple[tuple[int, float], ...] | None = None  # ExternalRollout's: (end offset, log-prob) per token


class OpenAISource:
    """Rollouts from a model behind an OpenAI-compatible `/v1/completions` or `/v1/chat/completions` endpoint."""

    name = "openai"

    def __init__(self, base_url: str, model: str, api: str = "completions", api_key_env: str | None = None,
                 temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 96, stop: list | None = None,
                 concurrency: int = 8, timeout: float = 60.0, retries: int = 2, backoff: float = 0.5,
                 require_behaviour_logp: bool = False, max_failed_steps: int = 20, prefetch: bool = True):
        try:
            import openai
        except ImportError:
            raise ConfigError("external=openai needs the openai client: pip install 'dllm-rl[serving]'") from None
        check_ranges(dict(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, concurrency=concurrency,
                          timeout=timeout, retries=retries, backoff=backoff, max_failed_steps=max_failed_steps),
                     {"temperature": "non_negative", "top_p": "probability", "max_new_tokens": "at_least_1",
                      "concurrency": "at_least_1", "timeout": "positive", "retries": "non_negative",
                      "backoff": "non_negative", "max_failed_steps": "at_least_1"}, "external")
        pick({a: a for a in APIS}, api, "external.api")
        require(base_url.startswith(("http://", "https://")),
                f"external.base_url={base_url!r}: expected the server's OpenAI-compatible root, e.g. "
                f"'http://127.0.0.1:8000/v1'")
        require(stop is None or all(isinstance(s, str) and s for s in stop),
                f"external.stop={stop!r}: expected null or a list of non-empty strings")
        key = "none"  # local servers take any key; the client needs one
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            require(bool(key), f"external.api_key_env={api_key_env!r}: that environment variable is not set or "
                    f"empty (the API key is read from it, never from the config)")
        self.client = openai.OpenAI(base_url=base_url, api_key=key, timeout=timeout, max_retries=0)
        self.base_url, self.model, self.api, self.timeout = base_url, model, api, timeout
        self.sampling = {"temperature": temperature, "top_p": top_p, "max_tokens": max_new_tokens,
                         **({"stop": list(stop)} if stop else {})}
        self.retries, self.backoff, self.max_failed_steps = retries, backoff, max_failed_steps
        self.early = prefetch
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="external-openai")
        self.pending: dict[tuple[str, int], Future] = {}
        self.failed_steps, self.metrics = 0, {}
        self.behaviour_logp = self.probe()
        require(self.behaviour_logp or not require_behaviour_logp,
                f"external.require_behaviour_logp=true, but the server at {base_url} returns no per-token log-probs "
                f"(transformers serve never does; vLLM and SGLang do)")

    # ------------------------------------------------------------------------------------ start-up

    def probe(self) -> bool:
        """Check that the server answers and serves `model`; True when it returns per-token log-probs."""
        try:
            served, _, error = self.call(lambda: [m.id for m in self.client.models.list().data], missing_ok=True)
        except ServerRefused as refused:
            raise ConfigError(f"external.base_url={self.base_url!r}: {refused}") from None
        if served is None and not error.startswith("HTTP 404"):
            raise ConfigError(f"external.base_url={self.base_url!r}: no OpenAI-compatible server answered after "
                              f"{self.retries} retries ({error})")
        require(served is None or self.model in served,
                f"external.model={self.model!r}: the server at {self.base_url} serves {sorted(served or [])}")
        try:
            reply = self.complete(PROBE_PROMPT, 0, max_tokens=1)
        except ServerRefused as refused:
            raise ConfigError(f"external.model={self.model!r} at {self.base_url}: {refused}") from None
        if reply.text is None:
            raise ConfigError(f"external.base_url={self.base_url!r}: the probe completion failed after {self.retries} "
                              f"retries ({reply.error})")
        return reply.logp is not None

    # ------------------------------------------------------------------------------------ requests

    def call(self, fn: Callable[[], Any], missing_ok: bool = False) -> tuple[Any, int, str | None]:
        """(fn's result, retries used, None), or (None, retries, why) once the transient failures outlast the
        retries; an HTTP 4xx other than 408/429 raises `ServerRefused` at once (a 404 returns (None, k, why)
        with `missing_ok`: an endpoint the server does not have)."""
        import openai

        error = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return fn(), attempt, None
            except openai.APIStatusError as status:
                error = f"HTTP {status.status_code}: {str(status.message)[:200]}"
                if status.status_code == 404 and missing_ok:
                    return None, attempt, error
                if status.status_code < 500 and status.status_code not in (408, 429):
                    raise ServerRefused(f"the server refused the request ({error})") from None
            except openai.APIConnectionError as lost:  # refused, reset, or the timeout (APITimeoutError)
                error = f"{type(lost).__name__}: {lost}"
            except TooSlow as slow:
                error = f"TooSlow: {slow}"
            except (openai.APIResponseValidationError, Malformed, ValueError, TypeError, AttributeError,
                    IndexError) as garbage:
                error = f"malformed reply ({type(garbage).__name__}: {str(garbage)[:200]})"
        return None, self.retries, error

    def complete(self, prompt: str, seed: int, max_tokens: int | None = None) -> Reply:
        """One completion of `prompt` with `seed`, retried as `call` says."""
        started = time.perf_counter()
        sampling = self.sampling | ({"max_tokens": max_tokens} if max_tokens else {}) | {"seed": seed % 2**31}
        result, retries, error = self.call(lambda: self.create(prompt, sampling))
        seconds = time.perf_counter() - started
        if result is None:
            return Reply(None, None, None, seconds, retries, error)
        text, logp, finish, token_logps = result
        return Reply(text, logp, finish, seconds, retries, token_logps=token_logps)

    def create(self, prompt: str, sampling: dict
               ) -> tuple[str, float | None, str | None, tuple[tuple[int, float], ...] | None]:
        """(text, the sum of the sampled tokens' log-probs or None, finish reason, each token's (end offset,
        log-prob) where the tokens spell the text) of one request."""
        if self.api == "chat":
            messages = [{"role": "user", "content": prompt}]
            reply = self.post(self.client.chat.completions, model=self.model, messages=messages, logprobs=True,
                              top_logprobs=0, **sampling)
            choice = first_choice(reply)
            text = choice.message.content if choice.message is not None else None
            tokens = getattr(choice.logprobs, "content", None)
            logps = None if not tokens else [t.logprob for t in tokens]
            pieces = None if not tokens else [getattr(t, "token", None) for t in tokens]
        else:
            reply = self.post(self.client.completions, model=self.model, prompt=prompt, logprobs=0, **sampling)
            choice = first_choice(reply)
            text = choice.text
            logps = getattr(choice.logprobs, "token_logprobs", None)
            pieces = getattr(choice.logprobs, "tokens", None)
        if text is not None and not isinstance(text, str):
            raise Malformed(f"completion text of type {type(text).__name__}")
        numbers = logps is not None and len(logps) > 0 and all(isinstance(x, (int, float)) for x in logps)
        if numbers and not all(math.isfinite(x) and x <= LOGP_SLACK for x in logps):
            bad = next(x for x in logps if not (math.isfinite(x) and x <= LOGP_SLACK))
            raise Malformed(f"token log-prob {bad!r} is not a log-probability (finite, <= 0)")
        spelled = (numbers and isinstance(pieces, list) and len(pieces) == len(logps)
                   and all(isinstance(p, str) for p in pieces) and "".join(pieces) == (text or ""))
        per_token = tuple(zip(token_ends(pieces), map(float, logps))) if spelled else None
        return text or "", float(sum(logps)) if numbers else None, choice.finish_reason, per_token

    def post(self, resource, **request) -> Any:
        """One request's reply, read within `timeout` of its start: the client's own timeout bounds only each wait
        for bytes, so a server that answers 200 and then sends a byte now and then would hold the request for as
        long as it likes. The body is read as it arrives and the attempt given up (`TooSlow`, retried as a stall)
        once past its deadline; the JSON becomes attribute objects (`Loose`)."""
        deadline = time.monotonic() + self.timeout
        body = bytearray()
        with resource.with_streaming_response.create(**request) as response:
            for chunk in response.iter_bytes():
                body += chunk
                if time.monotonic() > deadline:
                    raise TooSlow(f"no whole reply within external.timeout={self.timeout:g}s ({len(body)} bytes "
                                  f"came)")
        return json.loads(bytes(body), object_hook=lambda fields: Loose(**fields))

    # ------------------------------------------------------------------------------------ the source protocol

    def submit(self, prompt: str, seed: int) -> Future:
        return self.pool.submit(self.complete, prompt, seed)

    def prefetch(self, task, examples, count, seeds) -> None:
        """Start the requests that `rollouts` with the same arguments will make (a prompt filtered out meanwhile
        costs its requests, nothing else). Nothing with `prefetch=false` (requests start at the external stage)."""
        if not self.early:
            return
        for i, example in enumerate(examples):
            prompt = task.prompt(example)
            for j in range(count):
                key = (prompt, seeds[i][j])
                if key not in self.pending:
                    self.pending[key] = self.submit(*key)

    def rollouts(self, task, examples, count, seeds):
        started = time.perf_counter()
        futures, reused = [], 0
        for i, example in enumerate(examples):
            prompt = task.prompt(example)
            row = []
            for j in range(count):
                future = self.pending.pop((prompt, seeds[i][j]), None)
                reused += future is not None
                row.append(future or self.submit(prompt, seeds[i][j]))
            futures.append(row)
        for stale in self.pending.values():  # prefetched for prompts that did not reach this step's external rows
            stale.cancel()
        self.pending.clear()
        replies = [[f.result() for f in row] for row in futures]
        flat = [r for row in replies for r in row]
        self.account(flat, time.perf_counter() - started, reused)
        return [[ExternalRollout(i, r.text, self.name, r.logp, r.token_logps) for r in row if r.text]
                for i, row in enumerate(replies)]

    def account(self, replies: list[Reply], waited: float, reused: int) -> None:
        """This call's metrics, and the run's count of steps whose every request failed."""
        done = [r for r in replies if r.text is not None]
        self.metrics = {"requests": float(len(replies)), "failed_requests": float(len(replies) - len(done)),
                        "retries": float(sum(r.retries for r in replies)), "prefetched": float(reused),
                        "empty": float(sum(r.text == "" for r in done)),
                        "length_stopped": float(sum(r.finish == "length" for r in done)),
                        "request_s": sum(r.seconds for r in done) / max(1, len(done)),
                        "request_max_s": max((r.seconds for r in done), default=0.0), "wait_s": waited}
        if not replies or done:
            self.failed_steps = 0
            return
        self.failed_steps += 1
        why = next(r.error for r in replies if r.error)
        if self.failed_steps >= self.max_failed_steps:
            raise RunStopped(f"the external server at {self.base_url} failed every request for {self.failed_steps} "
                             f"steps in a row (last: {why}); the run stopped (external.max_failed_steps="
                             f"{self.max_failed_steps}): resume it from its last checkpoint once the server is back")
        warnings.warn(f"external server at {self.base_url}: all {len(replies)} requests of this step failed ({why}); "
                      f"the step goes on without external rows ({self.failed_steps}/{self.max_failed_steps})")

    def step_metrics(self) -> dict[str, float]:
        """Requests, failures, retries, empty and length-stopped completions, the mean and the slowest request's
        seconds, and the seconds `rollouts` waited for them (near 0 when prefetched requests finished during the
        dLLM's rollouts)."""
        return dict(self.metrics)

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def first_choice(reply: Any) -> Any:
    choices = getattr(reply, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise Malformed(f"no choices in the reply ({str(reply)[:200]})")
    return choices[0]
