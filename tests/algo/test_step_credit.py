"""Step credit on hand-made groups (dllm_rl/algo/step_credit.py): CRBC's closure against value iteration and hand-
computed absorbing probabilities, its credits summing to zero under the visit policy, the one-action gate, GRPO's
broadcast at w_S = 0, GiGPO where the closure has nothing to close, and a corridor group where the key decides."""

import pytest
import torch

from dllm_rl.algo.step_credit import (Turn, closure_values, crbc_step_credit, discounted_returns, empirical_mdp,
                                      gigpo_step_advantages, turn_advantages)
from dllm_rl.envs import build_env
from dllm_rl.errors import ConfigError


def episode(*steps):
    return [Turn(s, a, r) for s, a, r in steps]


# A loops to itself once; B ends in success (reward 1) or not; C ends in failure
LOOPY = [episode(("A", "x", 0.0), ("B", "y", 1.0)),
         episode(("A", "z", 0.0), ("C", "w", 0.0)),
         episode(("A", "x", 0.0), ("B", "v", 0.0)),
         episode(("A", "z", 0.0), ("A", "x", 0.0), ("B", "y", 1.0))]


def value_iteration(mdp, beta, sweeps=100_000):
    V = torch.zeros(len(mdp.anchors), dtype=torch.float64)
    for _ in range(sweeps):
        nxt = mdp.b + beta * mdp.M @ V
        if float((nxt - V).abs().max()) < 1e-15:
            return nxt
        V = nxt
    return V


def test_the_closure_is_value_iteration_and_the_absorbing_probabilities_by_hand():
    mdp = empirical_mdp(LOOPY)
    assert mdp.anchors == ["A", "B", "C"] and mdp.visits == [5, 3, 1]
    # from A: to A once, to B three times, to C once, of five turns; B and C only reach the terminal state
    assert mdp.M.tolist() == [[0.2, 0.6, 0.2], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert mdp.b.tolist() == pytest.approx([0.0, 2 / 3, 0.0])
    for beta in (0.9, 0.98, 1.0):
        assert torch.allclose(closure_values(mdp, beta), value_iteration(mdp, beta), atol=1e-9, rtol=0)
    # beta = 1 with reward 1 only for success: V is the chance of absorbing in success; V(A) = 0.2 V(A) + 0.6 * 2/3
    assert closure_values(mdp, 1.0).tolist() == pytest.approx([0.5, 2 / 3, 0.0], abs=1e-12)


def test_credits_sum_to_zero_under_the_visit_policy_and_one_action_anchors_get_none():
    for beta in (0.9, 0.98):
        credit = crbc_step_credit(LOOPY, beta)
        at = {}
        for ep, cs in zip(LOOPY, credit):
            for turn, c in zip(ep, cs):
                at.setdefault(turn.anchor, []).append(c)
        assert sum(at["A"]) == pytest.approx(0.0, abs=1e-12)  # the turns at A are mu(.|A)'s draws
        assert sum(at["B"]) == pytest.approx(0.0, abs=1e-12) and len(set(at["B"])) == 2
        assert at["C"] == [0.0]  # one observed action: the gate
        # every occurrence of (A, x) shares one credit, and x (towards B) beats z
        xs = [c for ep, cs in zip(LOOPY, credit) for t, c in zip(ep, cs) if (t.anchor, t.action) == ("A", "x")]
        zs = [c for ep, cs in zip(LOOPY, credit) for t, c in zip(ep, cs) if (t.anchor, t.action) == ("A", "z")]
        assert len(set(xs)) == 1 and len(set(zs)) == 1 and xs[0] > 0 > zs[0]


def test_the_credit_is_q_minus_v_over_its_floored_spread_by_hand():
    # one anchor, two actions once each, straight to the end: Q = the rewards 1 and 0, V = 0.5, sigma = 0.5
    group = [episode(("S", "a", 1.0)), episode(("S", "b", 0.0))]
    assert crbc_step_credit(group) == [[1.0], [-1.0]]
    assert crbc_step_credit(group, normalise=False) == [[0.5], [-0.5]]
    small = [episode(("S", "a", 0.02)), episode(("S", "b", 0.0))]  # sigma 0.01 floored at 0.1
    assert crbc_step_credit(small)[0][0] == pytest.approx(0.01 / 0.1)


def test_w_s_zero_is_grpos_broadcast_and_gigpo_is_crbc_where_nothing_closes():
    episode_adv = [0.5, -0.5, -0.5, 0.5]
    grpo = turn_advantages(LOOPY, episode_adv, "grpo")
    assert grpo == [[0.5] * 2, [-0.5] * 2, [-0.5] * 2, [0.5] * 3]
    assert turn_advantages(LOOPY, episode_adv, "crbc", w_step=0.0) == grpo
    assert turn_advantages(LOOPY, episode_adv, "gigpo", w_step=0.0) == grpo
    # a tree: the episodes share only their first anchor, with distinct actions. The closure's V at the root is the
    # mean discounted return, and every later anchor has one action: CRBC's Q - V is GiGPO's step advantage
    tree = [episode(("R", "a", 0.0), ("a1", "u", 0.0), ("a2", "u", 1.0)),
            episode(("R", "b", 0.0), ("b1", "u", -0.1), ("b2", "u", 0.0)),
            episode(("R", "c", 0.0), ("c1", "u", 1.0))]
    gigpo = gigpo_step_advantages(tree, gamma=0.95)
    crbc = crbc_step_credit(tree, beta=0.95, normalise=False)
    assert [c[0] for c in crbc] == pytest.approx([g[0] for g in gigpo], abs=1e-12)
    returns = [discounted_returns([t.reward for t in ep], 0.95)[0] for ep in tree]
    assert gigpo[0][0] == pytest.approx(returns[0] - sum(returns) / 3)
    assert all(c == 0.0 for cs in crbc for c in cs[1:]) and all(g == 0.0 for gs in gigpo for g in gs[1:])
    with pytest.raises(ConfigError, match="expected grpo, gigpo or crbc"):
        turn_advantages(tree, [0.0] * 3, "gae")


def corridor_episode(env, actions):
    out = []
    for action in actions:
        anchor = env.anchor()
        step = env.step(action)
        out.append(Turn(anchor, action, step.reward))
        if step.done:
            break
    return out, step.info["success"]


def test_in_a_corridor_the_key_step_gets_credit_and_the_wandering_step_blame_where_grpo_gives_both_the_same():
    env = build_env("corridor", length=5)
    plays = {"direct": ["left", "pick", "right", "right", "right", "open"],
             "wanders": ["right", "left", "left", "pick", "right", "right", "right", "open"],
             "never": ["left", "right", "right", "right", "left", "right"] * 2}
    group, success = [], []
    for actions in plays.values():
        env.reset(0)
        env.key, env.position, env.has_key = 1, 2, False  # the key one step left of the start, the door at 4
        ep, ok = corridor_episode(env, actions)
        group.append(ep)
        success.append(ok)
    assert success == [True, True, False] and len(group[2]) == env.max_turns  # the third is truncated
    episode_adv = [1 / 3, 1 / 3, -2 / 3]  # GRPO's mean-centred advantages of the returns 1, 1, 0
    grpo = turn_advantages(group, episode_adv, "grpo")
    crbc = turn_advantages(group, episode_adv, "crbc")
    wanders = group[1]
    wander_step = next(n for n, t in enumerate(wanders) if t.action == "right")  # its first: away from the key
    key_step = next(n for n, t in enumerate(wanders) if t.action == "pick")
    assert grpo[1][wander_step] == grpo[1][key_step] == 1 / 3
    credit = crbc_step_credit(group)
    assert credit[1][key_step] > 0 > credit[1][wander_step]
    assert crbc[1][key_step] > 1 / 3 > crbc[1][wander_step]
