import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

import dllm_rl  # noqa: F401  (registers the Auto classes)
from dllm_rl.policy.modeling import DiffusionLM, DiffusionLMConfig, rotary


def test_left_padding_does_not_change_real_positions(tiny_policy):
    model = tiny_policy.model
    ids = torch.randint(5, 100, (2, 12))
    plain = model(ids).logits
    pad = torch.zeros(2, 5, dtype=torch.long)
    padded_ids = torch.cat([pad, ids], 1)
    mask = torch.cat([torch.zeros_like(pad), torch.ones_like(ids)], 1)
    padded = model(padded_ids, attention_mask=mask).logits[:, 5:]
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)


def test_attention_is_bidirectional(tiny_policy):
    ids = torch.randint(5, 100, (1, 10))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1 - 5) % 95 + 5
    # A change to the last token moves the first position's logits: no causal mask.
    assert not torch.allclose(tiny_policy.model(ids).logits[0, 0], tiny_policy.model(changed).logits[0, 0])


def test_rotary_is_a_relative_rotation():
    # <R(m) q, R(n) k> depends on m - n only.
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    def dot(m, n):
        return (rotary(q, torch.tensor([[m]]), 100.0) * rotary(k, torch.tensor([[n]]), 100.0)).sum()
    torch.testing.assert_close(dot(3, 1), dot(7, 5))
    assert not torch.allclose(dot(3, 1), dot(3, 2))
    torch.testing.assert_close(rotary(q, torch.tensor([[0]]), 100.0), q)


def test_save_load_round_trip_through_auto_classes(tiny_policy, tmp_path):
    tiny_policy.model.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, DiffusionLMConfig) and config.mask_token_id == tiny_policy.mask_id
    ids = torch.randint(5, 100, (2, 9))
    for auto in (AutoModel, AutoModelForMaskedLM):
        loaded = auto.from_pretrained(tmp_path).eval()
        assert isinstance(loaded, DiffusionLM)
        torch.testing.assert_close(loaded(ids).logits, tiny_policy.model(ids).logits, rtol=0, atol=0)


def test_tied_embeddings_share_one_matrix_through_training_and_save_load(tmp_path):
    sizes = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    untied, model = (DiffusionLM(DiffusionLMConfig(**sizes)),
                     DiffusionLM(DiffusionLMConfig(**sizes, tie_word_embeddings=True)))
    assert untied.lm_head.weight is not untied.embed.weight
    assert model.lm_head.weight is model.embed.weight
    assert model.num_parameters() == untied.num_parameters() - 40 * 16
    model(torch.randint(5, 40, (1, 6))).logits.sum().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    model.save_pretrained(tmp_path)
    loaded = DiffusionLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.embed.weight
    torch.testing.assert_close(loaded.embed.weight, model.embed.weight, rtol=0, atol=0)


def test_bf16_autocast_runs_and_stays_close(tiny_policy):
    ids = torch.randint(5, 100, (2, 16))
    fp32 = tiny_policy.model(ids).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = tiny_policy.model(ids).logits
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - fp32).abs().max() < 0.05 * fp32.abs().max()


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="hidden_size=30 must split into num_attention_heads=4"):
        DiffusionLMConfig(hidden_size=30, num_attention_heads=4)
