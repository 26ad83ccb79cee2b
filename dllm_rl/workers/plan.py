"""Capacity planning for rollout workers (ECHO-2's overlap rule): how many workers of which kinds keep the learner
at a target utilisation at the lowest price, from measured numbers.

The model, with this trainer's staleness convention (`workers.max_staleness=S`; S = 0 is the synchronous loop):
a step trains for T seconds on a batch of B rollouts; publishing a version of the weights to the workers takes D
seconds; the workers together generate X rollouts per second, so a batch takes G = B / X. A batch consumed by update
j may be generated from version j - S on (the admission rule, `dllm_rl/workers/admission.py`), and version j - S is
out D seconds after update j - S - 1 ends. So in steady state the learner's step period is

    P = max(T, G, (T + D + G) / (S + 1))

(the learner's own work; the workers' throughput; the chain publish -> generate -> train spread over the S + 1
steps it may span), and its utilisation is U = T / P. In the chain, G is one batch's makespan on the mix (`makespan`:
groups of `group_size` rollouts handed to whichever worker is free, so a slow worker's last group can hold a batch up),
which is B / X for equal workers and more for mixed ones. The learner never waits (U = 1) exactly when G <= T and
G <= S T - D: generation of a batch must finish within the S steps of slack minus the dissemination latency. (ECHO-2
writes (S + 1) steps, counting a one-step overlap as S = 0; here S = 0 is bit-identical to in-process training,
so the same condition reads S T - D.) The cheapest mix then covers the throughput that a target utilisation u
needs (at least B / G_max with G_max = min(T / u, (S + 1) T / u - T - D), for any mix) at the lowest price per hour:
an exact search over the worker counts (`cheapest_mix`). `simulate` plays the same pipeline event by event, group by
group, each worker at its own speed, taking work ahead across steps as the admission rule allows: the tests hold the
formula to it (equal workers that split the groups evenly: exactly; mixed speeds: within 0.15 utilisation, nine in
ten within 0.05) and the planner's mix to a brute-force search.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from dllm_rl.errors import ConfigError, output_file, require
from dllm_rl.workers.config import WorkersConfig

MAX_SEARCH = 2_000_000  # mixes the exact search may visit
KIND_KEYS = ("throughput", "price", "max_count", "pool")  # a kind's keys in configs/plan.yaml


@dataclass(frozen=True)
class WorkerKind:
    """One kind of rollout worker: rollouts per second one worker generates, its price per hour, the most
    workers of the kind there are."""

    name: str
    throughput: float
    price: float
    max_count: int = 64

    def __post_init__(self) -> None:
        for key, value, ok, expected in (("throughput", self.throughput, self.throughput > 0, "> 0 (rollouts/s)"),
                                         ("price", self.price, self.price >= 0, ">= 0 (per hour)"),
                                         ("max_count", self.max_count, self.max_count >= 1, ">= 1")):
            require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and ok,
                    f"kinds.{self.name}.{key}={value!r}: expected a finite number {expected}")


@dataclass(frozen=True)
class Pipeline:
    """The measured numbers: seconds per training step, seconds to publish a version, rollouts per step, the
    staleness bound S."""

    train_s: float
    publish_s: float
    batch: int
    staleness: int

    def __post_init__(self) -> None:
        require(_number(self.train_s) and self.train_s > 0, f"train_s={self.train_s!r}: expected seconds > 0")
        require(_number(self.publish_s) and self.publish_s >= 0, f"publish_s={self.publish_s!r}: expected seconds >= 0")
        require(isinstance(self.batch, int) and self.batch >= 1, f"batch={self.batch!r}: expected rollouts >= 1")
        require(isinstance(self.staleness, int) and self.staleness >= 0,
                f"max_staleness={self.staleness!r}: expected an integer >= 0 (0 = synchronous)")

    def period(self, speeds: list[float], group_size: int) -> float:
        """The learner's steady-state seconds per step with workers of these speeds (rollouts/s each) taking
        groups of `group_size` rollouts: the rate the workers sustain, B / X, and the chain, whose generation is
        one batch's makespan on idle workers (`makespan`: a slow worker's last group holds the batch up)."""
        throughput = sum(speeds)
        if throughput <= 0:
            return math.inf
        chain = self.train_s + self.publish_s + makespan(speeds, self.batch, group_size)
        return max(self.train_s, self.batch / throughput, chain / (self.staleness + 1))

    def utilisation(self, speeds: list[float], group_size: int) -> float:
        return self.train_s / self.period(speeds, group_size)

    def needed(self, target: float) -> float:
        """The least throughput (rollouts/s) that keeps the learner at `target` utilisation, or a ConfigError
        where no number of workers can (the publish-train chain alone is too long for S)."""
        require(_number(target) and 0 < target <= 1, f"target_utilisation={target!r}: expected a number in (0, 1]")
        T, D, S = self.train_s, self.publish_s, self.staleness
        longest = min(T / target, (S + 1) * T / target - T - D)  # the longest a batch may take to generate
        if longest <= 0:
            best = T / max(T, (T + D) / (S + 1))
            raise ConfigError(f"no feasible mix: with max_staleness={S}, train_s={T:g} and publish_s={D:g} the learner "
                              f"reaches at most {best:.3f} utilisation however fast the workers are (target "
                              f"{target:g}); raise max_staleness or lower target_utilisation")
        return self.batch / longest


@dataclass
class Plan:
    counts: dict[str, int]
    throughput: float
    price: float
    period: float
    utilisation: float
    needed: float
    kinds: list[WorkerKind] = field(repr=False, default_factory=list)
    simulated: float = math.nan  # the same mix's utilisation in `simulate`

    def pools(self, settings: dict[str, dict], staleness: int) -> dict[str, dict]:
        """The mix as `workers.pools` of `dllm-rl train`: each kind with workers, its count, throughput figure and
        price, and the worker settings its kind gives (`settings[name]`: threads, device, sampler...). With S = 0
        the throughput figures size each worker's share of a step, as the plan assumed."""
        WorkersConfig(pools={k.name: settings.get(k.name, {}) for k in self.kinds}, max_staleness=staleness)
        return {k.name: {"count": self.counts[k.name], "throughput": k.throughput, "price": k.price,
                         **settings.get(k.name, {})} for k in self.kinds if self.counts.get(k.name, 0)}

    def table(self, pipeline: Pipeline) -> str:
        rows = ["| kind | workers | rollouts/s each | price/h each | rollouts/s | price/h |",
                "|---|---|---|---|---|---|"]
        for kind in self.kinds:
            n = self.counts.get(kind.name, 0)
            rows.append(f"| {kind.name} | {n} | {kind.throughput:g} | {kind.price:g} | {n * kind.throughput:.3g} | "
                        f"{n * kind.price:.3g} |")
        generate = pipeline.batch / self.throughput
        rows.append(f"| total | {sum(self.counts.values())} | | | {self.throughput:.3g} | {self.price:.3g} |")
        rows += ["", f"needed: {self.needed:.3g} rollouts/s (a batch of {pipeline.batch} in <= "
                 f"{pipeline.batch / self.needed:.3g} s); this mix: a batch in {generate:.3g} s",
                 f"learner: {pipeline.train_s:g} s training per step, step period {self.period:.3g} s, utilisation "
                 f"{self.utilisation:.3f} (simulated: {self.simulated:.3f}); S = {pipeline.staleness}, publish "
                 f"{pipeline.publish_s:g} s",
                 f"price: {self.price:.3g} per hour, {self.price * self.period / 3600:.3g} per step"]
        return "\n".join(rows)


def speeds_of(kinds: list[WorkerKind], counts: dict[str, int]) -> list[float]:
    return [k.throughput for k in kinds for _ in range(counts.get(k.name, 0))]


def cheapest_mix(pipeline: Pipeline, kinds: list[WorkerKind], target: float, group_size: int) -> dict[str, int] | None:
    """The worker counts (each within its kind's max_count) that keep the learner at `target` utilisation
    (`Pipeline.utilisation`) at the lowest price per hour (ties: higher utilisation, then fewer workers); None
    where no mix does. Exact: every mix is visited, except those the fluid bound (throughput below
    `Pipeline.needed`, which no mix below it can reach) or the price of the best so far rules out."""
    require(bool(kinds), "kinds: expected at least one worker kind")
    needed = pipeline.needed(target)
    visits = math.prod(k.max_count + 1 for k in kinds)
    require(visits <= MAX_SEARCH, f"kinds: {visits} mixes to search; lower the kinds' max_count or merge kinds")
    best, best_key = None, None
    for mix in itertools.product(*(range(k.max_count + 1) for k in kinds)):
        price = sum(n * k.price for n, k in zip(mix, kinds))
        if sum(n * k.throughput for n, k in zip(mix, kinds)) < needed * (1 - 1e-12):
            continue
        if best_key is not None and round(price, 9) > best_key[0]:
            continue
        counts = {k.name: n for k, n in zip(kinds, mix)}
        utilisation = pipeline.utilisation(speeds_of(kinds, counts), group_size)
        if utilisation < target - 1e-12:
            continue
        key = (round(price, 9), -utilisation, sum(mix))
        if best_key is None or key < best_key:
            best, best_key = counts, key
    return best


def plan(pipeline: Pipeline, kinds: list[WorkerKind], target: float, group_size: int) -> Plan:
    """The cheapest mix of `kinds` that keeps the learner at `target` utilisation (a ConfigError where none can)."""
    require(len({k.name for k in kinds}) == len(kinds), f"kinds: names must differ, got {[k.name for k in kinds]}")
    require(isinstance(group_size, int) and group_size >= 1 and pipeline.batch % group_size == 0,
            f"group_size={group_size!r}: expected a divisor of batch={pipeline.batch}")
    counts = cheapest_mix(pipeline, kinds, target, group_size)
    if counts is None:
        most = {k.name: k.max_count for k in kinds}
        best = pipeline.utilisation(speeds_of(kinds, most), group_size)
        raise ConfigError(f"no feasible mix: every worker of every kind together keeps the learner at {best:.3f} "
                          f"utilisation, below target_utilisation={target:g}; raise a kind's max_count, add a faster "
                          f"kind or lower the target")
    speeds = speeds_of(kinds, counts)
    return Plan(counts, sum(speeds), sum(counts[k.name] * k.price for k in kinds), pipeline.period(speeds, group_size),
                pipeline.utilisation(speeds, group_size), pipeline.needed(target), list(kinds),
                simulate(pipeline, speeds, group_size))


def simulate(pipeline: Pipeline, speeds: list[float], group_size: int, steps: int = 60,
             warmup: int = 10) -> float:
    """The learner's utilisation in an event-by-event run of the pipeline: the next group (`group_size` rollouts)
    goes, at the first moment a worker is free and the admission rule lets it start (a group of step j needs
    version >= j - S, out `publish_s` after update j - S - 1 ends), to the fastest worker free then; update j starts
    when all its groups are in and update j - 1 is done. Measured over steps warmup..steps."""
    require(pipeline.batch % group_size == 0, f"batch={pipeline.batch} must be a multiple of group_size={group_size}")
    groups = pipeline.batch // group_size
    T, D, S = pipeline.train_s, pipeline.publish_s, pipeline.staleness
    published = {0: 0.0}  # version -> when the workers have it
    done_at: dict[int, list[float]] = {}  # step -> when each of its groups finished
    free = [0.0] * len(speeds)  # when each worker is free
    update_end: list[float] = []
    next_group = 0  # global index of the next group to hand out
    for step in range(steps):
        # versions up to `step` are out (their times known): every group of steps up to step + S may be handed
        # out, in order, each to the worker free first (it starts once that worker is free and its version is out)
        while next_group // groups <= step + S:
            j = next_group // groups
            ready = published[max(0, j - S)]
            start = max(ready, min(free))  # the first moment a worker is free and the version is out
            worker = max((w for w in range(len(speeds)) if free[w] <= start), key=lambda w: (speeds[w], -w))
            free[worker] = start + group_size / speeds[worker]
            done_at.setdefault(j, []).append(free[worker])
            next_group += 1
        begin = max(max(done_at[step]), update_end[-1] if update_end else 0.0)
        update_end.append(begin + T)
        published[step + 1] = update_end[-1] + D
    span = update_end[steps - 1] - update_end[warmup - 1]
    return (steps - warmup) * T / span


def makespan(speeds: list[float], batch: int, group_size: int) -> float:
    """Seconds until a batch's groups are all generated by workers of these speeds, idle at 0, each group going to
    the fastest worker free at the first moment one is (as `simulate` hands them out)."""
    require(batch % group_size == 0, f"batch={batch} must be a multiple of group_size={group_size}")
    free = [(0.0, -speed, w) for w, speed in enumerate(speeds)]
    heapq.heapify(free)
    end = 0.0
    for _ in range(batch // group_size):
        when, negative, w = heapq.heappop(free)
        finish = when + group_size / -negative
        end = max(end, finish)
        heapq.heappush(free, (finish, negative, w))
    return end


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def run(cfg: dict, print_fn=print) -> Plan:
    """`dllm-rl plan`: configs/plan.yaml's keys in, the plan printed (and written as JSON where `json` is set)."""
    import json

    out = output_file(cfg["json"], "json") if cfg.get("json") else None  # before any work
    if cfg.get("measure"):
        from dllm_rl.workers.measure import measure

        got = measure(int(cfg["measure_steps"]), list(cfg.get("measure_overrides") or []), print_fn)
        print_fn(f"measured: train_s={got['train_s']:.3g} publish_s={got['publish_s']:.3g} batch={got['batch']} "
                 f"group_size={got['group_size']} here: {got['throughput']:.3g} rollouts/s per worker")
        kinds = dict(cfg.get("kinds") or {})
        kinds["here"] = {"throughput": got["throughput"], "price": cfg["measure_price"],
                         **kinds.get("here", {"max_count": 16})}
        cfg = {**cfg, **{k: got[k] for k in ("train_s", "publish_s", "batch", "group_size")}, "kinds": kinds}
    require(cfg.get("train_s") is not None, "train_s=null: give the learner's seconds per step, or measure=true")
    pipeline = Pipeline(cfg["train_s"], cfg["publish_s"], cfg["batch"], cfg["max_staleness"])
    kinds = cfg.get("kinds") or {}
    require(isinstance(kinds, dict) and kinds, "kinds: expected at least one worker kind, e.g. "
            "kinds='{cpu: {throughput: 1.5, price: 0.1, max_count: 32}}' (or measure=true for this machine's)")
    parsed = []
    for name, spec in kinds.items():
        require(isinstance(spec, dict) and {"throughput", "price"} <= set(spec) <= set(KIND_KEYS),
                f"kinds.{name}={spec!r}: expected {{throughput: rollouts/s, price: per hour, max_count: workers, "
                f"pool: the workers' settings in workers.pools}}")
        parsed.append(WorkerKind(str(name), spec["throughput"], spec["price"], spec.get("max_count", 64)))
    result = plan(pipeline, parsed, cfg["target_utilisation"], cfg["group_size"])
    pools = result.pools({name: spec.get("pool") or {} for name, spec in kinds.items()}, cfg["max_staleness"])
    print_fn(result.table(pipeline))
    # (sampler_correction.mode=auto, the default, turns the correction on for max_staleness > 0)
    print_fn(f"\napply it: dllm-rl train workers.pools='{flow(pools)}' workers.max_staleness={cfg['max_staleness']}")
    if out is not None:
        out.write_text(json.dumps({"inputs": {k: cfg[k] for k in ("train_s", "publish_s", "batch",
                                                                                 "group_size", "max_staleness",
                                                                                 "target_utilisation", "kinds")},
                                                 "counts": result.counts, "throughput": result.throughput,
                                                 "price_per_hour": result.price, "period_s": result.period,
                                                 "utilisation": result.utilisation, "simulated": result.simulated,
                                                 "pools": pools}, indent=1) + "\n")
    return result


def flow(value) -> str:
    """`value` (dicts, strings, numbers, booleans, None) in the flow style of Hydra's override grammar."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return f"{value:g}" if isinstance(value, float) else str(value)
