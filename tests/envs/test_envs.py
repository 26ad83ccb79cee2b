"""The multi-turn environments' rules (dllm_rl/envs/): illegal moves refused with the penalty and the state kept,
the solved state rewarded, a solver's episode succeeding from every seed tried, the turn limit a failure, the
same seed the same episode, and a user's environment by import path."""

import pytest

from dllm_rl.envs import ENVIRONMENTS, INVALID_PENALTY, Env, action_text, build_env, env_class
from dllm_rl.errors import ConfigError


def play(env, actions):
    return [env.step(a) for a in actions]


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_a_solvers_episode_succeeds_from_every_seed_and_the_same_seed_is_the_same_episode(name):
    env = build_env(name)
    for seed in range(40):
        first = env.reset(seed)
        anchor = env.anchor()
        plan = env.solve()
        assert plan, (name, seed, first)
        assert len(plan) <= env.max_turns
        steps = play(env, plan)
        assert [s.done for s in steps] == [False] * (len(plan) - 1) + [True], (name, seed)
        assert steps[-1].reward == 1.0 and steps[-1].info["success"] and not steps[-1].info["truncated"]
        assert all(s.reward == 0.0 and not s.info["invalid"] for s in steps[:-1])
        assert [s.info["turn"] for s in steps] == list(range(1, len(plan) + 1))
        again = build_env(name)
        assert again.reset(seed) == first and again.anchor() == anchor and again.solve() == plan
    assert len({build_env(name).reset(seed) for seed in range(40)}) > 5  # seeds draw different episodes


@pytest.mark.parametrize("name, illegal", [("corridor", "open"), ("frozen_lake", "up"), ("countdown", "1000 + 1"),
                                           ("sudoku", "1 1 9"), ("sliding", "banana")])
def test_an_illegal_or_unparsable_action_costs_the_penalty_and_keeps_the_state(name, illegal):
    env = build_env(name)
    observation = env.reset(3)
    anchor = env.anchor()
    step = env.step(illegal)
    assert step.reward == -INVALID_PENALTY and step.info["invalid"] and step.info["reason"] != "ok"
    assert not step.done and step.observation == observation and env.anchor() == anchor
    assert env.step(f"<action>{env.solve()[0]}</action>").info["invalid"] is False  # the tags hold the move


def test_the_turn_limit_ends_the_episode_as_a_failure():
    env = build_env("sliding")
    env.reset(0)
    steps = play(env, ["left", "right"] * 10)  # loops: the blank goes back and forth (or bumps a wall)
    assert steps[-1].done and steps[-1].info["truncated"] and not steps[-1].info["success"]
    assert len(steps) == env.max_turns == 20 and not any(s.done for s in steps[:-1])
    with pytest.raises(ConfigError, match="after the episode ended"):
        env.step("left")


def test_the_corridor_by_hand():
    env = build_env("corridor", length=5)
    env.reset(0)
    env.key, env.position, env.has_key = 1, 3, False
    assert env.anchor() == (3, False)
    assert env.step("pick").info["reason"] == "no key here"
    assert env.step("open").info["reason"] == "the door is locked and you hold no key"
    assert env.solve() == ["left", "left", "pick", "right", "right", "right", "open"]
    play(env, ["left", "left", "pick"])
    assert env.anchor() == (1, True) and "you hold the key" in env.observe()
    assert env.step("open").info["reason"] == "no door here"
    last = play(env, ["right", "right", "right", "open"])[-1]
    assert last.done and last.reward == 1.0


def test_frozen_lake_holes_end_the_episode_and_the_map_is_the_seeds():
    env = build_env("frozen_lake")
    env.reset(0)
    env.map, env.position = ["SFFF", "FHFH", "FFFH", "HFFG"], (0, 0)
    assert env.observe() == "Map (@ is you): @FFF/FHFH/FFFH/HFFG"
    assert env.solve() == ["right", "right", "down", "down", "down", "right"]  # shortest; ties to the earlier move
    step = play(env, ["down", "right"])[-1]  # (1, 1) is a hole
    assert step.done and step.reward == 0.0 and not step.info["success"] and not step.info["truncated"]


def test_countdown_combines_two_numbers_a_turn_and_checks_the_last():
    env = build_env("countdown")
    env.reset(0)
    env.numbers, env.target = [2, 3, 7], 13
    assert env.anchor() == (2, 3, 7)
    assert env.step("3 - 7").info["reason"] == "3 - 7 is not a positive whole number"
    assert env.step("3 / 2").info["invalid"] and env.step("4 + 3").info["invalid"]
    step = env.step("2 * 3 = 6")
    assert not step.done and env.anchor() == (6, 7) and step.reward == 0.0
    step = env.step("6 + 7")
    assert step.done and step.info["success"] and step.reward == 1.0
    env.reset(0)
    env.numbers, env.target = [2, 3, 7], 13
    play(env, ["2 + 3"])
    last = env.step("5 + 7")  # 12, not 13: the last number misses the target
    assert last.done and not last.info["success"] and last.reward == 0.0


def test_sudoku_refuses_clashes_and_ends_when_a_blank_has_no_digit():
    env = build_env("sudoku")
    env.reset(0)
    env.grid = [int(c) for c in "1234341221434301"]  # row 4 col 3 must be 2
    assert env.step("4 3 1").info["reason"] == "1 clashes at row 4 column 3"
    assert env.step("1 1 2").info["reason"] == "row 1 column 1 is not blank"
    last = env.step("4 3 2")
    assert last.done and last.info["success"] and env.anchor() == tuple(int(c) for c in "1234341221434321")
    env.reset(0)
    env.grid = [int(c) for c in "1200340000000000"]
    # 3 at row 1 col 3 is legal (no clash) but leaves row 1 col 4 with no digit: the episode ends, a failure
    step = env.step("1 3 3")
    assert not step.info["invalid"] and not step.done
    env.grid = [int(c) for c in "1230000000000000"]
    step = env.step("2 3 4")  # legal, but row 1 column 4 needs the 4 now in its box: no digit fits there
    assert step.done and not step.info["success"]


def test_action_text_reads_the_tags_or_the_whole_text():
    assert action_text("  <action> Left </action> then more") == "left"
    assert action_text("RIGHT\n") == "right"


class Coin(Env):
    """A user's environment: say heads."""

    name, max_turns = "coin", 2

    def _reset(self, rng):
        self.said = None

    def observe(self):
        return "Say heads."

    def parse(self, text):
        return text if text in ("heads", "tails") else None

    def apply(self, move):
        return "success" if move == "heads" else None

    def anchor(self):
        return self.said

    def solve(self):
        return ["heads"]

    def describe(self):
        return "Coin."


def test_a_users_environment_by_import_path_and_bad_names_refused():
    assert env_class(f"{__name__}:Coin") is Coin
    env = build_env(f"{__name__}:Coin")
    env.reset(1)
    assert env.step("tails").reward == 0.0 and env.step("heads").info["success"]
    with pytest.raises(ConfigError, match="env='mazes': expected one of corridor"):
        build_env("mazes")
    with pytest.raises(ConfigError, match="cannot import 'Nope'"):
        build_env(f"{__name__}:Nope")
    with pytest.raises(ConfigError, match="is not a subclass of dllm_rl.envs.Env"):
        build_env("dllm_rl.envs:build_env")
    with pytest.raises(ConfigError, match="unknown config key 'env.corridor.lenght'"):
        build_env("corridor", lenght=3)
