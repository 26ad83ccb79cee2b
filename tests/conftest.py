from pathlib import Path

import pytest

from dllm_rl.envs import Env

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def char_tokenizer():
    from dllm_rl.data.tokenizers import build_char_tokenizer

    return build_char_tokenizer()


def make_tiny_dllm(tokenizer, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A randomly initialised native dLLM small enough for unit tests (~40k parameters)."""
    import torch

    from dllm_rl.policy.adapters import wrap_model
    from dllm_rl.policy.modeling import DiffusionLM, DiffusionLMConfig

    config = DiffusionLMConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=4, max_position_embeddings=128,
                               mask_token_id=tokenizer.mask_token_id, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    return wrap_model(DiffusionLM(config).eval(), "native", tokenizer)


@pytest.fixture
def tiny_policy(char_tokenizer):
    return make_tiny_dllm(char_tokenizer)


@pytest.fixture
def make_dllm(char_tokenizer):
    """Factory for tiny native dLLMs: make_dllm(seed=0, hidden=32, layers=2)."""
    return lambda **kwargs: make_tiny_dllm(char_tokenizer, **kwargs)


def save_tiny_dllm(path: Path, tokenizer) -> Path:
    """A tiny native dLLM (seed 0) saved with `tokenizer` as a model directory at `path` (for module fixtures)."""
    make_tiny_dllm(tokenizer).model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def saved_model(tiny_policy, char_tokenizer, tmp_path):
    """A tiny native dLLM saved with its tokenizer as a model directory; returns the path."""
    path = tmp_path / "model"
    tiny_policy.model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return str(path)


def weights_checksum(model_dir) -> tuple[float, float]:
    """(sum of every weight, sum of every weight times ((its flat index mod 7) - 3)) of a model directory, in
    float64: the golden-number tests pin it. The second sum catches updates that move weights by equal and
    opposite amounts."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    total = weighted = 0.0
    for key in sorted(weights):
        flat = weights[key].double().flatten()
        total += float(flat.sum())
        weighted += float((flat * (torch.arange(flat.numel(), dtype=torch.float64) % 7 - 3)).sum())
    return total, weighted


@pytest.fixture
def checksum():
    return weights_checksum


def fake_rows(source: str, n: int, prompts: int = 1, C: int = 4, P: int = 3, texts=None, estimator=None):
    """`n` buffer rows of `source` with made-up tokens (ids 5..), every completion token counted, rows spread
    evenly over `prompts` prompts, no rewards yet; scored with `estimator` (mean-field by default)."""
    import torch

    from dllm_rl.buffer import Rows
    from dllm_rl.likelihood.estimators import build_estimator

    ids_NL = 5 + torch.arange(n * (P + C)).remainder(20).view(n, P + C)
    return Rows(source, ids_NL, torch.ones_like(ids_NL), P, torch.ones(n, C), None,
                torch.arange(n) * prompts // n, [], list(texts or [""] * n), version=0,
                estimator=estimator or build_estimator({"name": "mean_field"}))


@pytest.fixture
def make_rows():
    return fake_rows


class DigitShare:
    """Arithmetic prompts with a dense reward an untrained model earns (the share of digits in its completion,
    correct above 0.2), and the arithmetic solver as its exact solver (an external policy)."""

    name = "digit_share"
    prompt_style = "compact"

    def examples(self, split, n, seed):
        from dllm_rl.data import build_task

        return build_task("arithmetic").examples(split, n, seed)

    def prompt(self, ex) -> str:
        from dllm_rl.data import build_task

        return build_task("arithmetic").prompt(ex)

    def reward(self, completion: str, ex):
        from dllm_rl.data.task import Reward

        share = sum(c.isdigit() for c in completion) / max(1, len(completion))
        return Reward(share, share > 0.2, False, "ok")

    def solve(self, ex):
        from dllm_rl.data import build_task

        return build_task("arithmetic").solve(ex)


class DigitPass(DigitShare):
    """DigitShare's pass/fail: reward 1 where the share of digits passes 0.2, so groups are often flat (what
    rollout curation acts on)."""

    name = "digit_pass"
    threshold = 0.2

    def reward(self, completion: str, ex):
        from dllm_rl.data.task import Reward

        share = sum(c.isdigit() for c in completion) / max(1, len(completion))
        return Reward(float(share > self.threshold), share > self.threshold, False, "ok")


class DigitAny(DigitPass):
    """DigitPass at a share of 0.05: most rollouts of an untrained model pass, so groups are often all correct
    (what EchoRL's clips learn from)."""

    name = "digit_any"
    threshold = 0.05


class DigitRelabel(DigitPass):
    """DigitPass whose problem names its threshold: a failed completion with some digits exactly solves the problem
    whose threshold is half its share (a task that can relabel every near miss, for the plumbing of a run)."""

    name = "digit_relabel"

    def prompt(self, ex) -> str:
        return super().prompt(ex) + f" (over {ex.meta.get('threshold', 0.2):g})"

    def reward(self, completion: str, ex):
        from dllm_rl.data.task import Reward

        share = sum(c.isdigit() for c in completion) / max(1, len(completion))
        ok = share > ex.meta.get("threshold", 0.2)
        return Reward(float(ok), ok, False, "ok")

    def relabel(self, completion: str, ex):
        share = sum(c.isdigit() for c in completion) / max(1, len(completion))
        if share == 0:
            return None
        from dllm_rl.data.task import Example

        return Example(self.name, f"{ex.uid}|{share / 2:.4f}", ex.question, ex.answer, {"threshold": share / 2})


class Counter(Env):
    """A user's environment for the multi-turn tests (by import path: env.name=tests.conftest:Counter), with short
    texts for a tiny model's context: count from 1 or 2 up to 3; any text with a u says up, with a d
    down."""

    name, max_turns = "counter", 4

    def _reset(self, rng):
        self.n = rng.randint(1, 2)

    def describe(self):
        return "Reach 3."

    def observe(self):
        return f"n={self.n}"

    def parse(self, text):
        return "up" if "u" in text else "down" if "d" in text else None

    def apply(self, move):
        self.n += 1 if move == "up" else -1
        return "success" if self.n == 3 else None

    def anchor(self):
        return self.n

    def solve(self):
        return ["up"] * (3 - self.n)
