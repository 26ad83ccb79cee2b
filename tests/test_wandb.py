"""`logger=wandb`, offline: a W&B run in the run directory with the metrics of metrics.jsonl under the same keys and
steps, the run's name, project, tags and config, sampled completions as tables, and a resumed run that continues
the same W&B run.

The run file is read with W&B's own record classes (`wandb.proto`): wandb 0.31 ships the reader of its
transaction log only inside its Go core, so the log's framing (LevelDB's: 32 KiB blocks of records, each with a
7-byte header of checksum, length and kind, after a 7-byte ':W&B' file header) is undone here."""

import json
import struct
from pathlib import Path

import pytest

from dllm_rl import cli

pytestmark = pytest.mark.slow
BLOCK, FULL, FIRST, MIDDLE, LAST = 32768, 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (FULL, FIRST):
            pending = chunk
        elif kind in (MIDDLE, LAST):
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(records) -> dict[int, dict]:
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows[row["_step"]] = row
    return rows


def test_a_wandb_run_holds_the_same_metrics_as_metrics_jsonl(tmp_path):
    run = tmp_path / "run"
    common = ["steps=2", "eval_every=1", "eval_prompts=4", "sample_every=1", "prompts_per_step=2", "tensorboard=false",
              "logger=wandb", "logger.mode=offline", "logger.project=dllm-rl-test", "logger.run_name=tiny",
              "logger.tags=[cpu,test]"]
    assert cli.main(["train", f"run_dir={run}", *common, "checkpoint_every=1"]) == 0
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = wandb_records(files[0])
    meta = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (meta.project, meta.display_name, list(meta.tags)) == ("dllm-rl-test", "tiny", ["cpu", "test"])
    assert meta.run_id == (run / "wandb_run_id").read_text().strip()
    config = {item.key: json.loads(item.value_json) for item in meta.config.update}
    assert config["group_size"] == 6 and config["logger"]["name"] == "wandb"

    logged = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    rows = history(records)
    assert sorted(rows) == sorted(logged) == [0, 1, 2]
    for step, metrics in logged.items():
        mine = {k: v for k, v in metrics.items() if k != "step"}
        theirs = {k: v for k, v in rows[step].items() if not k.startswith(("_", "samples/"))}
        assert theirs.keys() == mine.keys(), step
        assert all(theirs[k] == pytest.approx(v) for k, v in mine.items()), step
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for step in (1, 2):
        assert rows[step]["samples/_type"] == "table-file"
        table = json.loads((files[0].parent / "files" / rows[step]["samples/path"]).read_text())
        assert table["columns"][:3] == ["step", *list(samples[0])[1:3]]
        assert len(table["data"]) == sum(s["step"] == step for s in samples)

    assert cli.main(["train", f"resume={run}", "steps=3"]) == 0  # the same W&B run goes on
    resumed = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(resumed) == 2
    later = wandb_records(max(resumed, key=lambda p: p.stat().st_mtime))
    assert next(r.run for r in later if r.WhichOneof("record_type") == "run").run_id == meta.run_id
    assert 3 in history(later)


def test_a_bad_logger_option_is_named(capsys):
    assert cli.main(["train", "logger=wandb", "logger.mode=cloud"]) == 2
    assert "logger.mode='cloud': expected one of ['online', 'offline', 'disabled']" in capsys.readouterr().err
    assert cli.main(["train", "logger=slack"]) == 2


def test_a_key_the_logger_does_not_have_is_named():
    from dllm_rl.errors import ConfigError
    from dllm_rl.tracking import check_logger

    with pytest.raises(ConfigError, match=r"logger.project: not a key of logger=tensorboard \(its keys: none\)"):
        check_logger({"name": "tensorboard", "project": "x"})
    assert check_logger({"name": "wandb"})["mode"] == "online"
