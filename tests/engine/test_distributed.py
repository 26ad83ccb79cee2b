"""Two CPU processes over gloo (torchrun), against the single-process run: ZeRO stages 0-3 agree on loss and
parameters after two steps, so do ZeRO-3 runs whose ranks make different numbers of forwards (parallel decoding
scored in order, the LLaDA stand-in), a ZeRO-3 resume continues exactly, a ZeRO-3 rollout equals the unsharded one,
the exported checkpoint gives the live engine's logits, and a rank that stops answering fails the run with
a timeout instead of hanging it. Every launch gets its own free port and a wall-clock limit."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl.engine.dist import MARKER, free_port

WORKER = Path(__file__).with_name("dist_worker.py")
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", MARKER)
pytestmark = pytest.mark.slow


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any rank variables (a launcher sets its own), the venv's tools first."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    return {**env, **extra}


def launch(out: Path, model: str, *command: str, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = clean_env(**(env or {}))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            str(WORKER), str(out), model, *command]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def launched(out: Path, model: str, *command: str, env: dict[str, str] | None = None) -> None:
    result = launch(out, model, *command, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, char_tokenizer):
    """Single-process zero0 in this process, then two ranks at every stage, resumed, rolled out, exported."""
    sys.path[:0] = [str(WORKER.parent), str(WORKER.parents[1])]
    import dist_worker

    root = tmp_path_factory.mktemp("dist")
    model = root / "model"
    from conftest import make_tiny_dllm

    policy = make_tiny_dllm(char_tokenizer)
    policy.model.save_pretrained(model)
    char_tokenizer.save_pretrained(model)
    single = root / "single"
    single.mkdir()
    dist_worker.run_train(single, str(model), 0)
    two = root / "two"
    two.mkdir()
    launched(two, str(model), "train", "0", "1", "2", "3")
    return root, single, two


def test_every_stage_agrees_with_the_single_process_run(runs):
    root, single, two = runs
    base, base_weights = metrics(single / "zero0"), weights(single / "zero0", 2)
    assert all(m["policy/updates"] == 2 for m in base)  # both steps trained, two minibatches each (rows of
    # every rank in each), so the agreement also checks that the ranks draw the single-process minibatches
    assert sum(m["external/rows"] for m in base) == sum(m["external/rows"] for m in metrics(two / "zero0"))
    for stage in range(4):
        run = metrics(two / f"zero{stage}")
        for key in ("loss/policy", "loss/kl", "policy/grad_norm", "reward/on_policy", "len/on_policy"):
            assert [m[key] for m in run] == pytest.approx([m[key] for m in base], rel=1e-5, abs=1e-7), (stage, key)
        assert_weights_agree(weights(two / f"zero{stage}", 2), base_weights, stage)
    moved = weights(two / "zero3", 2)
    start = load_file(str(root / "model" / "model.safetensors"))
    assert any(not torch.equal(start[k], moved[k]) for k in start)


@pytest.fixture(scope="module")
def worker_runs(runs):
    """Three launches with Ray rollout workers at ZeRO-3, each Ray under its own short TMPDIR: an asynchronous run
    (S = 1) whose rank 0 raises at step 2 (a failed run: its Ray must be gone when it exits); asynchronous workers
    with worker 1 SIGKILLed at step 2 and rank 0 SIGKILLed after logging step 3; then that run resumed to
    its end and, in the same launch, the synchronous workers' run and the pipelined workers' runs (dist_worker.PIPE,
    synchronous and streamed). The output directory, the TMPDIR root, /dev/shm's files before, the killed launch's
    metrics."""
    from tests.workers.conftest import processes_mentioning

    root, _, _ = runs
    out, short = root / "async", Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # Ray's sockets need short paths
    out.mkdir()
    shared = set(os.listdir("/dev/shm"))
    failed = launch(out, str(root / "model"), "async", "fail", "3", env={"TMPDIR": str(short)})
    assert failed.returncode != 0 and "a planted failure on rank 0 at step 2" in failed.stderr, failed.stderr[-3000:]
    # a failed run stops the Ray it started before it exits: nothing of it is left, at once
    assert not processes_mentioning(str(short)) and not list(short.glob("dllm-ray-*"))
    assert set(os.listdir("/dev/shm")) <= shared
    killed = launch(out, str(root / "model"), "async", "kill", "3", env={"TMPDIR": str(short)})
    assert killed.returncode != 0 and not (out / "done_async_rank0.json").exists(), killed.stderr[-3000:]
    before = metrics(out / "async_zero3")
    launched(out, str(root / "model"), "async", "resume", "3", env={"TMPDIR": str(short)})
    yield out, short, shared, before
    shutil.rmtree(short, ignore_errors=True)


def test_two_learner_ranks_with_rollout_workers_train_as_with_their_own_rollouts(runs, worker_runs):
    """Synchronous rollout workers under two learner ranks at ZeRO-3 (rank 0 holds the pool; every rank takes
    part in gathering the weights it publishes): the two-rank run with in-process rollouts, step for step."""
    _, _, two = runs
    out = worker_runs[0]
    ours, theirs = metrics(two / "zero3"), metrics(out / "workers_zero3")  # ZeRO-3: the publish gathers
    assert [m["reward/on_policy"] for m in ours] == [m["reward/on_policy"] for m in theirs]
    assert [m["rollout/policy_version"] for m in theirs] == [1.0, 2.0]
    a, b = weights(two / "zero3", 2), weights(out / "workers_zero3", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_groups_streamed_to_two_ranks_at_zero3_train_as_the_synchronous_update(worker_runs):
    """`workers.pipe=true` under two learner ranks at ZeRO-3: each round one finished group per rank (3 groups a
    step: the second round's rank 1 takes a stand-in), every rank's passes accumulated into the partitions and the
    step's normaliser over ranks applied once by the ZeRO optimizer's unscaling; two steps with ERILS's rows and
    beta > 0 leave every weight within 1e-6 of the synchronous two-rank update's (6e-7 measured; ZeRO 0, checked
    by hand: 1e-6), with the same rewards, losses and gradient norms (a normaliser applied twice or not at all
    shows in the norm, which AdamW's scale-free first steps might hide in the weights)."""
    out = worker_runs[0]
    ours, theirs = metrics(out / "pipe_sync_zero3"), metrics(out / "pipe_zero3")
    for key in ("rollouts/on_policy", "external/rows", "policy/updates"):
        assert [m[key] for m in ours] == [m[key] for m in theirs], key
    for key in ("reward/on_policy", "loss/policy", "loss/kl", "policy/grad_norm"):  # means taken in other orders
        assert [m[key] for m in ours] == pytest.approx([m[key] for m in theirs], rel=1e-5, abs=1e-8), key
    a, b = weights(out / "pipe_sync_zero3", 2), weights(out / "pipe_zero3", 2)
    start = load_file(str(out.parent / "model" / "model.safetensors"))
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3  # trained
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_asynchronous_workers_serve_two_ranks_at_zero3_through_a_killed_worker_and_a_killed_learner(worker_runs):
    """S = 1 with two Ray workers under two learner ranks at ZeRO-3 (rank 0 holds the pipeline and its one
    admission): a worker SIGKILLed at step 2 has its groups regenerated, rank 0 SIGKILLed after logging step 3
    ends the launch, and the resumed run finishes. Every step's lag is within S; each step's groups are split
    whole over the ranks; no group is trained on twice, before or after the resume; no step is logged twice; and
    nothing of either launch's Ray is left (its processes, its session directories, shared memory)."""
    from tests.workers.conftest import processes_mentioning

    out, short, shared, before = worker_runs
    assert [m["step"] for m in before] == [1, 2, 3]
    # the dead worker's groups (started at step 2 for step 3) failed, were made again and its actor restarted
    assert before[-1]["rollout/worker_restarts"] >= 1 and before[-1]["rollout/regenerated"] >= 1
    lines = metrics(out / "async_zero3")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]  # step 3 of the killed launch was cut back and made again
    assert all(m["rollout/lag_max"] <= 1 and m["rollout/lag_violations"] == 0 for m in lines)
    assert max(m["rollout/lag_max"] for m in lines) == 1  # groups were generated ahead
    assert [m["rollout/policy_version"] for m in lines] == [1.0, 2.0, 3.0, 4.0]
    # each rank's groups per step: the kept steps of the killed launch (1-2), then the resumed launch's (3-4)
    per_rank = [[json.loads(line) for line in (out / f"async_{mode}_groups_rank{r}.jsonl").read_text().splitlines()]
                for mode in ("kill", "resume") for r in (0, 1)]
    kept = [per_rank[0][:2], per_rank[1][:2]]
    resumed = [per_rank[2], per_rank[3]]
    trained = []
    for rank0, rank1 in [*zip(*kept), *zip(*resumed)]:
        assert rank0 and rank1 and not set(rank0) & set(rank1)  # whole groups, each on one rank
        step = rank0 + rank1
        assert all(step.count(q) == 2 for q in step) and len(set(step)) == 4  # B = 4 groups of G = 2
        trained += sorted(set(step))
    assert len(trained) == len(set(trained)) == 16
    assert set(os.listdir("/dev/shm")) <= shared
    deadline = time.time() + 30  # the killed launch's Ray is ended by its reaper
    while time.time() < deadline and (processes_mentioning(str(short)) or list(short.glob("dllm-ray-*"))):
        time.sleep(0.5)
    assert not processes_mentioning(str(short)) and not list(short.glob("dllm-ray-*"))


def assert_weights_agree(got: dict[str, torch.Tensor], base: dict[str, torch.Tensor], label) -> None:
    """fp32, lr 1e-3. AdamW's first update is lr * g / (|g| + eps): an element whose gradient is near eps moves by
    up to lr when ranks sum the gradient in another order, so a handful of elements (4 of 33k at stages 0-2, 19
    at stage 3, by at most 2e-5) differ from one process; a wrong gradient moves thousands by ~lr."""
    assert got.keys() == base.keys()
    off = sum(int(((got[k] - v).abs() > 2e-6).sum()) for k, v in base.items())
    worst = max(float((got[k] - v).abs().max()) for k, v in base.items())
    assert off <= 40 and worst < 1e-4, (label, off, worst)


# The two-rank runs of the parametrized agreement tests below on the module's model, each kind in one launch (a
# launch costs a launcher and two interpreters' start, several seconds on 2 cores); their outputs are named by run.
UNEVEN_ON_THE_MODEL = ("threshold", "espo", "spg", "justgrpo")
RAGGED_NAMES = ("sera", "ds_darts", "echo", "bandit", "multi_turn")


@pytest.fixture(scope="module")
def uneven_two(runs):
    root, _, _ = runs
    two = root / "uneven_two"
    two.mkdir()
    # with them, in the same launch, the pieces test's runs at ZeRO-2 and 3
    launched(two, str(root / "model"), "uneven", ",".join(UNEVEN_ON_THE_MODEL + ("pieces@2@3",)))
    return two


@pytest.fixture(scope="module")
def ragged_two(runs):
    root, _, _ = runs
    two = root / "ragged_two"
    two.mkdir()
    launched(two, str(root / "model"), "ragged", ",".join(RAGGED_NAMES), "0", "2", "3")
    return two


@pytest.mark.parametrize("name", ["threshold", "llada"])
def test_ranks_that_need_different_forward_counts_agree_with_one_process_at_zero3(runs, uneven_two, name,
                                                                                  char_tokenizer):
    """ZeRO-3's forward-count rule (dllm_rl/lockstep.py): confidence-parallel rollouts scored by the `ordered`
    estimator, and a model that ignores the attention mask (the LLaDA stand-in, one forward per prompt length),
    make different numbers of forwards on the two ranks; the run neither hangs nor drifts from one process."""
    import dist_worker
    from tests.policy.remote_standins import write_llada

    root, _, _ = runs
    model = root / "model" if name == "threshold" else write_llada(root / f"llada_{name}", char_tokenizer)
    single, two = root / f"uneven_single_{name}", uneven_two
    single.mkdir()
    if name not in UNEVEN_ON_THE_MODEL:  # a model of its own
        two = root / f"uneven_two_{name}"
        two.mkdir()
        launched(two, str(model), "uneven", name)
    dist_worker.run_uneven(single, str(model), name, 0)
    declared = [json.loads((two / f"{name}_declared_rank{r}.json").read_text()) for r in (0, 1)]
    assert declared[0] != declared[1]  # the ranks needed different counts: without the rule this run hangs
    base, run = metrics(single / f"{name}_zero0"), metrics(two / f"{name}_zero3")
    assert [m["step"] for m in base] == [m["step"] for m in run] == [0, 1, 2]  # held-out evaluation at 0 and 2
    assert all(m["policy/updates"] > 0 for m in base[1:])
    for key in ("loss/policy", "loss/kl", "policy/grad_norm", "reward/on_policy", "len/on_policy", "eval/reward",
                "eval/len"):
        got, want = ([m[key] for m in lines if key in m] for lines in (run, base))
        assert len(want) == 2 and got == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert_weights_agree(weights(two / f"{name}_zero3", 2), weights(single / f"{name}_zero0", 2), name)


@pytest.mark.parametrize("name", ["espo", "spg", "justgrpo"])
def test_the_newest_estimators_agree_with_one_process_at_zero3(runs, uneven_two, name):
    """ESPO's and SPG's estimators (one forward of M masked copies per row; SPG's bound chosen by each row's
    advantage, its plain policy gradient) and JustGRPO's recipe (left to right, the old policy's log-probs replayed
    from the sampler's record: no old-policy forward on either rank) at ZeRO-3 on two ranks give one process's
    losses, rewards and weights."""
    import dist_worker

    root, _, _ = runs
    single, two = root / f"estimator_single_{name}", uneven_two
    single.mkdir()
    dist_worker.run_uneven(single, str(root / "model"), name, 0)
    base, run = metrics(single / f"{name}_zero0"), metrics(two / f"{name}_zero3")
    assert all(m["policy/updates"] == 2 * 2 for m in base[1:])  # two inner iterations of two minibatches
    replayed = [m["likelihood/old_from_rollout"] for m in run if "likelihood/old_from_rollout" in m]
    assert replayed == [float(name == "justgrpo")] * 2
    for key in ("loss/policy", "loss/kl", "policy/grad_norm", "reward/on_policy", "eval/reward"):
        got, want = ([m[key] for m in lines if key in m] for lines in (run, base))
        assert len(want) == 2 and got == pytest.approx(want, rel=1e-5, abs=1e-7), key
    assert_weights_agree(weights(two / f"{name}_zero3", 2), weights(single / f"{name}_zero0", 2), name)


def test_a_minibatch_in_pieces_agrees_with_one_process_whole_at_zero2_and_zero3(runs, uneven_two):
    """JustGRPO's recipe with ERILS rows, back-propagated one row and at most 5 forwards at a time
    (micro_batch_rows=1, micro_batch_forwards=5), the gradient accumulated over the pieces: two ranks at ZeRO-2
    (gradients reduced in every backward) and ZeRO-3 (parameters gathered in every forward) give the losses and
    weights one process gives with the whole minibatch in one backward."""
    import dist_worker

    root, _, _ = runs
    single, two = root / "pieces_single", uneven_two
    single.mkdir()
    dist_worker.run_uneven(single, str(root / "model"), "pieces_whole", 0)
    base = metrics(single / "pieces_whole_zero0")
    assert all(m["policy/updates"] == 2 * 2 for m in base[1:]) and any(m.get("external/rows", 0) for m in base)
    for stage in (2, 3):
        run = metrics(two / f"pieces_zero{stage}")
        for key in ("loss/policy", "loss/kl", "policy/grad_norm", "policy/clip_frac",
                    "reward/on_policy", "eval/reward"):
            got, want = ([m[key] for m in lines if key in m] for lines in (run, base))
            assert len(want) == 2 and got == pytest.approx(want, rel=1e-5, abs=1e-7), (stage, key)
        assert_weights_agree(weights(two / f"pieces_zero{stage}", 2), weights(single / "pieces_whole_zero0", 2), stage)


@pytest.mark.parametrize("name", RAGGED_NAMES)
def test_ranks_holding_uneven_rows_agree_with_one_process_at_zero_0_2_3(runs, ragged_two, name):
    """Rollout curation leaves the ranks uneven (SERA's group sizes, dynamic sampling's dropped groups and extra
    rounds, DARTS's selection, GRPODropout's dropped rollouts): the gathered keys put every row in its single-process
    place, so losses, rewards and weights still match one process at ZeRO 0, 2 and 3."""
    import dist_worker

    root, _, _ = runs
    single, two = root / f"ragged_single_{name}", ragged_two
    single.mkdir()
    dist_worker.run_ragged(single, str(root / "model"), name, 0)
    base = metrics(single / f"ragged_{name}_zero0")
    whole = json.loads((single / f"ragged_{name}_zero0_rows_rank0.json").read_text())
    if name == "sera":  # groups of different sizes in one step
        assert any(len(set(sizes)) > 1 for _, sizes in whole), whole
    for stage in (0, 2, 3):
        held = [json.loads((two / f"ragged_{name}_zero{stage}_rows_rank{r}.json").read_text()) for r in (0, 1)]
        assert [a[0] + b[0] for a, b in zip(*held)] == [rows for rows, _ in whole]  # together: one process's rows
        if name == "ds_darts":  # dropped groups leave the ranks uneven (SERA's ranks balance by rollouts)
            assert any(a[0] != b[0] for a, b in zip(*held)), held
            assert sum(m.get("curation/dropout_dropped", 0) for m in base) > 0  # GRPODropout dropped rollouts
        if name == "bandit":  # replayed rows and relabelled ones, on some ranks only
            assert sum(m["curation/bandit_replayed"] for m in base) > 0
            assert sum(m["curation/hindsight_rows"] for m in base) > 0
        if name == "multi_turn":  # episodes of unequal length: the ranks hold different numbers of turn rows
            assert any(a[0] != b[0] for a, b in zip(*held)), held
            assert all(m["env/turns"] > 1 for m in base[1:]) and any(m["policy/updates"] > 0 for m in base)
            assert all(m["external/episodes"] > 0 for m in base[1:])  # the solver's episodes joined every step
        if name == "echo":  # clips on some ranks only, learnt beside the GRPO loss
            assert sum(m["curation/echo_clips"] for m in base) > 0 and any(m.get("loss/echo", 0) > 0 for m in base)
        run = metrics(two / f"ragged_{name}_zero{stage}")
        for key in ("loss/policy", "loss/kl", "policy/grad_norm", "reward/on_policy", "len/on_policy",
                    "rollouts/on_policy", "reward/zero_std_groups", "curation/rollouts_generated",
                    "curation/rows_dropped", "curation/dropout_dropped", "curation/echo_clips", "curation/echo_tokens",
                    "loss/echo",
                    "curation/echo_external_clips", "loss/echo_external", "curation/bandit_replayed",
                    "curation/bandit_left_out", "curation/bandit_probe", "reward/replay", "curation/hindsight_rows",
                    "loss/hindsight", "env/success", "env/turns", "env/invalid", "env/anchors_shared",
                    "external/episodes", "external/rows", "external/anchors_shared", "reward/external"):
            assert [m.get(key, 0.0) for m in run] == pytest.approx([m.get(key, 0.0) for m in base], rel=1e-5,
                                                                  abs=1e-7), (stage, key)
        assert_weights_agree(weights(two / f"ragged_{name}_zero{stage}", 2),
                             weights(single / f"ragged_{name}_zero0", 2), (name, stage))


# Golden numbers of the two-rank ZeRO-2 run (dist_worker.SETTINGS, fp32): per step (loss/policy, loss/kl,
# reward/on_policy, reward/external), then the checksum of the weights after step 2 as tests/test_golden.py
# computes it. The dense reward gives the on-policy rows a loss of their own beside the solver's rows (re-pinned
# when the run moved from arithmetic's exact reward, which an untrained model never earns, to that one; and
# once when every draw became a function of the row's key instead of its global position).
ZERO2_GOLDEN = ([(-0.022511024842970073, 0.0025527168181724846, 0.13609372824430466, 0.08928571455180645),
                 (-0.037317873910069466, 0.010702856816351414, 0.0792154110968113, 0.14642857760190964)],
                (162.21680756210208, -26.316277062503104))


def test_two_ranks_at_zero2_give_the_golden_numbers(runs, checksum):
    _, _, two = runs
    run = two / "zero2"
    steps, expected_checksum = ZERO2_GOLDEN
    got = [(m["loss/policy"], m["loss/kl"], m["reward/on_policy"], m["reward/external"]) for m in metrics(run)]
    assert got == [pytest.approx(s, rel=1e-5, abs=1e-7) for s in steps]
    # fp32 rounding differs from one process (the loss is summed over ranks): a little more room than one run
    assert checksum(run / "checkpoints" / "step_000002") == pytest.approx(expected_checksum, rel=0, abs=1e-5)


def test_deepspeed_groups_take_the_configured_timeout(runs):
    """DeepSpeed makes its own groups with `new_group(ranks)`; they must time out after the run's timeout (60 s
    in the worker), not torch's default of 30 minutes."""
    _, _, two = runs
    for rank in (0, 1):
        timeouts = json.loads((two / f"group_timeouts_rank{rank}.json").read_text())
        assert len(timeouts) >= 2 and set(timeouts) == {60.0}, timeouts


def test_lora_at_zero2_and_zero3_agrees_with_the_single_process_run(runs):
    """LoRA with the adapter-off KL reference on two ranks: ZeRO-2 and ZeRO-3 (adapters partitioned with the
    frozen base) give the single-process losses and adapter weights; checkpoints hold the adapter only."""
    import dist_worker

    root, _, _ = runs
    single, two = root / "lora_single", root / "lora_two"
    single.mkdir()
    two.mkdir()
    dist_worker.run_train(single, str(root / "model"), 0, lora=True)
    launched(two, str(root / "model"), "lora", "2", "3")
    reference = metrics(single / "lora_zero0")
    adapter = load_file(str(single / "lora_zero0" / "checkpoints" / "step_000002" / "adapter_model.safetensors"))
    for run in (two / "lora_zero2", two / "lora_zero3", two / "lora_gc_zero3"):  # the last: gradient checkpointing
        for a, b in zip(metrics(run), reference):
            assert a["loss/policy"] == pytest.approx(b["loss/policy"], rel=1e-5, abs=1e-7)
            assert a["loss/kl"] == pytest.approx(b["loss/kl"], rel=1e-4, abs=1e-9)
        checkpoint = run / "checkpoints" / "step_000002"
        assert not (checkpoint / "model.safetensors").exists()
        got = load_file(str(checkpoint / "adapter_model.safetensors"))
        assert got.keys() == adapter.keys()
        for name in adapter:
            torch.testing.assert_close(got[name], adapter[name], rtol=0, atol=2e-6)


def test_lora_dropout_resumes_bit_for_bit_on_two_ranks(runs):
    """Dropout draws from each rank's global RNG: every rank saves its own with the checkpoint (rank 1 restoring
    rank 0's would draw other masks), so the resumed run equals the uninterrupted one bit for bit."""
    root, _, _ = runs
    out = root / "dropout"
    out.mkdir()
    launched(out, str(root / "model"), "dropout")
    resumed, straight = out / "dropout", out / "dropout_straight"
    assert {p.name for p in (resumed / "checkpoints" / "step_000002").glob("rng_rank*.pt")} == {"rng_rank0.pt",
                                                                                           "rng_rank1.pt"}
    a, b = (load_file(str(run / "checkpoints" / "step_000003" / "adapter_model.safetensors"))
            for run in (resumed, straight))
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert [strip(m) for m in metrics(resumed)] == [strip(m) for m in metrics(straight)]


def test_zero3_resume_continues_exactly(runs):
    root, _, two = runs
    launched(two, str(root / "model"), "resume")  # zero3: 2 steps + resume to 3; and 3 steps straight
    resumed, straight = two / "zero3", two / "straight" / "zero3"
    a, b = weights(resumed, 3), weights(straight, 3)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    ma, mb = metrics(resumed), metrics(straight)
    assert [m["step"] for m in ma] == [1, 2, 3]
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert [strip(m) for m in ma] == [strip(m) for m in mb]


def test_zero3_rollout_equals_the_unsharded_rollout(runs):
    root, _, two = runs
    launched(two, str(root / "model"), "rollout")
    import dist_worker

    from dllm_rl.policy.adapters import load_policy
    from dllm_rl.rollout.generate import TextGenerator

    policy, tokenizer = load_policy(str(root / "model"))
    generator = TextGenerator(policy, tokenizer, gen_length=16, block_length=8, steps=8, temperature=1.0)
    for rank in range(2):
        expected = generator.sample(dist_worker.PROMPTS[rank * 2:rank * 2 + 2], [11 + rank * 2 + i for i in range(2)])
        assert torch.equal(torch.load(two / f"rollout_rank{rank}.pt"), expected.completion_BC)


def test_exported_zero3_checkpoint_gives_the_live_logits(runs):
    root, _, two = runs
    checkpoint = two / "zero3" / "checkpoints" / "step_000002"
    launched(two, str(root / "model"), "logits", str(checkpoint))
    from transformers import AutoModel

    from dllm_rl import cli
    from dllm_rl.data.tokenizers import load_tokenizer

    out = root / "exported"
    assert cli.main(["export", f"checkpoint={checkpoint}", f"output_dir={out}"]) == 0
    model, tokenizer = AutoModel.from_pretrained(out).eval(), load_tokenizer(str(out))
    ids = torch.tensor([tokenizer("12+7=19", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, torch.load(two / "live_logits.pt"), rtol=0, atol=1e-5)
    assert cli.main(["export", f"checkpoint={checkpoint}", f"output_dir={out}"]) == 2  # never overwrites


def test_a_rank_that_stops_answering_fails_the_run_with_a_timeout(tmp_path):
    start = time.perf_counter()
    result = launch(tmp_path, "unused", "hang", timeout=100)
    assert result.returncode != 0
    assert time.perf_counter() - start < 90  # rank 0's collective timed out after 5 s; rank 1 was torn down
    assert "timed out" in (result.stdout + result.stderr).lower()


@pytest.mark.parametrize("script, count", [("launch_deepspeed.sh", "NUM_GPUS"), ("launch_torchrun.sh", "NPROC")])
def test_launcher_scripts_train_with_two_cpu_processes(runs, script, count):
    """The real CLI under each launcher: Hydra overrides and the deepspeed launcher's --local_rank coexist."""
    root, _, _ = runs
    run = root / script
    overrides = [f"model={root / 'model'}", f"run_dir={run}", "task=arithmetic", "steps=1", "prompts_per_step=2",
                 "group_size=2", "minibatch_size=4", "rollout.gen_length=32", "rollout.block_length=16",
                 "rollout.steps=16", "eval_every=0", "tensorboard=false", "deepspeed=zero2", "mixing.per_prompt=1"]
    env = clean_env(**{count: "2", "MASTER_PORT": str(free_port())})
    result = subprocess.run(["bash", str(WORKER.parents[2] / "scripts" / script), *overrides], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (line,) = metrics(run)
    assert line["step"] == 1 and line["external/rows"] == 2  # one solver row per prompt, over both ranks
    state = torch.load(run / "checkpoints" / "step_000001" / "trainer_state.pt", weights_only=False)
    assert state["world_size"] == 2 and state["stage"] == 2
