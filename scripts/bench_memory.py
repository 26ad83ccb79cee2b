"""ZeRO memory benchmark: model state held per rank at DeepSpeed ZeRO stages 0-3, against the theory.

For each stage it launches `--ranks` processes (torch.distributed.run; gloo on CPU), builds a native dLLM of
about 150M parameters the way the trainer does (under `partitioned_loading`, so ZeRO-3 never holds a full
copy), wraps it in the trainer's `Engine` with a torch AdamW, and runs a few training steps (forward, under
bf16 autocast where the CPU has native bf16 as in `dllm-rl train bf16=auto`; backward; optimizer step) on random tokens.
After the last backward, before its optimizer step, each rank takes a census of every live tensor storage (deduplicated
by address) and sorts it into

- parameters: the module's parameters (at stage 3 their local partitions, `ds_tensor`);
- optimizer state: AdamW's moments plus the fp32 master partitions DeepSpeed keeps at stages 1-3;
- gradients and engine buffers: everything else that did not exist before the engine was built
  (`param.grad`, DeepSpeed's gradient partitions and reduction buckets).

It also records each rank's resident memory at the census (after `malloc_trim`) and its peak RSS (ru_maxrss) and the
mean step time after a warm-up step. The theory column is the ZeRO paper's accounting (Rajbhandari et al., arXiv
1910.02054) for fp32 weights and AdamW: per parameter 4 B of weights, 4 B of gradients and 8 B of moments at stage 0;
from stage 1 the optimizer holds 12 B (moments plus DeepSpeed's fp32 master copy) divided over N ranks; stage 2 divides
the gradients, stage 3 the weights as well. Prints a table and writes JSON.

    python scripts/bench_memory.py --out docs/bench_memory.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

GIB = 2**30


# ------------------------------------------------------------------------------------ theory


def theory_bytes(n_params: int, stage: int, ranks: int) -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer state for fp32 weights and AdamW at a ZeRO stage."""
    optimizer = 8 * n_params if stage == 0 else 12 * n_params / ranks
    gradients = 4 * n_params if stage <= 1 else 4 * n_params / ranks
    parameters = 4 * n_params if stage <= 2 else 4 * n_params / ranks
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer}


# ------------------------------------------------------------------------------------ census


def storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the tensors' storages (views of one buffer count once)."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.nbytes():
                out[storage.data_ptr()] = storage.nbytes()
    return out


def live_storages(module: torch.nn.Module) -> dict[int, int]:
    """Every tensor storage the Python heap can reach, plus the module's gradients (which may exist only on
    the C++ side until Python asks for them)."""
    with warnings.catch_warnings():  # isinstance on some heap objects warns about deprecated attributes
        warnings.simplefilter("ignore")
        found = storages([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
    found.update(storages(p.grad for p in module.parameters()))
    return found


def parameter_storages(module: torch.nn.Module) -> dict[int, int]:
    return storages([t for p in module.parameters() for t in (p.data, getattr(p, "ds_tensor", None))])


def optimizer_storages(optimizer, exclude: dict[int, int]) -> dict[int, int]:
    """AdamW's state tensors and the parameters it steps, leaving out the module's own parameters (what it
    steps at stage 0). At stages 1-3 those are DeepSpeed's fp32 master partitions; ZeRO-3 puts them in the
    torch optimizer's param groups only for the duration of its step, so its flat partitions are read too."""
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizers wrap the torch one
    tensors = [q for group in inner.param_groups for q in group["params"]]
    tensors += [v for state in inner.state.values() for v in state.values()]
    tensors += getattr(optimizer, "fp32_partitioned_groups_flat", [])  # ZeRO-3's master partitions
    return {ptr: n for ptr, n in storages(tensors).items() if ptr not in exclude}


def resident_bytes() -> int:
    """This process's resident memory after handing freed heap pages back to the OS (glibc keeps them otherwise,
    so the resident size would still count buffers DeepSpeed freed after initialisation)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def take_census(engine, before_engine: set[int]) -> dict[str, int]:
    """Bytes of parameters, optimizer state, and gradients with engine buffers (new since `before_engine`)."""
    gc.collect()
    live = live_storages(engine.module)
    params = parameter_storages(engine.module)
    optimizer = optimizer_storages(engine.optimizer, exclude=params)
    rest = [n for ptr, n in live.items() if ptr not in params and ptr not in optimizer and ptr not in before_engine]
    return {"parameters": sum(params.values()), "optimizer": sum(optimizer.values()), "gradients": sum(rest),
            "rss": resident_bytes()}


# ------------------------------------------------------------------------------------ one rank


def worker(args) -> None:
    import dllm_rl  # noqa: F401  (registers the model with the Auto classes)
    from transformers import AutoModelForMaskedLM

    from dllm_rl.engine import Engine, deepspeed_config, init_distributed, partitioned_loading
    from dllm_rl.policy.modeling import DiffusionLMConfig
    from dllm_rl.precision import resolve_bf16

    world = init_distributed()
    bf16 = resolve_bf16(args.bf16)
    config = deepspeed_config(stage=args.stage, micro_batch_size=args.batch, world_size=world.size,
                              hidden_size=args.hidden)  # buckets sized as the trainer sizes them
    model_config = DiffusionLMConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.hidden // 64, max_position_embeddings=args.seq_len)
    torch.manual_seed(0)
    with partitioned_loading(config):
        model = AutoModelForMaskedLM.from_config(model_config)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    generator = torch.Generator().manual_seed(world.rank)
    ids_BL = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator)
    targets_BL = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator)

    gc.collect()
    before_engine = set(live_storages(model)) - set(parameter_storages(model))
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-5), world, config)
    times, census = [], {}
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits_BLV = engine.ds(input_ids=ids_BL).logits
        loss = F.cross_entropy(logits_BLV.float().flatten(0, 1), targets_BL.flatten())
        del logits_BLV
        engine.ds.backward(loss)
        census_s = 0.0
        if step == args.warmup + args.steps - 1:  # the optimizer state exists from the first step on
            census_start = time.perf_counter()
            census = take_census(engine, before_engine)
            census_s = time.perf_counter() - census_start
        engine.step()
        engine.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start - census_s)
    result = {"rank": world.rank, "ranks": world.size, "stage": args.stage, "n_params": n_params, "bf16": bf16,
              **census,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "step_s": sum(times) / len(times)}
    Path(args.result_dir, f"stage{args.stage}_rank{world.rank}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ driver


def run_stage(args, stage: int, result_dir: str) -> list[dict]:
    from dllm_rl.engine.dist import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"))
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                 ("vocab", "hidden", "layers", "seq_len", "batch", "warmup", "steps", "bf16")]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
               "--master_port", str(free_port()), __file__, "--worker", f"--stage={stage}",
               f"--result-dir={result_dir}", *forwarded]
    subprocess.run(command, env=env, check=True)
    return [json.loads(Path(result_dir, f"stage{stage}_rank{r}.json").read_text()) for r in range(args.ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bf16", default="auto", type=lambda v: {"true": True, "false": False}.get(v.lower(), v),
                        help="autocast forwards to bf16: auto (where the CPU has native bf16) | true | false")
    parser.add_argument("--out", default="bench_memory.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    rows = []
    with tempfile.TemporaryDirectory() as result_dir:
        for stage in args.stages:
            ranks = run_stage(args, stage, result_dir)
            n_params = ranks[0]["n_params"]
            theory = theory_bytes(n_params, stage, args.ranks)
            measured = {k: max(r[k] for r in ranks)
                        for k in ("parameters", "gradients", "optimizer", "rss", "peak_rss")}
            rows.append({"stage": stage, "ranks": args.ranks, "n_params": n_params,
                         **{f"{k}_bytes": v for k, v in measured.items()},
                         "model_state_bytes": sum(measured[k] for k in theory),
                         **{f"theory_{k}_bytes": v for k, v in theory.items()},
                         "theory_model_state_bytes": sum(theory.values()),
                         "step_s": max(r["step_s"] for r in ranks), "per_rank": ranks})
    base = rows[0]["model_state_bytes"]
    print(f"\n{rows[0]['n_params'] / 1e6:.1f}M parameters, {args.ranks} ranks; GiB per rank (max over ranks)")
    print(f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'state':>8} {'theory':>8} {'vs st.0':>8} "
          f"{'RSS':>6} {'peak RSS':>9} {'step s':>7}")
    for r in rows:
        print(f"{r['stage']:>5} {r['parameters_bytes'] / GIB:8.3f} {r['gradients_bytes'] / GIB:8.3f} "
              f"{r['optimizer_bytes'] / GIB:8.3f} {r['model_state_bytes'] / GIB:8.3f} "
              f"{r['theory_model_state_bytes'] / GIB:8.3f} {r['model_state_bytes'] / base:8.2f} "
              f"{r['rss_bytes'] / GIB:6.2f} {r['peak_rss_bytes'] / GIB:9.2f} {r['step_s']:7.2f}")
    meta = {"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "bf16_autocast": rows[0]["per_rank"][0]["bf16"],
            "threads_per_rank": args.threads, "vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
            "seq_len": args.seq_len, "batch_per_rank": args.batch, "steps": args.steps}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
