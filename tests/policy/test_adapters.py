"""The LLaDA and Dream adapters, against small stand-in checkpoints that follow the interfaces documented in
`dllm_rl/policy/adapters.py` and load the real way: `trust_remote_code` from a local directory."""

import json

import pytest
import yaml
import torch
from transformers import AutoConfig, AutoModel

from dllm_rl.errors import ConfigError
from dllm_rl.policy.adapters import load_policy, wrap_model

STANDIN_CODE = '''
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class StandInConfig(PretrainedConfig):
    model_type = "MODEL_TYPE"

    def __init__(self, vocab_size=110, hidden_size=16, shifted=False, mask_token_id=None, **kwargs):
        self.vocab_size, self.hidden_size, self.shifted, self.mask_token_id = vocab_size, hidden_size, shifted, mask_token_id
        super().__init__(**kwargs)


class StandInModel(PreTrainedModel):
    """Bidirectional mixing of token + position embeddings. LLaDA-like: 2-D key mask, absolute positions.
    Dream-like (shifted=True): a 4-D boolean mask or "full", explicit position ids, and logits[:, i]
    predicting token i + 1."""

    config_class = StandInConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos = nn.Embedding(64, config.hidden_size)
        self.mix = nn.Linear(config.hidden_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.5)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        B, L = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(L).expand(B, L)
        h = self.embed(input_ids) + self.pos(position_ids)
        if attention_mask is None or isinstance(attention_mask, str):
            pair = torch.ones(B, L, L, dtype=torch.bool)
        elif attention_mask.dim() == 2:
            pair = attention_mask.bool()[:, None, :].expand(B, L, L)
        else:
            pair = attention_mask.bool()[:, 0]
        w = pair.float()
        ctx = (w @ h) / w.sum(-1, keepdim=True).clamp(min=1)
        logits = self.head(torch.tanh(self.mix(ctx) + h))
        if self.config.shifted:
            logits = torch.cat([logits[:, 1:], logits[:, :1]], 1)
        return CausalLMOutput(logits=logits)
'''


def write_standin(path, model_type, char_tokenizer, shifted, mask_in_config=True):
    path.mkdir()
    (path / "standin.py").write_text(STANDIN_CODE.replace("MODEL_TYPE", model_type))
    config = {
        "model_type": model_type,
        "auto_map": {"AutoConfig": "standin.StandInConfig", "AutoModel": "standin.StandInModel"},
        "vocab_size": len(char_tokenizer), "hidden_size": 16, "shifted": shifted,
        "mask_token_id": char_tokenizer.mask_token_id if mask_in_config else None,
    }
    (path / "config.json").write_text(json.dumps(config))
    char_tokenizer.save_pretrained(path)
    # Weights: initialise once through the remote class and save them next to the code.
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.from_pretrained(path, trust_remote_code=True), trust_remote_code=True)
    model.save_pretrained(path)
    return path


def unshifted_reference(policy, ids, **kwargs):
    """The stand-in's own logits with its shift turned off: what an aligned adapter must return."""
    policy.model.config.shifted = False
    try:
        return policy.model(input_ids=ids, **kwargs).logits
    finally:
        policy.model.config.shifted = True


def test_llada_adapter_passes_logits_through_and_runs_padded_rows_exactly(tmp_path, char_tokenizer):
    """LLaDA's code ignores the mask and numbers positions from 0, so the adapter runs each span of real tokens
    alone: a padded row's logits equal the unpadded row's."""
    path = write_standin(tmp_path / "llada", "llada", char_tokenizer, False)
    policy, tokenizer = load_policy(str(path), trust_remote_code=True)
    assert policy.kind == "llada" and not policy.shifted
    assert policy.mask_id == char_tokenizer.mask_token_id
    ids = torch.randint(5, 100, (2, 10))
    torch.testing.assert_close(policy.logits(ids), policy.model(input_ids=ids).logits)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    logits = policy.logits(ids, mask)
    torch.testing.assert_close(logits[0, 3:], policy.model(input_ids=ids[:1, 3:]).logits[0])
    torch.testing.assert_close(logits[1], policy.model(input_ids=ids[1:]).logits[0])
    assert not logits[0, :3].any()  # padding positions carry nothing


def test_by_real_span_is_exact_for_a_model_that_ignores_the_mask():
    """A stand-in that ignores the mask and uses absolute positions: any padding pattern, grouped rows."""
    from dllm_rl.errors import ConfigError
    from dllm_rl.policy.adapters import by_real_span

    torch.manual_seed(0)
    table, position = torch.randn(50, 7), torch.randn(16, 7)
    calls = []

    def forward(ids_BL):  # every token sees every other token, positions from 0
        calls.append(tuple(ids_BL.shape))
        h = table[ids_BL] + position[: ids_BL.shape[1]]
        return h + h.mean(1, keepdim=True)

    rows = [torch.randint(1, 50, (n,)) for n in (5, 9, 5, 3)]
    ids = torch.zeros(4, 12, dtype=torch.long)
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, (7, 3, 7, 0))):  # left padding, and one right-padded row
        ids[i, start:start + len(row)], mask[i, start:start + len(row)] = row, 1
    out = by_real_span(forward, ids, mask)
    for i, (row, start) in enumerate(zip(rows, (7, 3, 7, 0))):
        torch.testing.assert_close(out[i, start:start + len(row)], forward(row[None])[0])
    assert sorted(calls[:3]) == [(1, 3), (1, 9), (2, 5)]  # rows 0 and 2 share a span: one forward
    holes = mask.clone()
    holes[1, 5] = 0
    with pytest.raises(ConfigError, match="not contiguous"):
        by_real_span(forward, ids, holes)


def test_dream_adapter_unshifts_and_passes_positions(tmp_path, char_tokenizer):
    policy, _ = load_policy(str(write_standin(tmp_path / "dream", "Dream", char_tokenizer, True)),
                            trust_remote_code=True)
    assert policy.kind == "dream" and policy.shifted
    ids = torch.randint(5, 100, (2, 10))
    aligned = policy.logits(ids)
    # Position 0 is always a prompt token; from 1 on, row i is the model's prediction for token i.
    torch.testing.assert_close(aligned[:, 1:], unshifted_reference(policy, ids)[:, 1:])
    # With left padding the adapter builds Dream's 4-D mask and real-token positions, so a row's logits
    # at real positions do not depend on its padding.
    padded = torch.cat([torch.zeros(2, 4, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(2, 4, dtype=torch.long), torch.ones_like(ids)], 1)
    torch.testing.assert_close(policy.logits(padded, mask)[:, 5:], aligned[:, 1:], rtol=1e-5, atol=1e-5)


def test_mask_id_from_the_tokenizer_when_the_config_has_none(tmp_path, char_tokenizer):
    path = write_standin(tmp_path / "llada", "llada", char_tokenizer, False, mask_in_config=False)
    policy, _ = load_policy(str(path), trust_remote_code=True)
    assert policy.mask_id == char_tokenizer.mask_token_id


def test_native_wrap_and_bad_inputs(tiny_policy, tmp_path):
    assert tiny_policy.kind == "native" and not tiny_policy.shifted
    ids = torch.randint(5, 100, (1, 6))
    torch.testing.assert_close(tiny_policy.logits(ids), tiny_policy.model(ids).logits)
    with pytest.raises(ConfigError, match="unknown policy kind 'lada'"):
        wrap_model(tiny_policy.model, "lada")
    with pytest.raises(ConfigError, match="expected a local model directory"):
        load_policy(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="unknown dtype 'float16'"):
        tiny_policy.model.save_pretrained(tmp_path / "m")
        load_policy(str(tmp_path / "m"), dtype="float16")


def test_hidden_size_read_from_the_config_file(tmp_path):
    from dllm_rl.policy.adapters import hidden_size_of

    assert hidden_size_of("models/tiny-dllm") == 256
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llada", "d_model": 4096}))
    assert hidden_size_of(str(tmp_path)) == 4096  # LLaDA names it d_model
    assert hidden_size_of(str(tmp_path / "missing")) is None


def test_no_command_runs_a_checkpoints_own_code_without_consent(tmp_path, char_tokenizer):
    """A directory whose config.json says llada and maps its classes to its own Python: without
    trust_remote_code=true every command stops with a named error before that Python is imported."""
    from dllm_rl import cli

    planted = write_standin(tmp_path / "planted", "llada", char_tokenizer, False)
    marker = tmp_path / "code_ran"
    (planted / "standin.py").write_text(f"open({str(marker)!r}, 'w').close()\n" + (planted / "standin.py").read_text())
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"  # a planted training checkpoint for export
    checkpoint.mkdir(parents=True)
    for name in ("config.json", "standin.py"):
        (checkpoint / name).write_text((planted / name).read_text())
    (checkpoint / "deepspeed").mkdir()
    commands = [["eval", f"model={planted}", "num_prompts=1"], ["generate", f"model={planted}"],
                ["sft", f"model={planted}", "steps=1"],
                ["train", f"model={planted}", "steps=1", f"run_dir={tmp_path / 't'}"],
                ["export", f"checkpoint={checkpoint}", f"output_dir={tmp_path / 'out'}"],
                ["train", "+experiment=llada8b_d1", f"model={planted}", "steps=1", f"run_dir={tmp_path / 'r'}"],
                ["train", "+experiment=dream7b_d1", f"model={planted}", "steps=1", f"run_dir={tmp_path / 'd'}"]]
    for command in commands:  # the recipes name LLaDA and Dream, but consent is not theirs to give
        assert cli.main(command) == 2, command
        assert not marker.exists(), command
    with pytest.raises(ConfigError, match=r"is a llada checkpoint: its model code ships in the directory .* pass "
                                          r"trust_remote_code=true if you trust"):
        load_policy(str(planted))
    assert not marker.exists()
    policy, _ = load_policy(str(planted), trust_remote_code=True)  # with consent it loads, and its code ran
    assert policy.kind == "llada" and marker.exists()


def test_consent_comes_from_the_command_line_or_the_environment_never_a_config_file(monkeypatch, capsys):
    from dllm_rl import cli

    def consent(*args: str) -> list[bool]:
        assert cli.main([*args, "--cfg"]) == 0
        cfg = yaml.safe_load(capsys.readouterr().out)
        return [cfg["trust_remote_code"], cfg["external"].get("trust_remote_code")]

    recipe = ["train", "+experiment=llada8b_erils"]  # a causal LM external: two consent keys
    monkeypatch.delenv(cli.CONSENT_ENV, raising=False)
    assert consent(*recipe) == [False, False]
    assert consent(*recipe, "trust_remote_code=true") == [True, False]
    assert consent(*recipe, "external.trust_remote_code=true") == [False, True]
    monkeypatch.setenv(cli.CONSENT_ENV, "1")
    assert consent(*recipe) == [True, True]
    assert consent(*recipe, "trust_remote_code=false") == [False, True]  # the command line has the last word
    monkeypatch.setenv(cli.CONSENT_ENV, "yes please")
    assert cli.main([*recipe, "--cfg"]) == 2
    assert "DLLM_RL_TRUST_REMOTE_CODE='yes please': expected 1 (consent) or 0" in capsys.readouterr().err


def test_the_context_length_is_read_under_each_models_name(tiny_policy):
    """`max_position_embeddings` (native, Dream) or LLaDA's `max_sequence_length`, through any wrapper."""
    import types

    from dllm_rl.policy.adapters import DiffusionPolicy

    assert tiny_policy.context_length == tiny_policy.model.config.max_position_embeddings
    llada_like = types.SimpleNamespace(config=types.SimpleNamespace(max_sequence_length=4096, d_model=8))
    assert DiffusionPolicy(llada_like, "llada", 1).context_length == 4096
    engine_like = types.SimpleNamespace(module=llada_like, config={"train_batch_size": 8})
    assert DiffusionPolicy(engine_like, "llada", 1).context_length == 4096
    assert DiffusionPolicy(types.SimpleNamespace(config=types.SimpleNamespace()), "llada", 1).context_length is None
