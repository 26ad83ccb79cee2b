"""Bounded-staleness admission (dllm_rl/workers/admission.py): the capacity arithmetic by hand, a release on every
path, start-order taking, a filtering source and a failing group, resume, and a simulated pipeline of workers of
random speeds in which every taken group's lag stays in [0, S] and reaches S when the workers are slow."""

import random

import pytest

from dllm_rl.workers.admission import Admission, AdmissionError


def test_capacity_is_s_plus_version_plus_one_batches_by_hand():
    adm = Admission(batch=4, max_staleness=1)
    assert adm.limit(0) == 8 and adm.free(0) == 8
    tickets = [adm.start(q, version=0) for q in range(8)]
    assert adm.free(0) == 0
    with pytest.raises(AdmissionError, match=r"8 running >= \(S \+ v \+ 1\) \* B = 8"):
        adm.start(8, version=0)
    for t in tickets[:4]:
        adm.finish(t, "accepted")
    taken = adm.take(step=0)
    assert [t.key for t in taken.tickets] == [0, 1, 2, 3] and taken.lags == [0, 0, 0, 0]
    assert adm.free(0) == 0  # accepted groups count after they are taken: the bound is over the run
    assert adm.free(1) == 4  # the learner's next version opens one batch of slots


def test_every_outcome_but_accepted_releases_its_slot_exactly_once():
    adm = Admission(batch=2, max_staleness=0)
    a, b = adm.start("a", 0), adm.start("b", 0)
    assert adm.free(0) == 0
    adm.finish(a, "filtered")
    assert adm.free(0) == 1
    c = adm.start("c", 0)
    adm.finish(b, "failed")
    adm.finish(c, "cancelled")
    assert adm.free(0) == 2 and adm.outcomes == {"accepted": 0, "filtered": 1, "failed": 1, "cancelled": 1}
    d = adm.start("d", 0)
    adm.finish(d, "accepted")
    assert adm.free(0) == 1  # an accepted group keeps its slot
    for outcome in ("accepted", "filtered"):
        with pytest.raises(AdmissionError, match="finished twice"):
            adm.finish(d, outcome)
    with pytest.raises(ValueError, match="outcome='lost'"):
        adm.finish(adm.start("e", 0), "lost")


def test_cancel_all_releases_every_running_slot_and_returns_them_for_regeneration():
    adm = Admission(batch=3, max_staleness=1)
    started = [adm.start(q, 0) for q in range(6)]
    adm.finish(started[0], "accepted")
    cancelled = adm.cancel_all()
    assert [t.key for t in cancelled] == [1, 2, 3, 4, 5]
    assert not adm.running and adm.free(0) == 5


def test_the_learner_takes_in_start_order_and_waits_for_an_earlier_running_group():
    adm = Admission(batch=2, max_staleness=1)
    t0, t1, t2 = (adm.start(q, 0) for q in range(3))
    adm.finish(t1, "accepted")
    adm.finish(t2, "accepted")
    assert not adm.can_take()  # two are ready, but group 0 started first and may still be accepted
    with pytest.raises(AdmissionError, match="wait for them"):
        adm.take(0)
    adm.finish(t0, "accepted")
    assert [t.key for t in adm.take(0).tickets] == [0, 1]
    assert not adm.can_take()  # one group ready of two


def test_a_source_that_always_filters_never_runs_out_of_slots():
    adm = Admission(batch=4, max_staleness=0)
    for q in range(1000):
        assert adm.free(0) == 4
        for t in [adm.start((q, k), 0) for k in range(4)]:
            adm.finish(t, "filtered")
    assert adm.outcomes["filtered"] == 4000 and not adm.running and adm.accepted == 0


def test_a_group_that_always_fails_is_a_named_error_after_max_failures():
    adm = Admission(batch=1, max_staleness=0, max_failures=3)
    for _ in range(3):
        adm.finish(adm.start("prompt 7", 0), "failed")
    with pytest.raises(AdmissionError, match=r"group 'prompt 7' failed 3 times \(max_failures=3\)"):
        adm.start("prompt 7", 0)
    assert adm.free(0) == 1  # its slots were all released: other groups still start
    adm.finish(adm.start("prompt 8", 0), "accepted")
    assert adm.can_take()


def test_resume_counts_the_taken_groups_and_regenerates_what_was_in_flight():
    adm = Admission(batch=2, max_staleness=2)
    for step in range(3):
        for t in [adm.start((step, k), step) for k in range(2)]:
            adm.finish(t, "accepted")
        adm.take(step)
    adm.start("in flight", 3)  # lost with the process: regenerated from its seed after the resume
    back = Admission.resumed(adm.state_dict(), batch=2, max_staleness=2)
    assert (back.started, back.accepted, back.taken, back.running, back.ready) == (6, 6, 6, {}, {})
    assert back.free(3) == adm.limit(3) - 6
    assert back.start("again", 3).index == 6
    with pytest.raises(AdmissionError, match="not at a step boundary"):
        Admission.resumed({**adm.state_dict(), "taken": 5}, batch=2, max_staleness=2)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="max_staleness=-1"):
        Admission(batch=2, max_staleness=-1)
    with pytest.raises(ValueError, match="batch=0"):
        Admission(batch=0, max_staleness=1)


def simulate(S: int, workers: int, batch: int, steps: int, train_ticks: int, seed: int,
             slow: float = 0.0) -> tuple[Admission, list[list[int]]]:
    """A discrete-time pipeline: each idle worker starts the next group (regenerations first) at the learner's
    current version while admission allows; a group takes 1-3 ticks (or 6-12 when `slow` hits), then is accepted,
    filtered (10%) or fails (10%, regenerated); the learner takes a step's groups when it can and trains for
    `train_ticks`, after which its version is one more. Returns the controller and each step's lags."""
    rng = random.Random(seed)
    adm = Admission(batch, S, max_failures=100)
    busy: dict[int, tuple] = {}  # worker -> (ticket, ticks left)
    retry, next_key, version, training, lags = [], 0, 0, 0, []
    while len(lags) < steps:
        for w, (ticket, left) in list(busy.items()):
            if left > 1:
                busy[w] = (ticket, left - 1)
                continue
            del busy[w]
            outcome = rng.choices(["accepted", "filtered", "failed"], [8, 1, 1])[0]
            adm.finish(ticket, outcome)
            if outcome == "failed":
                retry.append(ticket.key)
        for w in range(workers):
            if w not in busy and adm.free(version) > 0:
                key = retry.pop(0) if retry else next_key
                next_key += key == next_key
                ticks = rng.randint(6, 12) if rng.random() < slow else rng.randint(1, 3)
                busy[w] = (adm.start(key, version), ticks)
        if training:
            training -= 1
            version += training == 0
        elif adm.can_take():
            lags.append(adm.take(len(lags)).lags)
            training = train_ticks
    return adm, lags


@pytest.mark.parametrize("S", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_simulated_pipeline_keeps_every_lag_within_the_bound(S, seed):
    adm, lags = simulate(S, workers=3, batch=4, steps=30, train_ticks=2, seed=seed, slow=0.2)
    flat = [lag for step in lags for lag in step]
    assert adm.violations == 0 and all(0 <= lag <= S for lag in flat)
    assert adm.taken == 30 * 4 and adm.outcomes["failed"] > 0 and adm.outcomes["filtered"] > 0
    if S == 0:
        assert set(flat) == {0}  # synchronous: every group comes from the policy that trains on it


def test_fast_workers_and_a_slow_learner_push_the_lag_to_s_and_no_further():
    for S in (1, 2, 4):
        _, lags = simulate(S, workers=8, batch=4, steps=40, train_ticks=10, seed=S)
        assert max(max(step) for step in lags) == S


def test_take_finished_hands_out_the_steps_groups_as_they_finish_by_hand():
    adm = Admission(batch=3, max_staleness=1)
    t = [adm.start(k, 0) for k in range(5)]  # S = 1: two steps' worth may run; step 0's are tickets 0-2
    adm.finish(t[3], "accepted")  # step 1's: not handed to step 0
    adm.finish(t[1], "accepted")
    got = adm.take_finished(0, 3)
    assert [x.index for x in got.tickets] == [1] and got.lags == [0]
    adm.finish(t[0], "failed")  # leaves step 0: ticket 3 moves into its first three
    got = adm.take_finished(0, 2)
    assert [x.index for x in got.tickets] == [3]
    r = adm.start("again", 0)  # ticket 0 regenerated: a later start, step 0's last group
    adm.finish(t[2], "accepted")
    adm.finish(r, "accepted")
    assert [x.index for x in adm.take_finished(0, 1).tickets] == [2]
    assert adm.take_finished(0, 0).tickets == []
    adm.finish(t[4], "accepted")
    got = adm.take_finished(1, 3)  # step 1: tickets 4 and 5, from version 0: lag 1 <= S
    assert [x.index for x in got.tickets] == [4, 5] and got.lags == [1, 1]
    assert adm.taken == 5 and adm.violations == 0


@pytest.mark.parametrize("seed", range(5))
def test_take_finished_gives_each_step_the_groups_take_would(seed):
    """Random finishes and failures: each step's groups handed out one by one equal `take`'s."""
    rng = random.Random(seed)
    both = [Admission(batch=4, max_staleness=2), Admission(batch=4, max_staleness=2)]
    log = []
    for adm in both:
        rng.seed(seed)
        steps, running, key = [], {}, 0
        for step in range(6):
            taken, remaining = [], 4
            while remaining:
                while adm.free(step):
                    running[adm.start(key, step).index] = key
                    key += 1
                if adm is both[0] and adm.can_take():
                    taken = [t.index for t in adm.take(step).tickets]
                    break
                if adm is both[1]:
                    got = adm.take_finished(step, remaining)
                    taken += [t.index for t in got.tickets]
                    remaining -= len(got.tickets)
                    if not remaining:
                        break
                index = rng.choice(sorted(adm.running))
                running.pop(index)
                adm.finish(adm.running[index], "failed" if rng.random() < 0.1 else "accepted")
            steps.append(sorted(taken))
        log.append(steps)
    assert log[0] == log[1]
