import pytest
from transformers import AutoTokenizer

from dllm_rl.data.tokenizers import (
    SIMPLE_CHAT_TEMPLATE, SPECIAL_TOKENS, build_bpe_tokenizer, build_char_tokenizer, load_tokenizer,
    unknown_characters,
)
from dllm_rl.errors import ConfigError

TEXT = "<reasoning>\n3*5=15\n</reasoning>\n<answer>\n3*5+7\n</answer>"


def check_special_tokens(tok):
    ids = {name: getattr(tok, f"{name}_id") for name in SPECIAL_TOKENS}
    assert None not in ids.values()
    assert len(set(ids.values())) == len(ids)  # pad != mask != eos != bos != unk
    assert tok.pad_token_id != tok.mask_token_id


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_round_trip_through_save_pretrained(kind, tmp_path):
    if kind == "char":
        tok = build_char_tokenizer(chat_template=SIMPLE_CHAT_TEMPLATE)
    else:
        tok = build_bpe_tokenizer([TEXT, "Numbers: [3, 5, 7]\nTarget: 22"] * 50, vocab_size=300,
                                  chat_template=SIMPLE_CHAT_TEMPLATE)
    check_special_tokens(tok)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    check_special_tokens(loaded)
    assert loaded(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert ({n: getattr(loaded, f"{n}_id") for n in SPECIAL_TOKENS}
            == {n: getattr(tok, f"{n}_id") for n in SPECIAL_TOKENS})
    assert loaded.chat_template == SIMPLE_CHAT_TEMPLATE
    assert load_tokenizer(str(tmp_path))(TEXT, add_special_tokens=False)["input_ids"] == ids


def test_char_tokenizer_is_one_token_per_character():
    tok = build_char_tokenizer(alphabet="ab\n")
    assert tok.convert_ids_to_tokens(tok("ab\nba", add_special_tokens=False)["input_ids"]) == list("ab\nba")
    assert len(tok) == len(SPECIAL_TOKENS) + 3
    # Special tokens in text are single tokens.
    assert tok("a<|mask|>b", add_special_tokens=False)["input_ids"] == [5, tok.mask_token_id, 6]


def test_char_tokenizer_keeps_standalone_numbers_whole_and_long_digit_runs_per_digit(tmp_path):
    tok = build_char_tokenizer(number_digits=2)
    assert len(tok) == len(build_char_tokenizer()) + 100                  # "00".."99"; one digit exists
    pieces = lambda t, text: t.convert_ids_to_tokens(t(text, add_special_tokens=False)["input_ids"])
    assert pieces(tok, "[83, 7, 05]\n<answer>83-7*05</answer>")[:8] == ["[", "83", ",", " ", "7", ",", " ", "05"]
    assert pieces(tok, "=83-7*05<")[1:6] == ["83", "-", "7", "*", "05"]
    assert pieces(tok, "Target: 100") [-3:] == ["1", "0", "0"]               # wider than number_digits
    assert pieces(tok, "Puzzle: 0124041300400030")[-16:] == list("0124041300400030")  # grid cells line up
    text = "Numbers: [41, 88, 17]\nTarget: 64 0124"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and tok.unk_token_id not in ids
    tok.save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path))(text, add_special_tokens=False)["input_ids"] == ids
    with pytest.raises(ConfigError, match="number_digits must be an integer in \\[0, 3\\], got 5"):
        build_char_tokenizer(number_digits=5)


def test_padding_single_digits_gives_every_number_below_100_two_digits_and_decodes_back(tmp_path):
    tok = build_char_tokenizer(pad_single_digits=True)
    assert len(tok) == len(build_char_tokenizer())                         # no new tokens, only a normalizer
    pieces = lambda t, text: t.convert_ids_to_tokens(t(text, add_special_tokens=False)["input_ids"])
    text = "Countdown. Numbers: [83, 4, 64]\nTarget: 7\n<answer>83 -64 -4</answer>"
    assert pieces(tok, text)[20:32] == list("[83, 04, 64]")
    assert "".join(pieces(tok, text)[32:44]) == "\nTarget: 07\n"
    assert "".join(pieces(tok, text)).endswith("<answer>83 -64 -04</answer>")
    for unchanged in ("Puzzle: 0124041300400030", "Target: 100", "x 42 y", "v10"):
        assert "".join(pieces(tok, unchanged)) == unchanged                  # runs of other lengths
    assert "".join(pieces(tok, "0 9x")) == "00 09x"
    for text in (text, "Puzzle: 0124041300400030 0 and 9", TEXT):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text and tok.unk_token_id not in ids     # the zero is stripped again
        tok.save_pretrained(tmp_path)
        assert load_tokenizer(str(tmp_path))(text, add_special_tokens=False)["input_ids"] == ids
        assert load_tokenizer(str(tmp_path)).decode(ids) == text
    assert tok.decode(tok("[05, 5]", add_special_tokens=False)["input_ids"]) == "[5, 5]"  # the documented loss


def test_unknown_characters_are_reported_not_dropped():
    tok = build_char_tokenizer()
    assert unknown_characters(tok, "héllo €5") == ["é", "€"]
    assert tok.decode(tok("é", add_special_tokens=False)["input_ids"]) == "<|unk|>"
    bpe = build_bpe_tokenizer(["hello"] * 10, vocab_size=300)
    assert unknown_characters(bpe, "héllo €5") == []
    assert bpe.decode(bpe("héllo €5", add_special_tokens=False)["input_ids"]) == "héllo €5"


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size"):
        build_bpe_tokenizer(["x"], vocab_size=10)
    with pytest.raises(ConfigError, match="expected a local tokenizer directory"):
        load_tokenizer(str(tmp_path / "nope"))


def test_a_tokenizer_saved_beside_a_qwen2_model_loads_as_trained(tmp_path):
    # transformers' AutoTokenizer would pick Qwen2Tokenizer from config.json and split digits one by one.
    from transformers import Qwen2Config

    bpe = build_bpe_tokenizer(["Numbers: [41, 88, 17]"] * 50, vocab_size=300, split_digits=False)
    assert "41" in bpe.convert_ids_to_tokens(bpe("41")["input_ids"])  # merged, unlike Qwen2Tokenizer's digits
    bpe.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(bpe), hidden_size=32, num_hidden_layers=1,
                num_attention_heads=4).save_pretrained(tmp_path)
    text = "Numbers: [41, 88, 17]"
    assert (load_tokenizer(str(tmp_path))(text, add_special_tokens=False)["input_ids"]
            == bpe(text, add_special_tokens=False)["input_ids"])


def test_bpe_splits_digits_one_by_one_unless_asked_not_to(tmp_path):
    texts = ["Sudoku. Puzzle: 0124041310400031", "Numbers: [83, 64, 4]\nTarget: 15\n83-64=19"] * 50
    text = "Puzzle: 0124 and 83-64=19"
    split = build_bpe_tokenizer(texts, vocab_size=300)
    pieces = split.convert_ids_to_tokens(split(text, add_special_tokens=False)["input_ids"])
    digits = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digits == list("0124") + list("8364") + list("19")
    assert split.decode(split(text, add_special_tokens=False)["input_ids"]) == text
    split.save_pretrained(tmp_path)
    assert (load_tokenizer(str(tmp_path))(text, add_special_tokens=False)["input_ids"]
            == split(text, add_special_tokens=False)["input_ids"])
    merged = build_bpe_tokenizer(texts, vocab_size=300, split_digits=False)
    assert any(sum(c.isdigit() for c in p) > 1 for p in merged.convert_ids_to_tokens(merged(text)["input_ids"]))
