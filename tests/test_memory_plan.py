"""scripts/memory_plan.py: parameter counts of the published 8B models and the ZeRO accounting, by hand."""

import importlib.util
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("memory_plan", Path(__file__).parents[1] / "scripts" / "memory_plan.py")
plan = importlib.util.module_from_spec(spec)
sys.modules["memory_plan"] = plan  # dataclasses look their module up
spec.loader.exec_module(plan)


def test_the_published_models_have_their_published_sizes():
    assert plan.llada_8b().parameters == pytest.approx(8.02e9, rel=2e-3)  # "LLaDA-8B": 8.02B
    assert plan.dream_7b().parameters == pytest.approx(7.62e9, rel=2e-3)  # Qwen2.5-7B's 7.62B


def test_the_accounting_by_hand():
    toy = plan.Dims("toy", vocab=10, hidden=4, layers=2, linear=((4, 4), (4, 8)))
    # per block: 16 + 32 weights + 2 norms of 4 = 56; heads 2 * 40; final norm 4 -> 2 * 56 + 80 + 4
    assert toy.parameters == 196
    assert toy.lora_parameters(2) == 2 * (2 * 8 + 2 * 12)  # r (in + out) per linear layer, per block
    full = plan.model_state(toy, ranks=2, stage=2, reference=True)
    assert full["weights"] * 1e9 == 2 * 196 and full["gradients"] * 1e9 == 196 and full["optimizer"] * 1e9 == 6 * 196
    assert full["reference"] * 1e9 == 2 * 196
    lora = plan.model_state(toy, ranks=2, stage=3, lora_r=2, reference=True)
    assert lora["weights"] * 1e9 == pytest.approx((2 * 196 + 2 * 80) / 2) and lora["reference"] == 0
    assert lora["optimizer"] * 1e9 == pytest.approx(12 * 80 / 2)
