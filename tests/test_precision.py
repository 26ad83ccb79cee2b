"""`bf16=auto|true|false`: auto follows the CPU's native bf16 support; anything else is named."""

import pytest
import torch

from dllm_rl import precision
from dllm_rl.errors import ConfigError


def test_auto_follows_native_support(monkeypatch):
    assert precision.resolve_bf16(True) is True and precision.resolve_bf16(False) is False
    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    assert precision.resolve_bf16("auto") is True
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    assert precision.resolve_bf16("auto") is False


def test_native_support_is_onednns_answer():
    assert precision.native_bf16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("value", ["yes", "bf16", 1])
def test_bad_values_are_named(value):
    with pytest.raises(ConfigError, match=f"bf16 must be one of true, false or auto, got {value!r}"):
        precision.resolve_bf16(value)


def test_bf16_forced_where_it_is_not_native_runs_with_a_warning(monkeypatch):
    """A run pinned to bf16 on purpose still runs (its numbers are valid), but it is told what it costs."""
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="bf16=true on a CPU without native bf16: autocast runs an emulated kernel"):
        assert precision.resolve_bf16(True) is True
    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.resolve_bf16(True) is True
