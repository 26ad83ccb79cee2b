"""Drafts for speculative sampling from a causal LM: per-prompt trees of its earlier rollouts (SRT).

SRT (arXiv 2601.09083): in RL the rollouts of one prompt resemble each other across steps, so the earlier ones
make a model-free draft. Here the external autoregressive policy of ERILS is frozen, so its rollouts of a prompt
come from one distribution and the draft only gets better with time. The sampler that verifies the drafts is
`rollout.causal.sample_speculative`: whatever the drafts, it writes the tokens plain sampling writes.

`DraftForest` keeps one `DraftTree` per prompt within a memory budget: `capacity` rollout tokens over all trees
(a tree holds its prompt's last `history` rollouts; each token costs about 130 bytes of dict entries at
`match` = 4). Past the budget the least recently used prompts' trees are dropped. Trees live in memory only: a
resumed run, or an evicted prompt, starts with an empty tree, which changes the speed, never the rows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from dllm_rl.errors import require

START = -1  # the context before a completion's first token (anchors early contexts at the start)


class DraftTree:
    """The next-token counts after every context of 1..`match` tokens in the last `history` completions of one
    prompt: a suffix tree cut at depth `match` + 1. `draft` follows the longest context that matches the end of
    the tokens so far, taking the most frequent next token (ties: the smallest id), for up to k tokens."""

    def __init__(self, match: int = 4, history: int = 16):
        require(match >= 1 and history >= 1, f"draft_match and draft_history must be >= 1, got {match}, {history}")
        self.match, self.history = match, history
        self.rollouts: deque[tuple[int, ...]] = deque()
        self.next: dict[tuple[int, ...], dict[int, int]] = {}
        self.tokens = 0  # tokens of the rollouts held

    def __len__(self) -> int:
        return len(self.rollouts)

    def insert(self, tokens: Sequence[int]) -> None:
        """Add one completion (up to and including its EOS); the oldest leaves once there are `history`."""
        seq = (START, *tokens)
        self.rollouts.append(seq)
        self._count(seq, +1)
        self.tokens += len(seq) - 1
        if len(self.rollouts) > self.history:
            oldest = self.rollouts.popleft()
            self._count(oldest, -1)
            self.tokens -= len(oldest) - 1

    def _count(self, seq: tuple[int, ...], delta: int) -> None:
        for t in range(1, len(seq)):
            for m in range(1, min(self.match, t) + 1):
                counts = self.next.setdefault(seq[t - m : t], {})
                counts[seq[t]] = counts.get(seq[t], 0) + delta
                if counts[seq[t]] == 0:
                    del counts[seq[t]]
                    if not counts:
                        del self.next[seq[t - m : t]]

    def draft(self, tokens: Sequence[int], k: int, stop: int | None = None) -> list[int]:
        """Up to `k` tokens to follow `tokens` (ending after `stop`, the EOS, if drafted)."""
        context = [START, *tokens] if len(tokens) < self.match else list(tokens[-self.match :])
        out: list[int] = []
        while len(out) < k:
            token = self.most_frequent(context)
            if token is None:
                break
            out.append(token)
            context.append(token)
            if token == stop:
                break
        return out

    def most_frequent(self, context: Sequence[int]) -> int | None:
        """The most frequent next token after the longest context that matches the end of `context`."""
        for m in range(min(self.match, len(context)), 0, -1):
            counts = self.next.get(tuple(context[-m:]))
            if counts:
                return max(counts.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        return None


class DraftForest:
    """One `DraftTree` per prompt key, holding at most `capacity` rollout tokens in all; past it the least
    recently used trees are dropped (a prompt's tree counts as used when it drafts or takes in rollouts)."""

    def __init__(self, match: int = 4, history: int = 16, capacity: int = 1_000_000):
        require(capacity >= 1, f"external.draft_capacity must be >= 1, got {capacity}")
        self.match, self.history, self.capacity = match, history, capacity
        self.trees: OrderedDict[str, DraftTree] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self.trees)

    def tree(self, key: str) -> DraftTree:
        """The prompt's tree (a new, empty one for a prompt without), now the most recently used."""
        if key not in self.trees:
            self.trees[key] = DraftTree(self.match, self.history)
        self.trees.move_to_end(key)
        return self.trees[key]

    def insert(self, key: str, tokens: Sequence[int]) -> None:
        """Add one completion to the prompt's tree, then drop the least recently used trees over capacity."""
        tree = self.tree(key)
        before = tree.tokens
        tree.insert(tokens)
        self.tokens += tree.tokens - before
        while self.tokens > self.capacity and len(self.trees) > 1:
            _, oldest = self.trees.popitem(last=False)
            self.tokens -= oldest.tokens
