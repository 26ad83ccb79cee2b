"""Tokenizers built offline with the `tokenizers` library, wrapped as Hugging Face fast tokenizers.

Two builders, both with the same special tokens (pad, mask, eos, bos, unk; pad != mask, because a
masked-diffusion model must tell "still to be generated" from "nothing here"):

- `build_char_tokenizer`: one token per character of a fixed alphabet (printable ASCII and newline by
  default); a character outside it becomes `<|unk|>`, which `unknown_characters` reports.
- `build_bpe_tokenizer`: byte-level BPE trained on the given texts; represents any text.

Both round-trip through `save_pretrained` / `AutoTokenizer.from_pretrained`. A chat template (Jinja) may
be attached; prompts then go through it (`dllm_rl.data.task.render_prompt`).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dllm_rl.errors import ConfigError, require

SPECIAL_TOKENS = {
    "pad_token": "<|pad|>",
    "mask_token": "<|mask|>",
    "eos_token": "<|eos|>",
    "bos_token": "<|bos|>",
    "unk_token": "<|unk|>",
}
SINGLE_DIGIT = "[0-9](?![0-9])"  # a digit that ends a run (lookahead: pads or unpads only one-digit runs)
DEFAULT_ALPHABET = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")

# A minimal chat template: a user turn, then the assistant's turn opens.
SIMPLE_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def _wrap(tok: Tokenizer, chat_template: str | None, model_max_length: int) -> PreTrainedTokenizerFast:
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **SPECIAL_TOKENS)
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, chat_template: str | None = None, model_max_length: int = 1024,
    number_digits: int = 0, pad_single_digits: bool = False,
) -> PreTrainedTokenizerFast:
    """Special tokens get ids 0-4, then one id per distinct character of `alphabet`, in order.

    `number_digits` > 0 adds one token for every digit string of up to that many digits (after the
    characters), used for a number standing alone: 57 in "[57, 3]" is one token, while a longer digit run
    such as a Sudoku grid 0124041300400030 stays one token per digit, so its cells still line up. A model
    then copies a number from its prompt as one token instead of digit by digit, and its digits cannot be
    mixed with another number's when a masked-diffusion sampler unmasks positions out of order.

    `pad_single_digits` writes every standalone one-digit number with a leading zero before tokenizing
    ("[83, 4, 64]" is read as "[83, 04, 64]") and decoding strips that zero again, so numbers below 100 all
    take two digit tokens. Lists of such numbers then have one fixed layout, and a model can copy a number
    digit by digit from a fixed distance, an identity over 10 digit tokens. A standalone "05" in the input
    decodes as "5"; digit runs of other lengths (Sudoku grids, 100) are unchanged both ways.
    """
    chars = list(dict.fromkeys(alphabet))
    require(chars, "alphabet must contain at least one character")
    require(isinstance(number_digits, int) and 0 <= number_digits <= 3,
            f"number_digits must be an integer in [0, 3], got {number_digits!r}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS.values())}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    for width in range(2, number_digits + 1):
        for n in range(10**width):
            vocab.setdefault(f"{n:0{width}d}", len(vocab))
    pattern = f"(?<![0-9])[0-9]{{1,{number_digits}}}(?![0-9])|." if number_digits else "."
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if pad_single_digits:
        tok.normalizer = normalizers.Replace(Regex(f"(?<![0-9])(?={SINGLE_DIGIT})"), "0")
        tok.decoder = decoders.Sequence([decoders.Fuse(),
                                         decoders.Replace(Regex(f"(?<![0-9])0(?={SINGLE_DIGIT})"), "")])
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return _wrap(tok, chat_template, model_max_length)


def build_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 512, chat_template: str | None = None, model_max_length: int = 1024,
    split_digits: bool = True,
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts` (deterministic for the same texts and size).

    `split_digits` makes every digit its own token, as the Llama and Qwen tokenizers do. Without it, BPE
    merges whatever digit runs are frequent in `texts`: a Sudoku grid like 0124041310400031 became the
    pieces 0|124|0|4|13|10|4|000|31, which no longer line up with the cells, and a number's pieces
    depended on its neighbours."""
    require(vocab_size >= 256 + len(SPECIAL_TOKENS),
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} for byte-level BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if split_digits else byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok, chat_template, model_max_length)


def unknown_characters(tokenizer: PreTrainedTokenizerFast, text: str) -> list[str]:
    """Characters of `text` that `tokenizer` maps to its unknown token (empty for byte-level BPE)."""
    if tokenizer.unk_token_id is None:
        return []
    ids = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [
        text[start:end]
        for tid, (start, end) in zip(ids["input_ids"], ids["offset_mapping"])
        if tid == tokenizer.unk_token_id
    ]


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | None, key: str = "tokenizer", trust_remote_code: bool = False):
    """A tokenizer from a local directory (never a hub id), or None for no path.

    Trap: transformers 5's AutoTokenizer picks the tokenizer class from config.json's model_type when the
    directory also holds a model, and a model-specific class (Qwen2Tokenizer for a Qwen2 model) rebuilds
    its own pre-tokenizer instead of the one in tokenizer.json. A tokenizer saved from a generic fast
    tokenizer (ours) is therefore loaded with the generic class, so it splits text exactly as in training.
    """
    if path is None:
        return None
    directory = Path(path).expanduser()
    require(directory.is_dir(), f"{key}={path!r}: expected a local tokenizer directory")
    config = directory / "tokenizer_config.json"
    try:
        saved_class = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ConfigError(f"{key}={path!r}: {config} is not a JSON object ({error})") from None
    try:
        if saved_class in GENERIC_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(str(directory))
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as error:
        raise ConfigError(f"{key}={path!r}: no tokenizer could be loaded from it ({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0][:300]})") from None
