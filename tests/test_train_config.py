"""TrainConfig: its defaults are configs/train.yaml's, and bad values are named ConfigErrors before anything loads."""

import dataclasses

import pytest

from dllm_rl import cli
from dllm_rl.errors import ConfigError
from dllm_rl.external.mixer import MixingConfig
from dllm_rl.train_config import GROUP_DEFAULTS, TrainConfig
from dllm_rl.workers.config import WorkersConfig


def composed_train_yaml() -> dict:
    cfg = cli.to_plain(cli.compose_config("train", []))
    cfg.pop("task")  # the task is built apart (train's first argument)
    return cfg


def test_the_defaults_are_the_yaml_defaults():
    assert dataclasses.asdict(TrainConfig()) == composed_train_yaml()


def test_each_group_default_is_the_option_train_yaml_picks():
    yaml = composed_train_yaml()
    assert {name: yaml[name] for name in GROUP_DEFAULTS} == GROUP_DEFAULTS
    assert MixingConfig(**yaml["mixing"]) == MixingConfig()


@pytest.mark.parametrize("options, message", [
    ({"steps": "abc"}, "steps='abc': expected int"),
    ({"lr": "fast"}, "lr='fast': expected float"),
    ({"tensorboard": "yes"}, "tensorboard='yes': expected bool"),
    ({"stepz": 3}, "unknown config key 'stepz' (did you mean 'steps'?)"),
    ({"steps": 0}, "steps must be >= 1, got 0"),
    ({"warmup": -1}, "warmup must be >= 0, got -1"),
    ({"lr": float("inf")}, "lr must be > 0 and finite, got inf"),
    ({"keep_checkpoints": -2}, "keep_checkpoints must be >= 0 (0 = all), got -2"),
    ({"eval_every": -1}, "eval_every must be >= 0 (0 = never), got -1"),
    ({"group_size": 1}, "group_size must be >= 2"),
    ({"bf16": "maybe"}, "bf16 must be true, false or auto, got 'maybe'"),
    ({"lr_schedule": "linear"}, "lr_schedule must be 'constant' or 'cosine', got 'linear'"),
    ({"external": None}, "external=None: expected a mapping of the group's keys"),
])
def test_bad_values_are_config_errors_that_name_the_key(options, message):
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_options(options)
    assert message in str(error.value)


def test_the_cli_reports_a_bad_top_level_value_by_name(capsys):
    assert cli.main(["train", "steps=abc"]) == 2
    assert "steps='abc': expected int" in capsys.readouterr().err


def test_a_group_dict_overrides_the_keys_it_names_and_another_option_replaces_the_group():
    cfg = TrainConfig.from_options({"rollout": {"gen_length": 128}, "likelihood": {"name": "elbo", "num_masks": 2},
                                    "mixing": {"per_prompt": 1}})
    assert cfg.rollout == {**GROUP_DEFAULTS["rollout"], "gen_length": 128}  # like rollout.gen_length=128
    assert cfg.sampler["temperature"] == 1.0 and "name" not in cfg.sampler
    assert cfg.likelihood == {"name": "elbo", "num_masks": 2}  # like likelihood=elbo likelihood.num_masks=2
    assert cfg.mixing["per_prompt"] == 1 and cfg.mixing["likelihood"] == GROUP_DEFAULTS["mixing"]["likelihood"]


@pytest.mark.parametrize("experiment", ["llada8b_d1", "dream7b_d1", "llada8b_erils"])
def test_the_8b_recipes_compose_into_valid_configs(experiment):
    """Each recipe composes, passes every check of TrainConfig, and says d1's settings."""
    cfg = cli.to_plain(cli.compose_config("train", [f"+experiment={experiment}", "model=/models/x", "task=gsm8k"]))
    cfg.pop("task")
    config = TrainConfig.from_options(cfg)
    assert not config.trust_remote_code and config.model == "/models/x"  # consent is the command line's to give
    assert (config.rollout["gen_length"], config.rollout["block_length"], config.rollout["steps"]) == (256, 32, 128)
    assert (config.group_size, config.inner_iterations, config.lora["r"], config.deepspeed["stage"]) == (6, 12, 128, 2)
    assert (config.algo["eps_low"], config.algo["beta"]) == (0.5, 0.04) and config.gradient_checkpointing
    assert config.external["name"] == ("causal_lm" if experiment == "llada8b_erils" else "none")


def test_the_asynchronous_8b_recipe_shards_the_learner_and_bounds_the_staleness():
    """llada8b_erils_async: ERILS's recipe with the learner at ZeRO-3 in bf16 and GPU rollout workers at S = 2 on
    a cluster, the truncated correction on by `auto`; it passes every check of TrainConfig once the cluster is given."""
    overrides = ["+experiment=llada8b_erils_async", "model=/models/x", "task=gsm8k", "workers.address=10.0.0.1:6379"]
    cfg = cli.to_plain(cli.compose_config("train", overrides))
    cfg.pop("task")
    config = TrainConfig.from_options(cfg)
    assert (config.deepspeed["stage"], config.deepspeed["bf16"], config.external["name"]) == (3, True, "causal_lm")
    workers = WorkersConfig(**config.workers)
    assert (workers.max_staleness, workers.transport, workers.size, workers.pipe) == (2, "object_store", 8, False)
    assert all(p.gpus == 1 and p.device == "cuda" for p in workers.pool_list())
    assert config.correction().mode == "weight"  # auto: rows from older policies need the truncated weight
    assert (config.group_size, config.inner_iterations, config.lora["r"]) == (6, 12, 128)  # d1's, as llada8b_erils


def test_the_espo_recipe_has_espos_settings():
    cfg = cli.to_plain(cli.compose_config("train", ["+experiment=llada8b_espo", "model=/models/x", "task=gsm8k"]))
    cfg.pop("task")
    config = TrainConfig.from_options(cfg)
    assert config.likelihood == {"name": "espo", "num_masks": 2}
    assert (config.rollout["gen_length"], config.rollout["block_length"], config.rollout["steps"]) == (256, 32, 256)
    assert (config.group_size, config.inner_iterations, config.minibatch_size, config.lora["r"]) == (6, 8, 96, 128)
    assert (config.algo["advantage"], config.algo["kl"], config.algo["eps_low"]) == ("loo", "k2", 0.2)
    assert config.algo["beta"] == pytest.approx(1e-3 * config.rollout["gen_length"])  # ESPO's beta, rescaled
    assert config.rollout["temperature"] == 1.0 and config.lr == 3e-6


def test_held_out_pass_at_1_decodes_exactly_and_greedily_whatever_the_rollouts_use():
    from dllm_rl.rollout.sampler import check_sampler_settings
    from dllm_rl.run_setup import held_out_settings

    fast = TrainConfig(rollout={"threshold": 0.9, "cache": "dual", "random_first": True, "temperature": 0.0,
                                "temperature_floor": 0.8}).sampler
    settings = held_out_settings(fast)
    assert settings == {**fast, "threshold": None, "cache": "none", "random_first": False, "temperature": 0.0,
                        "temperature_floor": 0.0}
    check_sampler_settings(**settings)


def test_the_spg_recipe_has_spgs_settings():
    cfg = cli.to_plain(cli.compose_config("train", ["+experiment=llada8b_spg", "model=/models/x", "task=gsm8k"]))
    cfg.pop("task")
    config = TrainConfig.from_options(cfg)
    assert config.likelihood == {"name": "spg", "num_masks": 2, "block_length": 32, "beta": 1.5, "omega": 0.5,
                                 "prompt_mask_prob": 0.15}
    assert (config.algo["objective"], config.algo["beta"], config.algo["advantage"]) == ("pg", 0.0, "mean")
    assert (config.group_size, config.inner_iterations, config.minibatch_size, config.lora["r"]) == (6, 4, 96, 128)
    assert (config.rollout["gen_length"], config.rollout["steps"], config.rollout["temperature"]) == (256, 128, 0.9)
    assert config.lr == 3e-6 and config.weight_decay == 0.1 and config.grad_clip == 0.2



def test_the_sampler_correction_turns_itself_on_where_asynchronous_rollouts_need_it():
    plain = TrainConfig.from_options({})
    assert plain.sampler_correction["mode"] == "auto" and plain.correction().mode == "none" and plain.decided() == []
    asynchronous = TrainConfig.from_options({"workers": {"count": 1, "max_staleness": 1}})
    assert asynchronous.correction().mode == "weight" and asynchronous.sampler_correction["mode"] == "auto"
    assert asynchronous.decided() == ["sampler_correction.mode=weight (auto: workers.max_staleness=1 trains on "
                                      "rollouts of older policies, which need the truncated importance weight)"]
    with pytest.raises(ConfigError, match="workers.max_staleness=1: rows generated by older policies need"):
        TrainConfig.from_options({"workers": {"count": 1, "max_staleness": 1}, "sampler_correction": {"mode": "none"}})
    assert TrainConfig.from_options({"sampler_correction": {"mode": "reject"}}).correction().mode == "reject"


def test_staleness_without_workers_is_refused_by_name():
    with pytest.raises(ConfigError, match="workers.max_staleness=2 needs rollout workers"):
        TrainConfig.from_options({"workers": {"max_staleness": 2}})


def test_the_run_header_says_what_auto_became():
    from dllm_rl.tracking import run_header

    config = TrainConfig.from_options({"workers": {"count": 1, "max_staleness": 1}})
    header = run_header("runs/x", 1, "cpu", "auto", False, {"steps": 1}, "a new run", config.decided())
    assert "  sampler_correction.mode=weight (auto: workers.max_staleness=1" in header
