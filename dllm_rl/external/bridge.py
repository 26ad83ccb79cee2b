"""From external text to rows the dLLM can be trained on: the cross-tokenizer bridge and length control.

The external policy writes text in its own tokenizer. The bridge re-encodes that text with the dLLM's
tokenizer and lays it out the way the dLLM's sampler lays out its own completions: the completion tokens,
then EOS fill up to the end of the generation window (so the first EOS ends the scored part). Characters
the dLLM's tokenizer cannot represent (they come back as unk, or not at all) are reported per rollout; the
trainer drops such rollouts with a warning that names the characters, rather than teaching the dLLM to
write unk.

Length control is relative to the dLLM's generation window C (`rollout.gen_length`). ERILS reports that
uncontrolled, longer external rollouts degrade the dLLM; the exact rule is not public, so it is an option:

| rule      | an external rollout of n > C tokens                       | among the candidates of a prompt       |
|-----------|-----------------------------------------------------------|----------------------------------------|
| drop      | removed                                                   | the first `per_prompt` that survive    |
| truncate  | cut to C tokens, then re-verified (re-scored)             | the first `per_prompt`                 |
| shortest  | removed                                                   | the `per_prompt` shortest that survive |
| none      | kept whole: the external rows get a window of their own   | the first `per_prompt`                 |
|           | length (the uncontrolled arm of the ablation)             |                                        |
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from dllm_rl.errors import pick, require

LENGTH_RULES = ("drop", "truncate", "shortest", "none")


@dataclass(frozen=True)
class Bridged:
    """An external rollout in the dLLM's vocabulary. `text` is what those ids decode to (what the dLLM
    would write, and what is scored); `lost` lists characters of the source text the tokenizer lost."""

    ids: tuple[int, ...]
    text: str
    lost: str = ""
    truncated: bool = False


def lost_characters(text: str, decoded: str) -> str:
    """Characters of `text` missing from `decoded`, its round trip through a tokenizer (unk, dropped or
    normalised away), sorted."""
    return "".join(sorted(Counter(text) - Counter(decoded)))


def bridge(text: str, tokenizer) -> Bridged:
    """Re-encode external `text` with the dLLM's tokenizer (no special tokens added)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return Bridged(tuple(ids), decoded, lost_characters(text, decoded))


def window_row(ids: Sequence[int], window: int, eos_id: int) -> list[int]:
    """The completion window the sampler would produce: the tokens, then EOS fill to `window`."""
    require(len(ids) <= window, f"{len(ids)} tokens do not fit a window of {window}")
    return list(ids) + [eos_id] * (window - len(ids))


def truncate(b: Bridged, window: int, tokenizer) -> Bridged:
    if len(b.ids) <= window:
        return b
    ids = b.ids[:window]
    return replace(b, ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True,
                                                     clean_up_tokenization_spaces=False), truncated=True)


def control_length(
    bridged: Sequence[Bridged],
    score: Callable[[str], object],
    *,
    rule: str,
    window: int,
    tokenizer,
) -> tuple[list[tuple[int, Bridged, object]], dict[str, int]]:
    """Apply the length rule to one prompt's candidates: ([(index, kept rollout, its reward)], counts).

    `score(text)` is the task's reward for the prompt; under `truncate` it re-scores the cut text, so a
    truncated answer is judged by what is left of it. Order is preserved (`select` picks afterwards)."""
    pick({r: r for r in LENGTH_RULES}, rule, "mixing.length_rule")
    kept = []
    counts = {"too_long": 0, "truncated": 0}
    for index, b in enumerate(bridged):
        if len(b.ids) > window:
            counts["too_long"] += 1
            if rule in ("drop", "shortest"):
                continue
            if rule == "truncate":
                b = truncate(b, window, tokenizer)
                counts["truncated"] += 1
        kept.append((index, b, score(b.text)))
    return kept, counts


def select(lengths: Sequence[int], per_prompt: int, rule: str) -> list[int]:
    """Which candidates (by position) a prompt keeps: the `per_prompt` shortest under `shortest`, else the first."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i)) if rule == "shortest" else range(len(lengths))
    return list(order)[:per_prompt]
