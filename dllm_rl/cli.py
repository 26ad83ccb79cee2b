"""`dllm-rl <command> [key=value ...]`: the Hydra entry point, and the only module that sees a DictConfig.

Each command composes `configs/<command>.yaml` with Hydra's override grammar (`group=option`, `key=value`,
`+new.key=value`, `~key`), turns the result into plain dicts, and calls the library with flat keyword
arguments. Flags: `--cfg` prints the resolved config and exits; `--help` describes the command.

Hydra's own `@hydra.main` is not used: it changes the working directory and rejects the `--local_rank=N`
flag that the `deepspeed` launcher appends. Here that flag is stripped (and exported as LOCAL_RANK) before
the overrides are parsed. Configs are read from `$DLLM_RL_CONFIG_DIR`, else from `configs/` beside the
package (an editable install from a clone).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from dllm_rl.errors import ConfigError, RunStopped, check_kwargs, check_types, did_you_mean, pick, require


def config_dir() -> Path:
    path = Path(os.environ.get("DLLM_RL_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))
    if not (path / "tasks.yaml").is_file():
        raise ConfigError(f"no configs found in {str(path)!r}: set DLLM_RL_CONFIG_DIR to the repository's configs/")
    return path.resolve()


# --------------------------------------------------------------------------------------------- commands


def run_tasks(cfg: dict[str, Any]) -> None:
    from dllm_rl.data import build_task
    from dllm_rl.data.preview import preview_tasks
    from dllm_rl.data.tokenizers import load_tokenizer

    env = cfg.pop("env", {"name": "none"})
    if env.get("name", "none") != "none":  # a multi-turn environment instead of the task
        from dllm_rl.envs.task import EnvConfig, preview_env

        check_kwargs(EnvConfig, env, "env")
        options = {k: cfg[k] for k in ("n", "split", "seed", "check") if k in cfg}
        preview_env(EnvConfig(**env), **options)
        return
    task = build_task(**cfg.pop("task"))
    tokenizer = load_tokenizer(cfg.pop("tokenizer", None))
    check_kwargs(preview_tasks, cfg, "")
    check_types(preview_tasks, cfg, "")
    preview_tasks(task, tokenizer=tokenizer, **cfg)


def run_generate(cfg: dict[str, Any]) -> None:
    from dllm_rl.rollout.generate import run_generate as generate

    cfg["rollout"].pop("name", None)
    check_kwargs(generate, cfg, "")
    check_types(generate, cfg, "")
    generate(**cfg)


def run_eval(cfg: dict[str, Any]) -> None:
    from dllm_rl.data import TASKS, build_task
    from dllm_rl.evaluate import run_eval as evaluate

    if cfg.get("env", {}).get("name", "none") != "none":  # episodes of a multi-turn environment
        from dllm_rl.envs.collect import run_env_eval

        task = env_or_task(cfg)
        cfg["rollout"].pop("name", None)
        check_kwargs(run_env_eval, cfg, "")
        run_env_eval(task, **cfg)
        return
    cfg.pop("env", None)
    task_cfg, protocol = cfg.pop("task"), cfg["protocol"]
    known = inspect.signature(pick(TASKS, task_cfg.get("name"), "task")).parameters
    for key, value in protocol.get("task", {}).items():  # the protocol's prompts and parsers
        require(key in known, f"protocol={protocol.get('name')} sets task.{key}={value!r}, and task="
                f"{task_cfg.get('name')} has no such setting: the protocol does not apply to this task")
    task = build_task(**{**task_cfg, **protocol.get("task", {})})
    cfg["rollout"].pop("name", None)
    check_kwargs(evaluate, cfg, "")
    check_types(evaluate, cfg, "")
    evaluate(task, **cfg)


def run_sft(cfg: dict[str, Any]) -> None:
    from dllm_rl.sft import run_sft as sft

    task = env_or_task(cfg)
    check_kwargs(sft, cfg, "")
    check_types(sft, cfg, "")
    sft(task, **cfg)


def env_or_task(cfg: dict[str, Any]):
    """The task the config names, or, where it names an environment (`env=`), the environment as the task."""
    from dllm_rl.data import build_task

    env, task = cfg.pop("env", {"name": "none"}), cfg.pop("task")
    if env.get("name", "none") == "none":
        return build_task(**task)
    from dllm_rl.envs.task import EnvConfig, EnvTask

    check_kwargs(EnvConfig, env, "env")
    return EnvTask(EnvConfig(**env))


def run_train(cfg: dict[str, Any]) -> None:
    from dllm_rl.data import build_task
    from dllm_rl.train import train

    from dllm_rl.engine import shutdown

    allow_changes = cfg.pop("allow_changes", False)
    config = copy.deepcopy(cfg)
    task = build_task(**cfg.pop("task"))
    try:  # the options are checked by TrainConfig, a resume's changes by dllm_rl.resume
        train(task, saved_config=config, allow_changes=allow_changes, **cfg)
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown()


def run_export(cfg: dict[str, Any]) -> None:
    from dllm_rl.engine.export import export_checkpoint

    check_kwargs(export_checkpoint, cfg, "")
    check_types(export_checkpoint, cfg, "")
    export_checkpoint(**cfg)


def run_plan(cfg: dict[str, Any]) -> None:
    from dllm_rl.workers.plan import run

    run(cfg)


def run_compare(cfg: dict[str, Any]) -> None:
    from dllm_rl.compare import compare

    check_kwargs(compare, cfg, "")
    check_types(compare, cfg, "")
    compare(**cfg)


# name -> (what it does, config file, runner taking the resolved config as plain dicts)
COMMANDS: dict[str, tuple[str, str, Callable[[dict[str, Any]], None]]] = {
    "tasks": ("print examples of a task and check its rewards and solver", "tasks", run_tasks),
    "generate": ("sample completions for a prompt from a local model", "generate", run_generate),
    "eval": ("pass@k, best-of-k, format rate and length of a model on a task", "eval", run_eval),
    "sft": ("fine-tune a dLLM or causal LM on a task's solver data", "sft", run_sft),
    "train": ("GRPO on a masked-diffusion policy (resume=<run dir> continues a run)", "train", run_train),
    "export": ("consolidate a (ZeRO-sharded) training checkpoint into a Hugging Face model directory", "export",
               run_export),
    "compare": ("runs of one task side by side: held-out pass@1 with standard errors, paired by seed, and a plot",
                "compare", run_compare),
    "plan": ("the cheapest mix of rollout workers that keeps the learner at a target utilisation (--measure: "
             "this machine's numbers)", "plan", run_plan),
}


# --------------------------------------------------------------------------------------------- plumbing


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Remove `--local_rank=N` / `--local_rank N` (added by the deepspeed launcher) and export LOCAL_RANK."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        match = re.fullmatch(r"--local[_-]rank(?:=(\d+))?", arg)
        if match:
            value = match.group(1)
            if value is None and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            os.environ.setdefault("LOCAL_RANK", str(value))
        else:
            out.append(arg)
        i += 1
    return out


def _all_keys(cfg: Any, prefix: str = "") -> list[str]:
    if not isinstance(cfg, DictConfig):
        return []
    keys = []
    for key in cfg.keys():
        full = f"{prefix}{key}"
        keys.append(full)
        keys.extend(_all_keys(cfg._get_node(key), f"{full}."))
    return keys


def compose_config(config_name: str, overrides: list[str]) -> DictConfig:
    """Compose with Hydra; unknown keys and options become ConfigErrors that name them."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="dllm_rl"):
        try:
            return compose(config_name=config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as exc:
            message = str(exc).split("\nConfig search path:")[0].strip()
            bad = re.search(r"Could not override '([^']+)'", message)
            if bad and "not in struct" in str(exc.__cause__):
                parent = bad.group(1).rpartition(".")[0]
                keys = [k for k in _all_keys(compose(config_name=config_name)) if k.rpartition(".")[0] == parent]
                raise ConfigError(
                    f"unknown config key {bad.group(1)!r}{did_you_mean(bad.group(1), keys)}; "
                    f"to add a new key write +{bad.group(1)}=..."
                ) from None
            if isinstance(exc, OverrideParseException):
                message = f"cannot parse the overrides {overrides}: {message.splitlines()[0]}"
            raise ConfigError(message.replace("\n\n", "\n").replace("\t", "  ")) from None


def resumed_config(run_dir: str, overrides: list[str]) -> tuple[DictConfig, bool]:
    """(the config a run was started with, its config.json, with key=value overrides of existing keys; whether
    `allow_changes=true` was given). Which changes a resume may make is `dllm_rl.resume`'s decision, taken
    in `train` for the CLI and for Python alike."""
    from dllm_rl.resume import read_run_config

    saved = read_run_config(run_dir)
    if saved is None or "task" not in saved:
        raise ConfigError(f"resume={run_dir!r}: no config.json there (expected a run directory made by dllm-rl train)")
    try:
        cfg = OmegaConf.create(saved)
    except OmegaConfBaseException as error:
        raise ConfigError(f"resume={run_dir!r}: its config.json is not a run config ({error})") from None
    OmegaConf.set_struct(cfg, True)
    allow = [o for o in overrides if o.partition("=")[0] == "allow_changes"]
    allowed = bool(allow) and yaml_value(allow[-1].partition("=")[2]) is True
    for override in [o for o in overrides if o not in allow]:
        key, sep, value = override.partition("=")
        if not sep or key.startswith(("+", "~")) or isinstance(OmegaConf.select(cfg, key, default=None), DictConfig):
            raise ConfigError(f"when resuming, only key=value overrides of existing keys are allowed, got {override!r}"
                              f" (a config group cannot change in a run)")
        try:
            OmegaConf.update(cfg, key, yaml_value(value), merge=True)
        except OmegaConfBaseException:
            keys = _all_keys(cfg)
            raise ConfigError(f"unknown config key {key!r}{did_you_mean(key, keys)}") from None
    cfg.resume = run_dir
    return cfg, allowed


def checkpoint_task(overrides: list[str]) -> dict[str, Any] | None:
    """The task config of the run whose checkpoint `model=` names (run/checkpoints/step_N, or `latest`), where the
    overrides name no task; else None."""
    if any(o.lstrip("+").startswith(("task=", "task.")) for o in overrides):
        return None
    model = [o.partition("=")[2] for o in overrides if o.startswith("model=")]
    if not model or not model[-1]:
        return None
    checkpoint = Path(model[-1]).expanduser().resolve()
    run_config = checkpoint.parent.parent / "config.json"
    if not ((checkpoint / "COMPLETE").is_file() and checkpoint.parent.name == "checkpoints" and run_config.is_file()):
        return None
    try:
        task = json.loads(run_config.read_text()).get("task")
    except (OSError, ValueError, AttributeError):
        return None
    known = isinstance(task, dict) and isinstance(task.get("name"), str)
    return task if known and (config_dir() / "task" / f"{task['name']}.yaml").is_file() else None


CONSENT_ENV = "DLLM_RL_TRUST_REMOTE_CODE"  # =1: consent for every trust_remote_code key of this command


def consent_given(cfg: DictConfig, overrides: list[str]) -> None:
    """Consent to run the code a model directory ships is the person's who runs the command: every
    `trust_remote_code` key (`trust_remote_code`, `external.trust_remote_code`) is true only where the command
    line sets it (`trust_remote_code=true`) or the environment has DLLM_RL_TRUST_REMOTE_CODE=1. A config file
    (a recipe in configs/, a resumed run's config.json) cannot give it: its `true` is reset to false, so a
    directory that ships code stops with the named error that asks for consent; the environment variable says
    yes to every such key of the command."""
    given = {o.lstrip("+").partition("=")[0] for o in overrides if "=" in o}  # the keys: their values are not read
    env = os.environ.get(CONSENT_ENV, "").strip().lower()
    if env not in ("", "0", "1", "true", "false"):
        raise ConfigError(f"{CONSENT_ENV}={os.environ[CONSENT_ENV]!r}: expected 1 (consent) or 0")
    for key in [k for k in _all_keys(cfg) if k.rpartition(".")[2] == "trust_remote_code"]:
        if key not in given:
            OmegaConf.update(cfg, key, env in ("1", "true"))


PACKAGE_PATH_KEYS = ("model", "external.path")  # keys whose defaults name the embedded models (models/...)


def from_the_package(cfg: DictConfig) -> None:
    """A relative model path that is not there from the working directory but is in the repository beside the
    package (the defaults `models/tiny-dllm`, `models/tiny-ar`) is taken from there, so the commands' defaults
    work from any directory."""
    root = config_dir().parent
    for key in PACKAGE_PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            if not Path(value).exists() and (root / value).is_dir():
                OmegaConf.update(cfg, key, str(root / value))


def yaml_value(text: str) -> Any:
    """An override's value as YAML reads it (`3` a number, `true` a bool, `[a, b]` a list); text YAML cannot read
    (`/tmp/x: y`, `a host::`) is the string it is."""
    if text == "":
        return OmegaConf.create({"v": text}).v
    try:
        return OmegaConf.create(f"v: {text}").v
    except (yaml.YAMLError, OmegaConfBaseException):
        return text


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        key = getattr(exc, "full_key", None) or "a key"
        raise ConfigError(f"{key} has no value (the config says ???); set it with {key}=...") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None


def usage() -> str:
    lines = ["usage: dllm-rl <command> [key=value ...] [--cfg] [--help]", "", "commands:"]
    lines += [f"  {name:10s} {doc}" for name, (doc, _, _) in COMMANDS.items()]
    lines += ["", "Overrides use Hydra's grammar: group=option, key=value, +new.key=value, ~key.",
              "dllm-rl <command> --help lists the command's config groups and keys; --version prints the version."]
    return "\n".join(lines)


_TOP_KEY = re.compile(r"^([A-Za-z_][\w]*):\s*(.*?)\s*(?:#\s*(.*))?$")
_DEFAULT = re.compile(r"^\s+-\s+(?:override\s+/)?([\w/]+):\s*(\S+)\s*(?:#\s*(.*))?$")


def yaml_outline(file: Path) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(the config groups of a command's config file as (group, default option, comment), its top-level keys as
    (key, default value, comment)), read from the file's own lines and comments."""
    groups, keys = [], []
    for line in file.read_text().splitlines():
        default = _DEFAULT.match(line)
        if default and default.group(1) != "_self_":
            groups.append((default.group(1), default.group(2), default.group(3) or ""))
            continue
        key = _TOP_KEY.match(line)
        if key and key.group(1) != "defaults":
            keys.append((key.group(1), key.group(2) or "(a group of keys)", key.group(3) or ""))
    return groups, keys


def command_help(name: str) -> str:
    """What `dllm-rl <name> --help` prints: the command, its config file, every config group it uses with its
    default and options, and every top-level key with its default and the config's own comment."""
    doc, config_name, _ = COMMANDS[name]
    file = config_dir() / f"{config_name}.yaml"
    groups, keys = yaml_outline(file)
    lines = [f"dllm-rl {name}: {doc}", f"config: {file}", "", "config groups (group=option):"]
    group_width = max((len(g) + len(d) for g, d, _ in groups), default=0) + 1
    for group, default, comment in groups:
        options = " | ".join(sorted(f.stem for f in (config_dir() / group).glob("*.yaml")))
        lines.append(f"  {f'{group}={default}':<{group_width}s}  {comment}".rstrip())
        lines.append(f"  {'':<{group_width}s}  options: {options}")
    width = max((len(k) + len(v) for k, v, _ in keys), default=0) + 1
    lines += ["", "keys (key=value; a group's own keys as group.key=value, see --cfg):"]
    lines += [f"  {f'{key}={value}':<{width}s}  {comment}".rstrip() for key, value, comment in keys]
    nested = [key for key, value, _ in keys if value == "(a group of keys)"]
    lines += ["", f"A group's keys with their comments: dllm-rl {name} --help <{'|'.join([*nested, *(g for g, _, _ in groups)])}>.",
              "Print the resolved config with --cfg."]
    return "\n".join(lines)


def topic_help(name: str, topic: str) -> str:
    """`dllm-rl <name> --help <topic>`: a block of keys of the command's config (`workers`, `mixing`, ...) as the
    file writes it, with its comments; or a config group's options, each with its keys and comments."""
    _, config_name, _ = COMMANDS[name]
    file = config_dir() / f"{config_name}.yaml"
    groups, keys = yaml_outline(file)
    lines = file.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(rf"{re.escape(topic)}:(\s|$)", line)]
    if starts:
        block = [lines[starts[0]]]
        for line in lines[starts[0] + 1:]:
            if line.strip() and not line.startswith((" ", "#")):
                break
            block.append(line)
        return "\n".join([f"dllm-rl {name}: {topic}.* ({file})", *(line for line in block if line.strip())])
    if topic in [g for g, _, _ in groups]:
        out = [f"dllm-rl {name}: {topic}=<option> ({config_dir() / topic}/), each option's keys as {topic}.key=value"]
        for option in sorted((config_dir() / topic).glob("*.yaml")):
            out += ["", f"{topic}={option.stem}:"] + [f"  {line}" for line in option.read_text().splitlines()
                                                     if line.strip() and not line.startswith("# @package")]
        return "\n".join(out)
    known = [k for k, v, _ in keys if v == "(a group of keys)"] + [g for g, _, _ in groups]
    raise ConfigError(f"--help {topic}: not a group of dllm-rl {name}{did_you_mean(topic, known)}; its groups: "
                      f"{', '.join(known)}")


def quiet_libraries() -> None:
    """Third-party noise a command-line user cannot act on, silenced once for the process: transformers' and
    datasets' per-load progress bars and info lines, and the FutureWarning torch raises on every rank each time
    DeepSpeed calls its renamed `all_gather_into_tensor`. Warnings and errors still show."""
    import warnings

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_warning()
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_warning()
    except ImportError:
        pass


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("dllm-rl")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    args = strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    if not args:  # a command is needed: the list of them, as an error
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] == "--version":
        print(f"dllm-rl {version()}")
        return 0
    try:
        doc, config_name, runner = pick(COMMANDS, args[0], "command")
        flags = {a for a in args[1:] if a.startswith("-") and "=" not in a}
        if args[0] == "plan" and "--measure" in flags:  # the planner's one flag: measure=true
            flags.discard("--measure")
            args = [*(a for a in args if a != "--measure"), "measure=true"]
        unknown = flags - {"--cfg", "--help", "-h"}
        if unknown:
            raise ConfigError(f"unknown flag(s) {sorted(unknown)}; expected --cfg, --help or -h")
        if flags & {"--help", "-h"}:
            topics = [a for a in args[1:] if a not in flags and "=" not in a]
            print("\n\n".join(topic_help(args[0], t) for t in topics) if topics else command_help(args[0]))
            return 0
        overrides = [a for a in args[1:] if a not in flags]
        # compare's run directories may be plain arguments (dllm-rl compare runs/a runs/b): set after composing,
        # so a path need not survive the override grammar
        positional = [a for a in overrides if "=" not in a] if args[0] == "compare" else []
        overrides = [a for a in overrides if a not in positional]
        run_task = checkpoint_task(overrides) if args[0] == "eval" else None
        if run_task is not None:  # a run's checkpoint knows its task: scored on it unless the user names another
            overrides = [f"task={run_task['name']}", *overrides]
        resume = [o.split("=", 1)[1] for o in overrides if o.startswith("resume=")]
        allowed = False
        if resume and resume[-1] not in ("", "null") and args[0] == "train":
            cfg, allowed = resumed_config(resume[-1], [o for o in overrides if not o.startswith("resume=")])
        else:
            cfg = compose_config(config_name, overrides)
        if positional:
            OmegaConf.update(cfg, "runs", [*cfg.runs, *positional])
        if run_task is not None:
            OmegaConf.update(cfg, "task", {k: v for k, v in run_task.items() if k in cfg.task}, merge=True)
            print(f"task={run_task['name']}: the task of the run this checkpoint comes from (task=<name> scores it on "
                  f"another)", file=sys.stderr)
        consent_given(cfg, overrides)
        from_the_package(cfg)
        if "--cfg" in flags:
            print(OmegaConf.to_yaml(cfg, resolve=True), end="")
            return 0
        quiet_libraries()  # here: help, --cfg and config errors need no transformers
        runner(to_plain(cfg) | ({"allow_changes": True} if allowed else {}))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
