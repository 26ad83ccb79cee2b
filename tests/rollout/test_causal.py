import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dllm_rl.rollout.causal import sample_causal
from dllm_rl.rollout.sampler import left_pad
from dllm_rl.seeds import row_generators

PROMPTS = ["Compute 12 + 7\n", "x", "Countdown. Numbers: [1, 2, 3]\n"]


@pytest.fixture(scope="module")
def tiny_ar(char_tokenizer):
    config = Qwen2Config(vocab_size=len(char_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         pad_token_id=char_tokenizer.pad_token_id, eos_token_id=char_tokenizer.eos_token_id)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def encode(tokenizer, texts):
    return left_pad([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tokenizer.pad_token_id)


def test_greedy_equals_transformers_generate(tiny_ar, char_tokenizer):
    ids, mask = encode(char_tokenizer, PROMPTS)
    ours = sample_causal(tiny_ar, ids, mask, max_new_tokens=12, eos_id=char_tokenizer.eos_token_id)
    reference = tiny_ar.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                 eos_token_id=char_tokenizer.eos_token_id, pad_token_id=char_tokenizer.eos_token_id)
    width = reference.shape[1]
    assert torch.equal(ours.sequences_BL[:, :width], reference)


def test_sampling_batched_equals_per_row_and_probabilities(tiny_ar, char_tokenizer):
    ids, mask = encode(char_tokenizer, PROMPTS)
    out = sample_causal(tiny_ar, ids, mask, max_new_tokens=10, eos_id=char_tokenizer.eos_token_id,
                        temperature=1.0, generators=row_generators([5, 6, 7]))
    for j, text in enumerate(PROMPTS):
        one_ids, one_mask = encode(char_tokenizer, [text])
        one = sample_causal(tiny_ar, one_ids, one_mask, max_new_tokens=10, eos_id=char_tokenizer.eos_token_id,
                            temperature=1.0, generators=row_generators([5 + j]))
        assert torch.equal(one.completion_BC[0], out.completion_BC[j])
        torch.testing.assert_close(one.confidence_BC[0], out.confidence_BC[j], rtol=1e-4, atol=1e-6)
    assert ((out.confidence_BC > 0) & (out.confidence_BC <= 1)).all()


class ForceEOS(torch.nn.Module):
    """Wraps a causal LM and makes EOS the certain first token of the rows in `rows` (at the prompt's forward,
    when the batch still holds every row: finished rows leave it later)."""

    def __init__(self, model, eos_id, rows):
        super().__init__()
        self.model, self.eos_id, self.rows = model, eos_id, rows

    def forward(self, cache=None, **kwargs):
        out = self.model(cache=cache, **kwargs)
        if cache is None:
            out.logits[self.rows, :, self.eos_id] = 1e4
        return out


def test_rows_are_filled_with_eos_after_finishing(tiny_ar, char_tokenizer):
    eos = char_tokenizer.eos_token_id
    ids, mask = encode(char_tokenizer, PROMPTS)
    free = sample_causal(tiny_ar, ids, mask, max_new_tokens=8, eos_id=eos)
    out = sample_causal(ForceEOS(tiny_ar, eos, [0]), ids, mask, max_new_tokens=8, eos_id=eos)
    assert out.completion_BC[0].tolist() == [eos] * 8
    assert torch.equal(out.completion_BC[1:], free.completion_BC[1:])
    everyone = sample_causal(ForceEOS(tiny_ar, eos, [0, 1, 2]), ids, mask, max_new_tokens=8, eos_id=eos)
    assert (everyone.completion_BC == eos).all() and everyone.completion_BC.shape == (3, 8)
