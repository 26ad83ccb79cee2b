"""Where a run's randomness comes from: seeds derived from named parts, and one generator per row.

Every random draw of training and evaluation is a function of a few named parts, e.g. (seed, "rollout", step,
row) or (seed, prompt index, sample index), never of a global RNG or of which other rows share a batch. A
seed is a 63-bit hash of the parts (blake2b, stable across processes, unlike Python's `hash`), and a batch
draws from one `torch.Generator` per row.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any parts: `derive_seed(seed, "mask", step, row)`."""
    import hashlib

    digest = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def row_generators(seeds: Sequence[int], device: torch.device | str | None = None) -> list[torch.Generator]:
    """One generator per row, seeded with the row's seed, on the device that draws from it."""
    return [torch.Generator(device=device or "cpu").manual_seed(int(s)) for s in seeds]
