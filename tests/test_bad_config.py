"""Every command, fed bad values: each ends with a named error (exit status 2, the key or value named, what is
expected) before anything is trained, and never with a traceback."""

import json
from pathlib import Path

import pytest
import yaml

from dllm_rl import cli

# (command, overrides, a piece of the expected message)
TRAIN = [
    ("steps=abc", "steps='abc': expected int"), ("steps=0", "steps must be >= 1"), ("steps=-3", "steps must be >= 1"),
    ("prompts_per_step=0", "prompts_per_step must be >= 1"), ("group_size=1", "group_size must be >= 2"),
    ("inner_iterations=0", "inner_iterations must be >= 1"), ("minibatch_size=0", "minibatch_size must be >= 1"),
    ("micro_batch_rows=-1", "micro_batch_rows must be >= 0"),
    ("micro_batch_forwards=-2", "micro_batch_forwards must be >= 0"),
    ("micro_batch_forwards=4", "micro_batch_forwards=4 cuts the forwards of likelihood=ordered or left_to_right"),
    ("lr=-1", "lr must be > 0 and finite"), ("lr=inf", "lr must be > 0 and finite"), ("lr=nan", "lr must be > 0"),
    ("lr=abc", "lr='abc': expected float"), ("lr_schedule=linear", "lr_schedule must be 'constant' or 'cosine'"),
    ("warmup=-1", "warmup must be >= 0"), ("weight_decay=-0.1", "weight_decay must be >= 0"),
    ("weight_decay=nan", "weight_decay must be >= 0"), ("grad_clip=0", "grad_clip must be > 0"),
    ("bf16=maybe", "bf16"), ("seed=abc", "seed='abc': expected int"), ("train_pool=0", "train_pool must be >= 1"),
    ("eval_every=-1", "eval_every must be >= 0"), ("eval_prompts=0", "eval_prompts must be >= 1"),
    ("eval_samples=-1", "eval_samples must be >= 0"), ("checkpoint_every=-1", "checkpoint_every must be >= 0"),
    ("eval_external_samples=-1", "eval_external_samples must be >= 0 (0 = no provenance split)"),
    ("keep_checkpoints=-1", "keep_checkpoints must be >= 0"), ("sample_every=-2", "sample_every must be >= 0"),
    ("ref_sync_every=-1", "ref_sync_every must be >= 0"), ("max_bad_steps=0", "max_bad_steps must be >= 1"),
    ("tensorboard=3", "tensorboard=3: expected bool"), ("trust_remote_code=maybe", "trust_remote_code='maybe'"),
    ("model=/nonexistent/model", "'/nonexistent/model': expected a local model directory"),
    ("+stepz=3", "unknown config key 'stepz'"),
    ("workers.pools={fast:{sampler:{threshold:1.9}}}", "workers.pools.fast.sampler.threshold=1.9: expected a probab"),
    ("workers.pools={fast:{sampler:{temperature:0.5}}}", "workers.pools.fast.sampler: ['temperature'] cannot differ"),
    ("workers.count=2 workers.pools={fast:{count:2}}", "workers.count=2 with workers.pools: the pools say how many"),
    ("workers.pools={fast:{device:cuda}}", "workers.pools.fast.device=cuda with workers.pools.fast.gpus=0.0"),
    ("workers.pools={fast:{colour:red}}", "unknown config key 'workers.pools.fast.colour'"),
    ("workers.pools={fast:{count:0}}", "workers.pools.fast.count=0: expected a number >= 1"),
    ("workers.pools={a:{throughput:2},b:{count:1}}", "throughput given for ['a'] but not for ['b']"),
    ("workers.pools={fast:{device:tpu}}", "workers.pools.fast.device='tpu': expected one of"),
    ("workers.pools={fast:3}", "workers.pools.fast=3: expected a mapping of pool settings"),
    ("workers.pools={fast:{price:-1}}", "workers.pools.fast.price=-1: expected a finite number >= 0"),
    ("likelihood=ordered likelihood.group=1 workers.pools={fast:{sampler:{cache:prefix}}}",
     "workers.pools.fast.sampler={'cache': 'prefix'}: its rollouts' recorded log-probs are not the policy's"),
    ("rollout.gen_length=0", "rollout.gen_length=0: expected a number >= 1"),
    ("rollout.gen_length=abc", "rollout.gen_length='abc': expected int"),
    ("rollout.block_length=7", "gen_length=64 must be a multiple of block_length=7"),
    ("rollout.steps=3", "steps=3 must be divisible by the number of blocks"),
    ("rollout.temperature=-1", "rollout.temperature=-1: expected a finite number >= 0"),
    ("rollout.temperature=inf", "rollout.temperature=inf"), ("rollout.remasking=entropy", "rollout.remasking must be"),
    ("rollout.cfg_scale=-1", "rollout.cfg_scale=-1"),
    ("rollout.threshold=1.5", "rollout.threshold=1.5: expected a probability in (0, 1]"),
    ("rollout.threshold=0", "rollout.threshold=0: expected a probability in (0, 1]"),
    ("rollout.factor=-1", "rollout.factor=-1: expected a finite number > 0"),
    ("rollout.threshold=0.9 rollout.factor=1", "set one of them"),
    ("rollout.threshold=0.9 rollout.remasking=random", "need rollout.remasking=low_confidence"),
    ("rollout.random_first=maybe", "rollout.random_first='maybe': expected bool"),
    ("rollout.temperature_floor=-0.5", "rollout.temperature_floor=-0.5: expected a finite number >= 0"),
    ("rollout.cache_refresh=2", "rollout.cache_refresh=2 refreshes a block cache, and rollout.cache=none has none"),
    ("external=causal_lm external.draft_capacity=0", "external.draft_capacity=0: expected a number >= 1"),
    ("external=none rollout=default", "every rollout of a prompt is the same and GRPO's advantages are all zero"),
    ("+rollout.top_p=0.9", "unknown config key 'rollout.top_p'"),
    ("likelihood.name=elbow", "likelihood.name must be one of"),
    ("likelihood.prompt_mask_prob=2", "likelihood.prompt_mask_prob=2: expected a probability in [0, 1]"),
    ("likelihood.prompt_mask_prob=-0.1", "likelihood.prompt_mask_prob=-0.1"),
    ("likelihood=elbo likelihood.num_masks=0", "likelihood.num_masks=0: expected a number >= 1"),
    ("likelihood=elbo likelihood.eps=0", "likelihood.eps=0: expected a number strictly between 0 and 1"),
    ("likelihood=elbo likelihood.eps=1.5", "likelihood.eps=1.5"),
    ("likelihood=elbo likelihood.num_masks=two", "likelihood.num_masks='two': expected int"),
    ("likelihood=ordered likelihood.group=0", "likelihood.group=0"),
    ("+likelihood.num_maks=3", "unknown config key 'likelihood.num_maks'"),
    ("algo.eps_low=0", "algo.eps_low must be > 0"),
    ("algo.eps_low=1.5", "algo.eps_low=1.5: expected a number strictly"),
    ("algo.eps_high=-1", "algo.eps_high must be > 0"), ("algo.beta=-0.1", "algo.beta must be >= 0"),
    ("algo.beta=nan", "algo.beta must be >= 0, got nan"), ("algo.kl=k4", "unknown algo.kl 'k4'"),
    ("algo.aggregation=tokens", "unknown algo.aggregation 'tokens'"),
    ("algo.aggregation=constant", "algo.aggregation=constant divides by algo.constant"),
    ("algo.constant=-5", "algo.constant=-5: expected a finite number > 0"),
    ("algo.advantage=median", "unknown algo.advantage 'median'"), ("+algo.tau=1", "unknown config key 'algo.tau'"),
    ("deepspeed.stage=5", "deepspeed.stage must be one of"), ("deepspeed.timeout_s=0", "deepspeed.timeout_s=0"),
    ("deepspeed.offload_optimizer=gpu", "offload_optimizer"), ("+deepspeed.zero=1", "deepspeed.zero"),
    ("external=causal_lm external.temperature=-1", "external.temperature=-1"),
    ("external=causal_lm external.batch_size=0", "external.batch_size=0"),
    ("external=causal_lm external.max_new_tokens=0", "external.max_new_tokens=0"),
    ("external=causal_lm external.draft_tokens=-1", "external.draft_tokens=-1: expected a finite number >= 0"),
    ("external=causal_lm external.draft_history=0", "external.draft_history=0"),
    ("external=causal_lm external.draft_tokens=many", "external.draft_tokens='many': expected int"),
    ("external=causal_lm external.path=/nonexistent/ar", "'/nonexistent/ar': expected a local model directory"),
    ("external=jsonl external.path=/nonexistent.jsonl", "expected a JSONL file of external rollouts"),
    ("external=solver external.trace_steps=-2", "external.trace_steps must be -1"),
    ("external=solver external.trace_steps=all", "external.trace_steps='all': expected int"),
    ("mixing.per_prompt=0", "mixing.per_prompt must be >= 1"), ("mixing.candidates=0", "mixing.candidates"),
    ("mixing.trigger=sometimes", "unknown mixing.trigger 'sometimes'"), ("mixing.keep=best", "unknown mixing.keep"),
    ("mixing.length_rule=cut", "unknown mixing.length_rule"), ("mixing.processing=mixed", "mixing.processing"),
    ("mixing.statistic=median", "mixing.statistic"), ("mixing.constant=nan", "mixing.constant=nan"),
    ("mixing.weight=-1", "mixing.weight=-1"), ("mixing.correction=magic", "mixing.correction"),
    ("mixing.shaping_gamma=0", "mixing.shaping_gamma=0"), ("mixing.is_cap=0", "mixing.is_cap=0"),
    ("mixing.baseline_decay=1", "mixing.baseline_decay must be in [0, 1)"),
    ("mixing.minibatch_mix=random", "mixing.minibatch_mix"), ("mixing.decay_steps=0", "mixing.decay_steps"),
    ("mixing.likelihood.name=ordered", "needs a denoising trajectory"),
    ("mixing.per_prompt=two", "mixing.per_prompt='two': expected int"),
    ("task.blanks=[0,3]", "blanks must be"), ("task.blanks=99", "blanks must be"),
    ("task.test_fraction=1.5", "test_fraction must be in (0, 1)"), ("task.prompt_style=long", "prompt_style"),
    ("task=countdown task.min_number=0", "min_number"), ("task=countdown task.solver_style=weird", "solver_style"),
    ("task=countdown task.num_numbers=[7]", "num_numbers"), ("task=arithmetic task.digits=13", "digits"),
    ("task=arithmetic task.ops=/", "ops"), ("task=gsm8k", "set task.train_file and/or task.test_file"),
]
EVAL = [
    ("num_prompts=0", "num_prompts=0: expected a number >= 1"), ("num_samples=0", "num_samples=0"),
    ("batch_size=0", "batch_size=0"), ("batch_size=abc", "batch_size='abc': expected int"),
    ("split=val", "split must be one of"), ("kind=gpt", "unknown kind 'gpt'"), ("dtype=float16", "unknown dtype"),
    ("rollout.gen_length=0", "rollout.gen_length=0"),
    ("rollout.block_length=5", "must be a multiple of block_length=5"),
    ("rollout.temperature=-1", "rollout.temperature=-1"), ("chat=maybe", "chat='maybe': expected bool"),
    ("seed=abc", "seed='abc'"), ("model=/nonexistent/m", "expected a local model directory"),
    ("+rollout.top_k=5", "unknown config key 'rollout.top_k'"),
]
GENERATE = [
    ("num_samples=0", "num_samples=0"), ("kind=gpt", "unknown kind"), ("dtype=float64", "unknown dtype"),
    ("rollout.steps=0", "rollout.steps=0"), ("prompt=5", "prompt=5: expected str"), ("seed=1.5", "seed=1.5"),
    ("model=/nonexistent/m", "expected a local model directory"),
    # denoising options given to a causal LM would change nothing: named, not ignored
    ("model=models/tiny-ar rollout.cache=dual", "rollout.cache='dual' applies to a masked-diffusion model's denoising"),
    ("model=models/tiny-ar rollout.threshold=0.9", "rollout.threshold=0.9 applies to a masked-diffusion model"),
    ("model=models/tiny-ar rollout.random_first=true", "rollout.random_first=True applies to a masked-diffusion"),
]
SFT = [
    ("steps=0", "steps=0: expected a number >= 1"), ("batch_size=0", "batch_size=0"), ("examples=0", "examples=0"),
    ("lr=0", "lr=0: expected a finite number > 0"), ("lr=inf", "lr=inf"), ("warmup=-1", "warmup=-1"),
    ("weighting=mean", "weighting must be 'elbo' or 'masked_mean'"), ("gen_length=0", "gen_length=0"),
    ("bf16=maybe", "bf16"), ("kind=xyz", "unknown kind"), ("model=/nonexistent/m", "expected a local model directory"),
]
TASKS = [("n=0", "n must be a positive integer"), ("check=-1", "check must be a non-negative integer"),
         ("split=val", "split must be one of"), ("task.blanks=0", "blanks"), ("task=sudoku task.blanks=13", "blanks"),
         ("tokenizer=/nonexistent/t", "expected a local tokenizer directory")]
EXPORT = [("checkpoint=/nonexistent/c", "expected a training checkpoint directory"),
          ("checkpoint=/nonexistent/c device=tpu", "device='tpu': expected auto, cpu, cuda or cuda:N"),
          ("checkpoint=/nonexistent/c output_dir=/tmp/x", "expected a training checkpoint directory")]
PLAN = [("max_staleness=-1", "max_staleness=-1: expected an integer >= 0 (0 = synchronous)"),
        ("kinds={cpu:{throughput:-1,price:1}}", "kinds.cpu.throughput=-1: expected a finite number > 0"),
        ("kinds={cpu:{throughput:1,price:-2}}", "kinds.cpu.price=-2: expected a finite number >= 0"),
        ("kinds={cpu:{throughput:1,speed:2,price:1}}", "kinds.cpu={'throughput': 1, 'speed': 2, 'price': 1}: expected"),
        ("target_utilisation=1.5 kinds={cpu:{throughput:1.5,price:0.1}}",
         "target_utilisation=1.5: expected a number in (0, 1]"),
        ("group_size=5 kinds={cpu:{throughput:1.5,price:0.1}}", "group_size=5: expected a divisor of batch=48"),
        ("train_s=0", "train_s=0: expected seconds > 0"), ("publish_s=-1", "publish_s=-1: expected seconds >= 0"),
        ("kinds={}", "kinds: expected at least one worker kind"),
        ("max_staleness=0 publish_s=1 target_utilisation=0.99 kinds={cpu:{throughput:1.5,price:0.1}}",
         "no feasible mix: with max_staleness=0")]
COMPARE = [("/nonexistent/run window=0", "window=0: expected a whole number of steps >= 1"),
           ("", "expected one or more run directories (dllm-rl compare runs/a runs/b ...)"),
           ("/nonexistent/run", "'/nonexistent/run' is not a run directory (no metrics.jsonl)"),
           ("runs=[/nonexistent/run] window=2", "is not a run directory")]

CASES = ([("train", o, m) for o, m in TRAIN] + [("eval", o, m) for o, m in EVAL]
         + [("generate", o, m) for o, m in GENERATE] + [("sft", o, m) for o, m in SFT]
         + [("tasks", o, m) for o, m in TASKS] + [("export", o, m) for o, m in EXPORT]
         + [("plan", o, m) for o, m in PLAN] + [("compare", o, m) for o, m in COMPARE])


def test_the_table_is_long_and_covers_every_command():
    assert len(CASES) >= 100 and {c for c, _, _ in CASES} == set(cli.COMMANDS)


@pytest.mark.parametrize("command, overrides, message", CASES, ids=[f"{c}:{o}" for c, o, _ in CASES])
def test_a_bad_value_is_a_named_error(command, overrides, message, saved_model, tmp_path, capsys):
    base = {"train": [f"model={saved_model}", f"run_dir={tmp_path / 'run'}", "steps=1", "eval_every=0"],
            "eval": [f"model={saved_model}", f"output_dir={tmp_path / 'eval'}"], "generate": [f"model={saved_model}"],
            "sft": [f"model={saved_model}", f"output_dir={tmp_path / 'sft'}", "steps=1"], "tasks": ["check=0"],
            "export": [f"output_dir={tmp_path / 'out'}"],
            "plan": ["train_s=5"], "compare": [f"plot={tmp_path / 'compare.png'}"]}[command]
    assert cli.main([command, *base, *overrides.split()]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_errors_name_the_key_the_user_sets(tmp_path, capsys, monkeypatch):
    """A short test file names num_prompts (or eval_prompts under train), a causal LM given to train says how it
    takes part, a run directory given as a model points at its newest checkpoint."""
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(3)))
    train_file = tmp_path / "train.jsonl"  # two problems: train_pool=5000 takes both
    train_file.write_text("".join(json.dumps({"question": f"{i}*2?", "answer": f"#### {2 * i}"}) + "\n"
                                  for i in range(2)))
    cases = [
        (["eval", "task=gsm8k", f"task.test_file={short}", f"output_dir={tmp_path / 'e'}"],
         "num_prompts=100: the test split of 'gsm8k' has only 3 problems; use num_prompts<=3, or num_prompts=null "
         "for the whole split"),
        (["train", "task=gsm8k", f"task.train_file={train_file}", f"task.test_file={short}", "eval_prompts=5",
          f"run_dir={tmp_path / 'r'}", "external=none", "steps=1"],
         "eval_prompts=5: the test split of 'gsm8k' has only 3 problems; use eval_prompts<=3"),
        (["train", "model=models/tiny-ar", f"run_dir={tmp_path / 'r2'}"],
         "model='models/tiny-ar' is not a masked-diffusion model (model_type 'qwen2'); train trains a dLLM (native, "
         "LLaDA, Dream). A causal LM takes part as the external policy: external=causal_lm "
         "external.path=models/tiny-ar"),
    ]
    for args, message in cases:
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_a_run_directory_given_as_a_model_points_at_its_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["train", f"run_dir={run}", "steps=1", "eval_every=0", "prompts_per_step=1", "group_size=2",
                     "minibatch_size=2", "external=none", "tensorboard=false"]) == 0
    capsys.readouterr()
    for command in (["eval", f"output_dir={tmp_path / 'e'}"], ["generate"], ["train", f"run_dir={tmp_path / 'r'}"],
                    ["sft", f"output_dir={tmp_path / 's'}"]):
        assert cli.main([*command, f"model={run}"]) == 2, command
        err = capsys.readouterr().err
        assert (f"model='{run}' is a training run directory, not a model; give one of its checkpoints "
                f"(model={run}/checkpoints/step_000001 is the newest)") in err, (command, err)


def test_default_model_paths_resolve_from_the_package(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "external=causal_lm", "--cfg"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    root = Path(cli.__file__).resolve().parents[1]
    assert (cfg["model"] == str(root / "models" / "tiny-dllm")
            and cfg["external"]["path"] == str(root / "models" / "tiny-ar"))
    (tmp_path / "models" / "tiny-dllm").mkdir(parents=True)  # a directory of that name here wins
    assert cli.main(["eval", "--cfg"]) == 0 and yaml.safe_load(capsys.readouterr().out)["model"] == "models/tiny-dllm"


def test_an_empty_train_split_is_named(tmp_path, capsys):
    """A train file whose every problem is also in the test file leaves nothing to train on."""
    same = tmp_path / "same.jsonl"
    same.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    files = ["task=gsm8k", f"task.train_file={same}", f"task.test_file={same}"]
    for args in (["train", *files, f"run_dir={tmp_path / 'r'}", "external=none", "eval_every=0"],
                 ["sft", *files, f"output_dir={tmp_path / 's'}"]):
        assert cli.main(args) == 2
        assert "the train split of 'gsm8k' is empty" in capsys.readouterr().err, args
