import math

import pytest
import torch

from dllm_rl.policy.schedule import MaskingSchedule

SCHEDULES = ["linear", "cosine", "polynomial"]


def make(schedule, **kwargs):
    if schedule == "polynomial":
        kwargs.setdefault("exponent", 2.0)
    return MaskingSchedule(schedule=schedule, **kwargs)


def llada_num_transfer_tokens(n_B, steps):
    """Slow, loop-for-loop transcription of LLaDA's get_num_transfer_tokens (from counts, not a mask)."""
    rows = []
    for n in n_B.tolist():
        row = [n // steps] * steps
        for i in range(n % steps):
            row[i] += 1
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------- alpha / mask_prob


def test_alpha_hand_values():
    linear, cosine = MaskingSchedule("linear"), MaskingSchedule("cosine")
    assert linear.alpha(0.25) == pytest.approx(0.75)
    assert linear.mask_prob(0.25) == pytest.approx(0.25)
    assert cosine.alpha(0.5) == pytest.approx(0.70710678, abs=1e-8)
    assert cosine.mask_prob(0.5) == pytest.approx(1 - 0.70710678, abs=1e-8)
    assert make("polynomial", exponent=2.0).alpha(0.5) == pytest.approx(0.75)
    assert isinstance(linear.alpha(0.25), float)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_alpha_endpoints_and_monotone(schedule):
    s = make(schedule)
    assert s.alpha(0.0) == pytest.approx(1.0, abs=1e-7)
    assert s.alpha(1.0) == pytest.approx(0.0, abs=1e-7)
    t = torch.linspace(0, 1, 101)
    a = s.alpha(t)
    assert a.shape == t.shape
    assert torch.all(a[1:] <= a[:-1])
    assert torch.all((a >= 0) & (a <= 1))
    assert torch.allclose(s.mask_prob(t), 1 - a)


def test_alpha_tensor_hand_values():
    t = torch.tensor([0.0, 0.25, 1.0])
    assert torch.allclose(MaskingSchedule("linear").alpha(t), torch.tensor([1.0, 0.75, 0.0]))
    cos = MaskingSchedule("cosine").alpha(t)
    assert torch.allclose(cos, torch.tensor([1.0, math.cos(math.pi / 8), 0.0]), atol=1e-7)


# ---------------------------------------------------------------- add_noise


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_add_noise_endpoints(schedule):
    s = make(schedule)
    ids = torch.arange(1, 61).reshape(3, 20)
    g = torch.Generator().manual_seed(0)
    noisy, masked = s.add_noise(ids, torch.ones(3), mask_id=0, generator=g)
    assert masked.all() and (noisy == 0).all()
    noisy, masked = s.add_noise(ids, torch.zeros(3), mask_id=0, generator=g)
    assert not masked.any() and torch.equal(noisy, ids)


def test_add_noise_per_row_t_and_consistency():
    s = MaskingSchedule("linear")
    ids = torch.arange(1, 41).reshape(2, 20)
    g = torch.Generator().manual_seed(1)
    noisy, masked = s.add_noise(ids, torch.tensor([1.0, 0.0]), mask_id=-1, generator=g)
    assert masked[0].all() and not masked[1].any()
    assert masked.dtype == torch.bool
    assert torch.equal(noisy == -1, masked)
    assert torch.equal(noisy[~masked], ids[~masked])


def test_add_noise_respects_maskable():
    s = MaskingSchedule("linear")
    ids = torch.arange(1, 201).reshape(4, 50)
    maskable = torch.zeros(4, 50, dtype=torch.bool)
    maskable[:, 20:] = True  # a prompt of 20 tokens must stay intact
    noisy, masked = s.add_noise(ids, torch.ones(4), 0, torch.Generator().manual_seed(2), maskable)
    assert torch.equal(noisy[:, :20], ids[:, :20])
    assert not masked[:, :20].any()
    assert masked[:, 20:].all()


def test_add_noise_is_reproducible_from_generator():
    s = MaskingSchedule("cosine")
    ids = torch.randint(5, 100, (8, 64), generator=torch.Generator().manual_seed(3))
    t = torch.full((8,), 0.5)
    a = s.add_noise(ids, t, 1, torch.Generator().manual_seed(42))
    b = s.add_noise(ids, t, 1, torch.Generator().manual_seed(42))
    c = s.add_noise(ids, t, 1, torch.Generator().manual_seed(43))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


@pytest.mark.parametrize(
    "schedule, expected", [("linear", 0.3), ("cosine", 1 - math.cos(0.15 * math.pi))]
)
def test_add_noise_empirical_fraction(schedule, expected):
    s = MaskingSchedule(schedule)
    ids = torch.full((200, 500), 7)
    _, masked = s.add_noise(ids, torch.full((200,), 0.3), 0, torch.Generator().manual_seed(4))
    assert masked.float().mean().item() == pytest.approx(expected, abs=0.01)


# ---------------------------------------------------------------- sample_t


@pytest.mark.parametrize("antithetic", [False, True])
def test_sample_t_range(antithetic):
    s = MaskingSchedule(eps=0.05)
    t = s.sample_t(1000, torch.Generator().manual_seed(5), antithetic=antithetic)
    assert t.shape == (1000,)
    assert t.min() >= 0.05 and t.max() <= 1.0
    assert t.std() > 0.2  # spread over the range, not collapsed


def test_sample_t_reproducible():
    s = MaskingSchedule()
    a = s.sample_t(16, torch.Generator().manual_seed(6))
    b = s.sample_t(16, torch.Generator().manual_seed(6))
    assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(5))
def test_sample_t_antithetic_is_evenly_spaced(seed):
    eps = 1e-3
    s = MaskingSchedule(eps=eps)
    t = s.sample_t(4, torch.Generator().manual_seed(seed), antithetic=True)
    u = torch.sort((t.double() - eps) / (1 - eps)).values
    assert torch.allclose(u.diff(), torch.full((3,), 0.25, dtype=torch.float64), atol=1e-6)
    assert u[0] < 0.25 + 1e-6  # the strata wrap around: one value in each quarter


# ---------------------------------------------------------------- set_timesteps


def test_set_timesteps():
    s = MaskingSchedule()
    s.set_timesteps(8)
    assert s.num_inference_steps == 8
    assert s.timesteps.shape == (9,) and s.timesteps.is_floating_point()
    assert s.timesteps[0].item() == 1.0 and s.timesteps[-1].item() == 0.0
    assert torch.all(s.timesteps.diff() < 0)
    assert torch.allclose(s.timesteps.diff(), torch.full((8,), -0.125))


@pytest.mark.parametrize("bad", [0, -3])
def test_set_timesteps_rejects_nonpositive(bad):
    with pytest.raises(ValueError, match=str(bad)):
        MaskingSchedule().set_timesteps(bad)


# ---------------------------------------------------------------- num_transfer_tokens


def test_num_transfer_tokens_linear_hand_case():
    out = MaskingSchedule("linear").num_transfer_tokens(torch.tensor([10, 7]), 4)
    assert out.dtype == torch.long
    assert out.tolist() == [[3, 3, 2, 2], [2, 2, 2, 1]]


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 16, 64])
def test_num_transfer_tokens_linear_matches_llada(steps):
    n = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(steps))
    out = MaskingSchedule("linear").num_transfer_tokens(n, steps)
    assert torch.equal(out, llada_num_transfer_tokens(n, steps))


@pytest.mark.parametrize("schedule", ["cosine", "polynomial"])
def test_num_transfer_tokens_sums_and_nonnegative(schedule):
    s = make(schedule)
    n = torch.arange(0, 130)
    for steps in [1, 2, 3, 5, 8, 13, 32, 128, 200]:
        out = s.num_transfer_tokens(n, steps)
        assert out.shape == (len(n), steps)
        assert torch.equal(out.sum(dim=1), n), steps
        assert (out >= 0).all(), steps


def test_num_transfer_tokens_cosine_follows_schedule():
    # alpha = cos(pi/2 t) is steepest at t=1 and flat at t=0: cosine unmasks most tokens early.
    # Cumulative clean fractions at t = 1, .75, .5, .25, 0: 0, .383, .707, .924, 1.
    out = MaskingSchedule("cosine").num_transfer_tokens(torch.tensor([100]), 4)
    expected_cum = [round(100 * math.cos(math.pi / 2 * (1 - i / 4))) for i in range(5)]
    expected_cum[0] = 0
    assert out[0].tolist() == [b - a for a, b in zip(expected_cum, expected_cum[1:])]
    assert out[0].tolist() == [38, 33, 21, 8]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_num_transfer_tokens_zero(schedule):
    out = make(schedule).num_transfer_tokens(torch.zeros(3, dtype=torch.long), 5)
    assert torch.equal(out, torch.zeros(3, 5, dtype=torch.long))


# ---------------------------------------------------------------- config


def test_save_pretrained_round_trip(tmp_path):
    s = MaskingSchedule(schedule="polynomial", eps=0.01, exponent=2.5)
    s.save_pretrained(tmp_path)
    assert (tmp_path / "scheduler_config.json").exists()
    loaded = MaskingSchedule.from_pretrained(tmp_path)
    assert isinstance(loaded, MaskingSchedule)
    keys = ["schedule", "eps", "exponent"]
    assert {k: loaded.config[k] for k in keys} == {"schedule": "polynomial", "eps": 0.01, "exponent": 2.5}
    assert dict(loaded.config) == dict(s.config)
    t = torch.linspace(0, 1, 11)
    assert torch.equal(loaded.alpha(t), s.alpha(t))
    n = torch.arange(20)
    assert torch.equal(loaded.num_transfer_tokens(n, 6), s.num_transfer_tokens(n, 6))
    ids = torch.arange(100).reshape(2, 50)
    a = s.add_noise(ids, torch.tensor([0.3, 0.7]), 0, torch.Generator().manual_seed(9))
    b = loaded.add_noise(ids, torch.tensor([0.3, 0.7]), 0, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0])


def test_defaults():
    s = MaskingSchedule()
    assert (s.config.schedule, s.config.eps, s.config.exponent) == ("linear", 1e-3, 1.0)


def test_unknown_schedule_names_it():
    with pytest.raises(ValueError, match="sigmoidal") as info:
        MaskingSchedule(schedule="sigmoidal")
    assert "linear" in str(info.value) and "cosine" in str(info.value)


def test_no_step_method():
    # The reverse step lives in the sampler; a half-working diffusers `step` would invite misuse.
    assert not hasattr(MaskingSchedule(), "step")
