"""End to end: the same model, batch, bucket size and seed under torch DDP (and
FSDP2 where asked) and every dearcomm schedule (wfbp, dear sharded and
replicated, bytescheduler, usbyte, deft; also wrap()'s "auto" and DeAR's own
Bayesian-optimisation tuner, dear-bo), each optionally with partitioned tensors and (bytescheduler) a credit, with
the measured pieces, the lower bound and each schedule's own ideal.

    torchrun --nproc_per_node=2 benchmarks/train_bench.py --model mlp            # loopback
    sudo python benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/train_bench.py --model mlp
    ... train_bench.py --model mlp --partition-mb 4 --credit-mb 1 4 64 --timeline t   # every variant

Runs are named SCHEDULE[/pP][/cC]: P = partition_mb, C = credit_mb (bytescheduler
only); no /p = the schedule's default (bytescheduler 32 MiB, others never split),
ddp/bB = torch DDP with bucket_cap_mb=B (a control: as many collectives as /pB),
no /c = the default credit (64 MiB). A trailing /sync (dear, bytescheduler) is a
control too: sync() after every step(), so the run's communication finishes
before the next forward instead of overlapping it, everything else unchanged. A
trailing /again (any run: 'ddp/again') times the same configuration a second time,
built and interleaved as a run of its own: the two medians' difference is what
this machine's noise alone moves a run by in the same row (prediction_summary.py
prints it). --partition-mb P adds a /pP variant of every
dearcomm schedule; --credit-mb C... replaces bytescheduler/pP by one row per credit.
fsdp2 (only when named: --runs ... fsdp2, or --schedules ... fsdp2) is torch's
fully_shard with reshard_after_forward=False (ZeRO-2-like) on a 1-D CPU mesh over
the gloo group: one unit per block (FSDP2_UNITS) and the root, the optimizer built
on the sharded parameters; it takes no modifiers. Where this torch has no
fully_shard its row reads "skipped: <reason>".

Pieces, measured in the same run: T_fwd, T_bwd, T_step (the profile's below: the
ranks' model in step, no communication; T_step(shard) runs the optimizer over 1/p
of the parameters) and the collectives of all buckets launched back to back,
alone: T_RS, T_AG, T_AR, and T_AR(ordered), the all-reduce the CPU backend keeps in
issue order for deft (its own exchanges, pipelined, in place of gloo's allreduce);
the profile, the contention factors and the collectives are timed once a round,
between the runs, and their medians over the rounds kept.
  lower bound (any schedule)   max(T_fwd + T_bwd + T_step, T_AR)
  ideal of a run               the run's schedule and options on dearcomm's simulated device
                               (dearcomm.simulate: the executor and policy that train, on a
                               virtual clock), fed these pieces: T_fwd, T_bwd and T_step split
                               over the modules in proportion to their parameters, and each
                               collective kind costing what all of the run's own buckets cost
                               back to back (alpha 0, beta = T_RS, T_AG, T_AR, T_AR(ordered)
                               over their bytes)
T_RS/T_AG/T_AR are measured on each run's own bucket layout (partitioning changes
it); T_AR(m0) is the all-reduce, alone, of every bucket holding part of the input-side
module's parameters (benchmarks/README.md derives what bytescheduler's ideal then is; the
simulated device gives it, and any schedule's, without a formula per schedule).
  predicted                    the same simulation fed what a user's prediction is fed: the ranks'
                               dearcomm.profile(group=) (per-module forward and backward, gradient-ready
                               order, the step; the ranks in step, each iteration the slowest rank's;
                               taken once a round, between the runs' turns, and
                               the rounds' medians kept, as the runs' are), compute slowed by the factor measured beside an
                               all-reduce and the collectives by the factor measured beside compute
                               (benchmarks/contention.py; also once a round, the medians kept,
                               rank 0's on every rank, as auto plans); error =
                               predicted / measured - 1
efficiency = ideal / measured (1.0: the schedule hides all it can); speedup = DDP's
median / the run's (> 1: faster than DDP).
Phases: each run's median forward+loss, backward and zero_grad+step wall time.
CPU: this process's CPU time (all threads, gloo's included) per iteration, and the
machine's softirq time (kernel packet work, charged to no process) per iteration.
Faults: this process's minor page faults per iteration (thousands), most of them
the allocator handing freed memory back to the kernel and touching it again.
Each rank gets cores/ranks torch threads. A run's time ("median ms") is the median
over the rounds of each round's mean iteration, averaged over the ranks (pace(); the
slowest rank's reading of the same is kept in the JSON as slowest_rank_ms, its single
iterations' median as iteration_median_ms); p10/p90 are of single iterations. Other
times are medians; the slowest rank counts.
Losses: every run's two warm-up losses against ddp's (same model, seed and batch
on every rank), the largest difference over the steps and ranks: 0 at 2 ranks for
a run that trains like DDP; at more ranks float32 summation order may differ.
"""
import argparse
import contextlib
import dataclasses
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import all_ranks, slowest, write_json  # noqa: E402
from contention import measure as measure_contention  # noqa: E402
from bo_tuner import TRIALS, live_measure, tune_bucket_mb  # noqa: E402
from models import MODELS, fresh  # noqa: E402

import dearcomm  # noqa: E402
from dearcomm import _C  # noqa: E402
from dearcomm._options import PLANNED_SCHEDULES  # noqa: E402
from dearcomm.contention import FACTORS as CONTENTION_FACTORS, machine_cpu_s, with_contention  # noqa: E402
from dearcomm._rank0 import rank0s  # noqa: E402
from dearcomm.host_cost import cores_share, fit_host_cpu  # noqa: E402
from dearcomm.network_fit import ring_coefficients  # noqa: E402
from dearcomm.network_probe import GLOO_DEFAULT_THREADS  # noqa: E402
from dearcomm.prediction import ORDERED_ALL_REDUCE  # noqa: E402
from dearcomm.timeline import Timeline, gather_events, plot_gantt, write_chrome_trace  # noqa: E402

SCHEDULES = {"ddp": ("ddp", None), "wfbp": ("wfbp", "replicated"),
             "dear-sharded": ("dear", "sharded"), "dear-replicated": ("dear", "replicated"),
             "bytescheduler": ("bytescheduler", "replicated"),
             # US-Byte: blocks and order planned at the first forward (profile, probe). No modifiers.
             "usbyte": ("usbyte", "replicated"),
             # DeFT: delays (max_delay 1) planned at the first forward. It changes what
             # training computes: benchmarks/deft_convergence.py measures the cost in steps.
             "deft": ("deft", "replicated"),
             # A control, not a schedule: DDP plus the bytes dear all-gathers, sent
             # with torch.distributed beside DDP's forward and waited at its end.
             # What moving them during the forward costs on this machine, without
             # any of dearcomm's scheduling (no per-module waits, no updates).
             "ddp+gather": ("ddp", "gather"),
             # torch's FSDP2 (fully_shard, reshard_after_forward=False): the
             # same collectives as dear-sharded (all-gather before each unit's
             # forward, reduce-scatter in backward, the step on a shard), issued
             # by torch. Named only on request (not in --schedules' default).
             "fsdp2": ("fsdp2", None),
             # wrap()'s "auto": schedule, bucket_mb, partition_mb and credit_mb
             # chosen at the first forward (probe, profile, simulation); its
             # choice is printed. Takes no modifiers.
             "auto": ("auto", None),
             # DeAR's own tuner as a baseline for auto: dear sharded, its bucket
             # size found by Bayesian optimisation on the running job before it
             # is timed (benchmarks/bo_tuner.py). Takes no modifiers.
             "dear-bo": ("dear", "sharded")}
NOT_BY_DEFAULT = ("ddp+gather", "fsdp2")

# FSDP2's units: each gets its own fully_shard (one all-gather and one
# reduce-scatter each), the root takes the rest (torch's recommendation:
# per block, then the root). Keyed by --model.
FSDP2_UNITS = {
    "mlp": lambda m: list(m.layers),
    "widein": lambda m: [m.first, *m.layers],
    "resnet": lambda m: list(m.stages),
    "gpt": lambda m: list(m.blocks.layers),
}


def configuration(spec) -> str:
    """'dear-sharded/p4/again@DEARCOMM_X=1' -> 'dear-sharded/p4': the run's
    schedule and options, without its repeat mark and environment."""
    return spec.split("@")[0].removesuffix("/again")


def syncs_after_step(spec) -> bool:
    """'bytescheduler/p0.25/sync': the /sync control (sync() after every step())."""
    return configuration(spec).endswith("/sync")


def parse_run(spec):
    """'dear-sharded/p4' -> (schedule, update, partition_mb, credit_mb); an
    '@VAR=VALUE' suffix (run_environment) and a /again mark are ignored here. For ddp the third
    item is its own bucket_cap_mb ('ddp/b0.25'), None for --bucket-mb."""
    base, *mods = configuration(spec).split("/")
    if base not in SCHEDULES:
        raise SystemExit(f"unknown run {spec!r}: base must be one of {list(SCHEDULES)}")
    schedule, update = SCHEDULES[base]
    if (schedule in ("fsdp2", "auto") or base == "dear-bo") and mods:
        raise SystemExit(f"unknown modifiers {mods} in {spec!r}: {base} takes none")
    if syncs_after_step(spec):
        mods.pop()
        if schedule not in ("dear", "bytescheduler"):
            raise SystemExit(f"/sync in {spec!r}: only dear and bytescheduler leave communication in flight past step()")
    partition = credit = None
    for m in mods:
        if m[:1] == "p" and schedule != "ddp":
            partition = float(m[1:])
        elif m[:1] == "b" and base == "ddp":  # a control: DDP with buckets as small as a partition
            partition = float(m[1:])
        elif m[:1] == "c" and schedule == "bytescheduler":
            credit = float(m[1:])
        else:
            hint = " (ddp takes only /bB, its bucket_cap_mb)" if base == "ddp" else ""
            raise SystemExit(f"unknown modifier {m!r} in {spec!r}{hint}")
    return schedule, update, partition, credit


def run_environment(spec):
    """'dear-sharded/p0.25@DEARCOMM_CPU_POSTER=0' -> {'DEARCOMM_CPU_POSTER': '0'}:
    set while the run's engine is built (its first backward), so one process
    can A/B dearcomm's switches (DEARCOMM_GRAD_VIEWS, DEARCOMM_CPU_POSTER) run
    against run, alternated, on the same machine state."""
    env = {}
    for item in spec.split("@")[1:]:
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("DEARCOMM_"):
            raise SystemExit(f"unknown suffix {item!r} in {spec!r}: expected @DEARCOMM_VAR=VALUE")
        env[var] = value
    return env


@contextlib.contextmanager
def environment(env):
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def run_names(args):
    if args.runs:
        return args.runs
    names = []
    for base in args.schedules:
        names.append(base)
        # usbyte, deft: a planner sets their pieces (wrap() refuses partition_mb for them).
        if SCHEDULES[base][0] in ("ddp", "fsdp2", "auto", *PLANNED_SCHEDULES) or base == "dear-bo":
            continue
        for p in args.partition_mb:
            if base == "bytescheduler" and args.credit_mb:
                names += [f"{base}/p{p:g}/c{c:g}" for c in args.credit_mb]
            else:
                names.append(f"{base}/p{p:g}")
        if base == "bytescheduler" and args.credit_mb and not args.partition_mb:
            names += [f"{base}/c{c:g}" for c in args.credit_mb]
    return names


def machine_ms() -> dict:
    """The whole machine's busy, softirq and idle ms so far, from /proc/stat."""
    machine = machine_cpu_s()
    if machine is None:
        raise RuntimeError("train_bench.py reads the machine's CPU from /proc/stat (Linux)")
    return {k: v * 1e3 for k, v in machine.items()}


def allocator_policy() -> str:
    """How this process's host allocator was set up: the environment that
    changes it (a preloaded allocator, glibc's tunables) or 'glibc defaults'."""
    env = [f"{k}={v}" for k, v in sorted(os.environ.items())
           if k.startswith(("MALLOC_", "GLIBC_TUNABLES")) or (k == "LD_PRELOAD" and "alloc" in v)]
    return " ".join(env) or "glibc defaults"


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def median_time(fn, iters, cpu=None):
    """Median wall seconds of fn(); with cpu (a list), appends the median
    process CPU seconds per call to it."""
    times, cpus = [], []
    for _ in range(iters):
        c0, start = time.process_time(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        cpus.append(time.process_time() - c0)
    if cpu is not None:
        cpu.append(statistics.median(cpus))
    return statistics.median(times)


def make(args):
    overrides = {key: int(value) for key, value in (kv.split("=", 1) for kv in args.model_args)}
    return fresh(args.model, **overrides)


def measure_pieces(args, x, y):
    """The compute pieces the profile does not give, on one rank's model and
    batch, without communication: the optimizer step over a 1/world shard
    and the CPU time of a whole iteration."""
    model = make(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    world = dist.get_world_size()
    shard = [torch.zeros(max(1, p.numel() // world)).requires_grad_() for p in params]
    shard_opt = torch.optim.AdamW(shard, lr=1e-4)
    for s in shard:
        s.grad = torch.randn_like(s)

    def whole():
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(2):
        whole()
        shard_opt.step()
    t_step_shard = median_time(shard_opt.step, args.iters)
    cpu = []
    median_time(whole, args.iters, cpu)
    return dict(step_shard=slowest(t_step_shard), cpu_iter=slowest(cpu[0]))


def plan_layout(args, model):
    """The layout of an unpartitioned dearcomm run (parameters in registration order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return _C.plan_buckets([p.numel() for p in params], [p.dtype for p in params],
                           int(args.bucket_mb * 2**20), dist.get_world_size())


def first_module_buckets(layout, model):
    """How many buckets (from bucket 0) hold part of the first module's
    parameters: the first module in registration order (= forward order for
    benchmarks/models.py) that has trainable parameters of its own. For gpt
    that is the root's position table alone: the 8 MiB token embedding the
    forward needs next is not counted, so its bytescheduler ideal is optimistic."""
    owner = next(m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False)))
    count = sum(p.requires_grad for p in owner.parameters(recurse=False))
    return 1 + max(layout.params[i].last_bucket for i in range(count))


def measure_collectives(args, layout, model, reps):
    """All buckets' RS, AG and AR (gloo's allreduce, and the ordered one
    deft's backend runs), each kind launched back to back and waited, alone;
    the all-reduce of the first module's buckets (m0) alone; process CPU
    during each: the medians of ``reps`` timings."""
    backend = _C.process_group_backend(dist.group.WORLD)
    ordered = _C.process_group_backend(dist.group.WORLD)
    _C.keep_issue_order(ordered)
    full = [torch.zeros(b.padded_numel) for b in layout.buckets]
    shards = [torch.zeros(b.shard_numel) for b in layout.buckets]
    m0 = first_module_buckets(layout, model)

    def run(kind):
        if kind == "rs":
            pending = [_C.reduce_scatter(backend, f, s) for f, s in zip(reversed(full), reversed(shards))]
        elif kind == "ag":
            pending = [_C.all_gather(backend, s, f) for f, s in zip(full, shards)]
        elif kind == "ar_m0":
            pending = [_C.all_reduce(backend, f) for f in full[:m0]]
        elif kind == "ar_ordered":
            pending = [_C.all_reduce(ordered, f) for f in reversed(full)]
        else:
            pending = [_C.all_reduce(backend, f) for f in reversed(full)]
        for h in pending:
            h.wait()

    out = {}
    for kind in COMM_KEYS:
        run(kind)
        dist.barrier()
        cpu = []
        out[kind] = slowest(median_time(lambda: run(kind), reps, cpu))
        out[f"cpu_{kind}"] = slowest(cpu[0])
    out["buckets"] = len(layout.buckets)
    out["bytes"] = sum(b.numel for b in layout.buckets) * 4
    out["m0_buckets"] = m0
    out["m0_bytes"] = sum(b.numel for b in layout.buckets[:m0]) * 4
    return out


def is_timing(key):
    """Whether a key of measure_collectives()'s dict is a time (a wall or a
    CPU time, in seconds), not a count (buckets, bytes)."""
    return key in COMM_KEYS or key.startswith("cpu_")


def median_of_rounds(rounds):
    """One layout's measure_collectives() over the rounds: each timing's
    median, the counts (buckets, bytes) as they are."""
    return {k: statistics.median(r[k] for r in rounds) if is_timing(k) else rounds[0][k] for k in rounds[0]}


def in_ms(comm, names, comm_of):
    """Per layout (keyed by the runs on it, comma-joined) its measure_collectives()
    dict with the times in ms: what the JSON stores."""
    return {",".join(n for n in names if comm_of[n] == key): {k: 1e3 * v if is_timing(k) else v for k, v in c.items()}
            for key, c in comm.items()}


def proportional_profile(model, pieces):
    """T_fwd and T_bwd split over the modules in proportion to their parameters
    (what the ideal assumes: no per-module measurement)."""
    owners = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    numels = [[p.numel() for p in m.parameters(recurse=False) if p.requires_grad] for m in owners]
    total = sum(map(sum, numels))
    return [dearcomm.ModuleProfile(f"m{i}", 1e3 * pieces["fwd"] * sum(n) / total,
                                   1e3 * pieces["bwd"] * sum(n) / total, n) for i, n in enumerate(numels)]


def simulated(*a, **k):
    """simulation()'s iteration, in seconds."""
    return simulation(*a, **k).iteration_ms / 1e3


KIND_KEYS = (("reduce_scatter", "rs"), ("all_gather", "ag"), ("all_reduce", "ar"),
             (ORDERED_ALL_REDUCE, "ar_ordered"))
"""Each collective kind (Network's) and its key in measure_collectives' dicts."""
COMM_KEYS = ("rs", "ag", "ar", "ar_m0", "ar_ordered")
"""measure_collectives' timings (files written before ar_ordered was timed lack it)."""


def kinds_in(layout):
    """KIND_KEYS that a layout's dict holds (ar_ordered: new files only)."""
    return [(kind, key) for kind, key in KIND_KEYS if key in layout]


def host_cpu_of(layouts, share):
    """(Network.host_ms, Network.host_ms_per_mib) from the row's layouts
    (measure_collectives' dicts, times in seconds): the CPU each kind's
    collectives took alone against how many there were and their bytes
    (dearcomm.host_cost.fit_host_cpu), times ``share`` (cores_share: the
    ranks on this machine over its cores)."""
    return fit_host_cpu({kind: [(c["buckets"], c["bytes"], 1e3 * c[f"cpu_{key}"]) for c in layouts]
                         for kind, key in kinds_in(layouts[0])},
                        share)


def simulation(name, args, profile, step_ms, comm, world, contention=None, chosen=None, planned=None, names=None,
               host_ms=None, host_ms_per_mib=None, cores_share=0.0):
    """The run on the simulated device (a dearcomm.Prediction): its schedule and
    options, `profile`'s compute, each collective kind costing what the run's
    own buckets cost back to back, alone (see the module's docstring). ddp runs
    as wfbp, its schedule, with its bucket size; fsdp2 as dear sharded (the
    same collectives at the same points, overlapped: what FSDP2 reaches where
    its collectives run beside compute, which they do not on CPU), with
    buckets of --bucket-mb standing in for its units. auto and dear-bo: with
    the options they chose (``chosen``); usbyte and deft with what they
    planned (``planned``: blocks, priorities and delays by parameter name,
    and the bucket_mb the plan set; ``names``: the profile's); ``host_ms``
    and ``host_ms_per_mib``: each collective's CPU, per call and per MiB
    (host_cpu_of); ``contention``: the measured factors, every one of
    dearcomm.contention.FACTORS (κ, λ, ν, μ, the compute's cv; None: a
    machine where nothing contends); ``cores_share``: the ranks over the
    cores they fill (dearcomm.host_cost.cores_share)."""
    schedule, update, partition, credit = parse_run(name)
    bucket_mb = args.bucket_mb
    if chosen is not None:
        schedule, update, bucket_mb, partition, credit = (chosen[k] for k in (
            "schedule", "update", "bucket_mb", "partition_mb", "credit_mb"))
    elif schedule == "ddp":
        schedule, update, bucket_mb, partition = "wfbp", "replicated", partition or args.bucket_mb, None
    elif schedule == "fsdp2":
        schedule, update = "dear", "sharded"
    per_kind = {}
    for kind, key in kinds_in(comm):
        _, bytes_term = ring_coefficients(kind, world, comm["bytes"])  # the simulator's ring formula, α = 0
        seconds_per_byte = comm[key] / bytes_term
        per_kind[kind] = (0.0, 8 / (seconds_per_byte * 1e9) if seconds_per_byte > 0 else float("inf"))
    # gloo's two worker threads run two posted all-reduces at once, unless the
    # run made the CPU backend order them (deft asks for it itself), and then
    # they are the ordered ones; DEARCOMM_CPU_ORDERED=0 leaves deft's to gloo.
    lanes = 1 if "DEARCOMM_CPU_ORDERED=1" in name else GLOO_DEFAULT_THREADS
    host_ms, host_ms_per_mib = dict(host_ms or {}), dict(host_ms_per_mib or {})
    ordered, plain = "DEARCOMM_CPU_ORDERED=1" in name, "DEARCOMM_CPU_ORDERED=0" in name
    for costs in (per_kind, host_ms, host_ms_per_mib):  # the all-reduce the run's backend ran, in every figure
        if ORDERED_ALL_REDUCE in costs and "all_reduce" in costs:
            if ordered:
                costs["all_reduce"] = costs[ORDERED_ALL_REDUCE]
            elif plain:
                costs[ORDERED_ALL_REDUCE] = costs["all_reduce"]
    network = dearcomm.Network(alpha_us=0.0, gbit_s=1.0, per_kind=per_kind, all_reduce_lanes=lanes, host_ms=host_ms,
                               host_ms_per_mib=host_ms_per_mib, cores_share=cores_share)
    if contention is not None:
        network = with_contention(network, contention)
    extra = {}
    if planned is not None and schedule in PLANNED_SCHEDULES:
        bucket_mb = planned.get("bucket_mb", bucket_mb)
    if planned is not None and schedule == "usbyte":
        extra = dict(blocks=[list(planned["blocks"].get(n, ())) for n in names],
                     priorities=[planned["priorities"].get(n) for n in names])
    if planned is not None and schedule == "deft":
        extra = dict(delays=[planned["delays"].get(n, 0) for n in names], iterations=4)
    return dearcomm.simulate(profile, schedule=schedule, update=update, world_size=world, network=network,
                             step_ms=step_ms, bucket_mb=bucket_mb, partition_mb=partition, credit_mb=credit, **extra)


def layout_key(layout):
    return tuple(b.padded_numel for b in layout.buckets)


def fsdp2_unavailable():
    """Why the fsdp2 run cannot be built in this torch, or None."""
    try:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no FSDP2 ({e})"
    return None


def build_fsdp2(args, model):
    """fully_shard on every unit of FSDP2_UNITS, then the root, over a 1-D CPU
    mesh of the default (gloo) group. reshard_after_forward=False: a unit's
    parameters stay gathered from its forward to its backward (no all-gather in
    backward); they are resharded after backward, so every forward all-gathers.
    fully_shard shards the parameters in place (their values kept: the run
    starts from the same model as the others); the optimizer is built after, on
    the sharded DTensors. On CPU FSDP2's collectives block the training thread
    (its overlap comes from CUDA streams)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in FSDP2_UNITS[args.model](model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def build(name, args):
    schedule, update, partition, credit = parse_run(name)
    model = make(args)
    if schedule == "fsdp2":
        return build_fsdp2(args, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if schedule == "auto":
        return dearcomm.wrap(model, optimizer, schedule="auto", bucket_mb="auto", partition_mb="auto",
                             credit_mb="auto")
    if schedule == "ddp":
        ddp = DistributedDataParallel(model, bucket_cap_mb=partition or args.bucket_mb)
        if update == "gather":
            gather_beside_forward(ddp, plan_layout(args, model))
        return ddp, optimizer
    wrapped, optimizer = dearcomm.wrap(model, optimizer, bucket_mb=args.bucket_mb, schedule=schedule, update=update,
                                       partition_mb=partition, credit_mb=credit)
    if syncs_after_step(name):
        step = optimizer.step

        def step_then_sync(*a, **kw):
            result = step(*a, **kw)
            wrapped.sync()
            return result
        optimizer.step = step_then_sync
    return wrapped, optimizer


def gather_beside_forward(ddp, layout):
    """ddp+gather: at each forward's start, all-gathers of dear's buckets
    (unpartitioned layout) go out asynchronously; the forward's end waits for them.
    The hooks are on the inner module: DDP's own buffer broadcast (BatchNorm
    statistics) runs before them, so it never queues behind the all-gathers."""
    world = dist.get_world_size()
    buffers = [(torch.zeros(b.shard_numel), [torch.zeros(b.shard_numel) for _ in range(world)])
               for b in layout.buckets]
    pending = []

    def start(module, inputs):
        pending.extend(dist.all_gather(out, shard, async_op=True) for shard, out in buffers)

    def finish(module, inputs, output):
        while pending:
            pending.pop(0).wait()

    ddp.module.register_forward_pre_hook(start)
    ddp.module.register_forward_hook(finish)


def finish_auto_trials(model, optimizer, x, y, limit=300):
    """auto: the iterations that measure its shortlist, before the run is
    timed (they train, as in a user's job); returns their wall time (s)."""
    start = time.perf_counter()
    for _ in range(limit):
        if model.auto_plan().decided:
            break
        iteration(model, optimizer, x, y)
    if not model.auto_plan().decided:
        raise RuntimeError(f"auto still measuring its shortlist after {limit} iterations: {model.auto_plan()}")
    iteration(model, optimizer, x, y)  # the chosen options' buckets built
    settle(model)
    return time.perf_counter() - start


def bo_tune(model, optimizer, x, y, iters, trials=TRIALS):
    """dear-bo: DeAR's tuner picks the bucket size on this run (bo_tuner.py);
    the run then trains with it, its buckets rebuilt, nothing in flight."""
    tuned = tune_bucket_mb(live_measure(model, lambda: iteration(model, optimizer, x, y), iters), trials=trials)
    runtime = model._dear
    runtime.reconfigure(dataclasses.replace(runtime.options, bucket_mb=tuned.bucket_mb))
    iteration(model, optimizer, x, y)
    settle(model)
    return tuned


def settle(model):
    """Finishes what a run left in flight (dear's all-gathers, bytescheduler's
    all-reduces), untimed, so that it does not run into the next run's time."""
    if hasattr(model, "sync"):
        model.sync()


def warm_up(runs, x, y):
    """Two untimed iterations of every run, each under its run's environment
    (read when the first backward builds the engine), nothing left in flight.
    Returns each run's two losses (this rank's): the first from the initial
    model, the second after one step."""
    losses = {}
    for name, (model, optimizer) in runs.items():
        with environment(run_environment(name)):
            losses[name] = [iteration(model, optimizer, x, y).item() for _ in range(2)]
        settle(model)
    return losses


def loss_differences(losses, reference="ddp"):
    """{run: max |loss - reference's loss|} over the warm-up steps and the
    ranks (every rank must call it); {} without the reference run."""
    if reference not in losses:
        return {}
    diffs = torch.tensor([max(abs(a - b) for a, b in zip(losses[name], losses[reference])) for name in losses],
                         dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return dict(zip(losses, diffs.tolist()))


def interleaved(runs, rounds, iters, x, y, each_round=None):
    """Yields (name, model, optimizer) before each of a run's timed iterations,
    which the caller runs: the runs take turns, `iters` each per round. A run's
    turn starts after what the previous one left in flight is finished, on
    every rank at once, and after one untimed iteration (the steady state has
    the last step's communication in flight); it ends with its own finished.
    ``each_round()`` runs at the start of every round, on every rank at once."""
    for _ in range(rounds):
        if each_round is not None:
            dist.barrier()
            each_round()
        for name, (model, optimizer) in runs.items():
            settle(model)
            dist.barrier()
            iteration(model, optimizer, x, y)
            for _ in range(iters):
                yield name, model, optimizer
            settle(model)


def round_means(times, iters):
    """Each round's mean iteration: ``times`` holds ``iters`` per round, in order."""
    return [statistics.fmean(times[i:i + iters]) for i in range(0, len(times), iters)]


def pace(times_by_rank, iters):
    """A run's time per iteration: the median over the rounds of each round's
    mean iteration, averaged over the ranks. The ranks train in lockstep, so
    over a round each runs the same iterations at the same pace; their clocks
    start and stop where each one happens to be (a rank the scheduler parks
    right after a collective ends its last step later), so one rank's round
    reads long by what another's reads short, and the slowest rank's reading
    is long by that jitter alone (widein at 4 ranks on 2 cores: DDP's
    schedule 203.6 ms by the slowest rank, 191.0 by the ranks' mean, its
    rounds 29 ms apart between ranks)."""
    per_rank = [round_means(times, iters) for times in times_by_rank]
    return statistics.median(statistics.fmean(ranks) for ranks in zip(*per_rank))


def threads_per_rank(world):
    """This machine's cores shared out among the ranks that run on it."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))


PHASES = ("forward", "backward", "step")


def iteration(model, optimizer, x, y, timeline=None, phases=None):
    """One training iteration; with `phases` (a dict of lists), appends each
    phase's wall seconds (forward+loss, backward, zero_grad+step): where a
    schedule's waits land (dear's all-gathers in forward, reductions in step);
    and under "<phase> off-CPU" the part of it the training thread did not
    run (blocked in a wait or a lock, or preempted by another thread).
    Returns the loss (detached)."""
    span = timeline.span if timeline else (lambda *a: contextlib.nullcontext())
    clock = lambda: (time.perf_counter(), time.thread_time())  # noqa: E731
    t0 = clock()
    optimizer.zero_grad()
    with span("compute", "forward+loss"):
        t1 = clock()
        loss = F.cross_entropy(model(x), y)
    with span("compute", "backward"):
        t2 = clock()
        loss.backward()
    with span("compute", "step"):
        t3 = clock()
        optimizer.step()
    t4 = clock()
    if phases is not None:
        walls = (t2[0] - t1[0], t3[0] - t2[0], t4[0] - t3[0] + t1[0] - t0[0])  # zero_grad counts as step
        cpus = (t2[1] - t1[1], t3[1] - t2[1], t4[1] - t3[1] + t1[1] - t0[1])
        for name, wall, cpu in zip(PHASES, walls, cpus):
            phases.setdefault(name, []).append(wall)
            phases.setdefault(f"{name} off-CPU", []).append(wall - cpu)
    return loss.detach()


def record_timeline(args, runs, x, y, label, predictions):
    """Three iterations of every run, traced, on every rank; each run's
    prediction (rank 0's simulation, ``predictions``) laid beside it: in the
    trace as its own process starting with the run's rank 0, in the run's PNG
    as a second panel on the same time axis."""
    per_run = {}
    for name in runs:
        model, optimizer = runs[name]
        settle(model)
        timeline = Timeline().attach(model)
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, timeline.ddp_comm_hook)
        iteration(model, optimizer, x, y)  # the first traced iteration starts clean
        timeline.clear()
        for _ in range(3):
            iteration(model, optimizer, x, y, timeline)
        if hasattr(model, "sync"):
            model.sync()
        timeline.collect()
        per_run[name] = gather_events(timeline)
    if dist.get_rank() == 0:
        predicted = {}
        for n, ranks in per_run.items():
            start = min((e["start_ns"] for e in ranks[0]), default=0)
            predicted[n] = [dict(e, start_ns=e["start_ns"] + start, end_ns=e["end_ns"] + start)
                            for e in predictions[n].timeline_events()]
        write_chrome_trace(f"{args.timeline}.json",
                           {**per_run, **{f"{n} (predicted)": [events] for n, events in predicted.items()}})
        plot_gantt(f"{args.timeline}.png", {f"{n} (rank 0)": ranks[0] for n, ranks in per_run.items()},
                   title=f"{label}: three iterations")
        for n, ranks in per_run.items():  # one PNG per run as well, easier to read, its prediction below it
            plot_gantt(f"{args.timeline}-{n.replace('/', '_')}.png",
                       {f"{n}\nmeasured\n(rank 0)": ranks[0], f"{n}\npredicted": predicted[n]},
                       title=f"{n}: {label}; predicted {predictions[n].iteration_ms:.0f} ms per iteration")
        print(f"timeline: {args.timeline}.json (Perfetto), {args.timeline}.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="mlp")
    parser.add_argument("--model-args", nargs="*", default=[], help="constructor overrides, e.g. width=1024 depth=6")
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES),
                        default=[name for name in SCHEDULES if name not in NOT_BY_DEFAULT])
    parser.add_argument("--partition-mb", type=float, nargs="*", default=[],
                        help="add a /pP variant of every dearcomm schedule for each P")
    parser.add_argument("--credit-mb", type=float, nargs="*", default=[],
                        help="bytescheduler: one row per credit (with each partition)")
    parser.add_argument("--runs", nargs="+", help="explicit run names (SCHEDULE[/pP][/cC][/sync][/again][@DEARCOMM_VAR=VALUE]); "
                        "overrides the three above")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per run per round")
    parser.add_argument("--timeline", help="write PREFIX.json and PREFIX.png (every run), PREFIX-RUN.png")
    parser.add_argument("--json", help="write every number here")
    args = parser.parse_args()
    if args.rounds < 1 or args.iters < 1:
        parser.error(f"--rounds and --iters must be >= 1, got {args.rounds} and {args.iters}")
    names = run_names(args)
    for name in names:
        parse_run(name)
        run_environment(name)
    skipped = {name: why for name in names if parse_run(name)[0] == "fsdp2" and (why := fsdp2_unavailable())}
    names = [name for name in names if name not in skipped]
    if not names:
        raise SystemExit("every run skipped: " + "; ".join(f"{n}: {why}" for n, why in skipped.items()))

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    threads = threads_per_rank(world)
    torch.set_num_threads(threads)
    network = os.environ.get("DEARCOMM_NETLAB", "loopback")
    g = torch.Generator().manual_seed(rank)
    probe = make(args)
    x, y = probe.batch(args.batch, g)
    n_params = sum(p.numel() for p in probe.parameters())
    load0 = os.getloadavg()

    pieces = measure_pieces(args, x, y)
    # What the prediction runs on: the ranks' per-module profile, taken in step
    # as they train (each iteration the slowest rank's), once a round between
    # the runs (this machine's speed drifts by more than 10% over a row: one
    # profile at the start set every prediction of a row off by up to 9% the
    # same way), and the measured slowdown of compute beside collectives and
    # of collectives beside compute (dearcomm/contention.py), also once a
    # round, their medians kept: measured once at the start, κ read 2.19 and
    # 1.39 in two runs of one row (widein, 4 ranks), and deft's prediction
    # went from 13.9% long to 8.9% short with it.
    profiled = make(args)
    profiled_opt = torch.optim.AdamW(profiled.parameters(), lr=1e-4)
    contended = make(args)
    contention_mib = min(64.0, n_params * 4 / 2**20)
    profiles, contentions = [], []

    def profile_once():
        profiles.append(dearcomm.profile(profiled, (x, y), profiled_opt, iterations=args.iters,
                                         loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]),
                                         group=dist.group.WORLD))
        contentions.append(measure_contention(contended, x, y, contention_mib, args.iters))
    runs = {name: build(name, args) for name in names}
    loss_diff = loss_differences(warm_up(runs, x, y))
    tuned = {name: bo_tune(model, optimizer, x, y, args.iters) for name, (model, optimizer) in runs.items()
             if name.split("/")[0] == "dear-bo"}
    trials_s = {name: finish_auto_trials(model, optimizer, x, y) for name, (model, optimizer) in runs.items()
                if parse_run(name)[0] == "auto"}
    # Each run's own bucket layout (partitioning changes it); ddp: the unpartitioned plan.
    layouts, comm_of = {}, {}
    for name, (model, _) in runs.items():
        runtime = getattr(model, "_dear", None)
        layout = runtime.engine.layout if runtime is not None else plan_layout(args, probe)
        layouts.setdefault(layout_key(layout), layout)
        comm_of[name] = layout_key(layout)
    # The collectives alone, once a round between the runs like the profile,
    # their medians kept: timed once before the rounds (5 times each), the
    # CPU of one layout's all-reduces read 46 to 68 ms in three runs of one
    # row (the MLP, 4 ranks on 2 cores), and where the host CPU bounds the
    # iteration that CPU goes into every prediction of the row.
    comm_rounds = []

    def measure_round():
        profile_once()
        comm_rounds.append({key: measure_collectives(args, layout, probe, max(3, args.iters))
                            for key, layout in layouts.items()})
    plans = {name: model.auto_plan() for name, (model, _) in runs.items() if parse_run(name)[0] == "auto"}
    label = (f"{args.model} ({n_params / 1e6:.1f} M params, buckets of <= {args.bucket_mb} MB), "
             f"world {world}, {network}, batch {args.batch}/rank, {threads} thread(s)/rank")

    times = {name: [] for name in runs}
    cpus = {name: [] for name in runs}
    machine = {name: [] for name in runs}  # per iteration: the machine's busy, softirq, idle ms
    faults = {name: [] for name in runs}
    phases = {name: {} for name in runs}
    total = args.rounds * len(runs) * args.iters
    with tqdm(total=total, disable=rank != 0, desc=args.model, mininterval=2, file=sys.stderr) as bar:
        for name, model, optimizer in interleaved(runs, args.rounds, args.iters, x, y, measure_round):
            f0, m0, c0, start = minor_faults(), machine_ms(), time.process_time(), time.perf_counter()
            iteration(model, optimizer, x, y, phases=phases[name])
            times[name].append(time.perf_counter() - start)
            faults[name].append(minor_faults() - f0)
            cpus[name].append(time.process_time() - c0)
            m1 = machine_ms()
            machine[name].append({k: m1[k] - m0[k] for k in m0})
            bar.update()
    load1 = os.getloadavg()
    profile = dearcomm.TrainingProfile.median_of(profiles)
    # Rank 0's medians on every rank, as auto plans (rank 0 decides for all): each rank's own,
    # the slowest prediction kept, had put 4-rank loopback runs up to 20% longer than rank 0's.
    factors = rank0s({k: statistics.median(c[k] for c in contentions) for k in CONTENTION_FACTORS},
                     dist.group.WORLD)
    # The first round's timings (what --resimulate reads), the medians, and every round's
    # factors with their timings (to compare estimators offline).
    contention = dict(contentions[0], **factors, rounds=[dict(c) for c in contentions])
    # The lower bound's and the ideal's compute: the profile's, taken across the
    # rounds like the runs (one measurement at the start has read twice the forward).
    pieces.update(fwd=profile.forward_ms / 1e3, bwd=profile.backward_ms / 1e3, step=profile.step_ms / 1e3)

    comm = {key: median_of_rounds([r[key] for r in comm_rounds]) for key in layouts}
    unpartitioned = layout_key(plan_layout(args, probe))
    base = comm[unpartitioned] if unpartitioned in comm else comm[comm_of[names[0]]]
    compute = pieces["fwd"] + pieces["bwd"] + pieces["step"]
    share = cores_share(torch.device("cpu"), local_ranks=world)
    host_ms, host_ms_per_mib = host_cpu_of(list(comm.values()), share)
    rows, predictions = {}, {}
    for name, t in times.items():
        c = comm[comm_of[name]]
        chosen = plans[name].options if name in plans else None
        if name in tuned:
            chosen = dict(schedule="dear", update="sharded", bucket_mb=tuned[name].bucket_mb, partition_mb=None,
                          credit_mb=None)
        runtime = getattr(runs[name][0], "_dear", None)
        planned = {k: getattr(runtime.options, k) or {} for k in ("blocks", "priorities", "delays")} \
            if runtime is not None else None
        if planned and any(planned.values()):
            planned["bucket_mb"] = runtime.options.bucket_mb  # the planner's (usbyte's: its unit), not --bucket-mb
        ideal = simulated(name, args, proportional_profile(probe, pieces), 1e3 * pieces["step"], c, world,
                          chosen=chosen, planned=planned,
                          names=[n for n, p in probe.named_parameters() if p.requires_grad])
        predictions[name] = simulation(name, args, profile, profile.step_ms, c, world, factors, chosen=chosen,
                                       planned=planned,
                                       names=[p.name for m in profile.modules for p in m.params], host_ms=host_ms,
                                       host_ms_per_mib=host_ms_per_mib, cores_share=share)
        predicted = slowest(predictions[name].iteration_ms / 1e3)
        # The run's time: pace() of the ranks' iterations, by rounds (args.iters in a row).
        # Not the median single iteration: where a schedule waits for communication in the
        # next forward, time moves between one rank's consecutive iterations (bytescheduler/p4,
        # GPT, 4 ranks on loopback: rank 0's median iteration 567 ms, the slowest rank's 642,
        # rank 0's mean 582). Both readings by the slowest rank are kept, from the same gather.
        by_rank = all_ranks(t)
        med = pace(by_rank, args.iters)
        q = statistics.quantiles(t, n=10, method="inclusive") if len(t) >= 2 else [t[0]] * 9  # within the samples
        rows[name] = dict(median_ms=1e3 * med, iteration_median_ms=1e3 * max(map(statistics.median, by_rank)),
                          slowest_rank_ms=1e3 * max(statistics.median(round_means(r, args.iters)) for r in by_rank),
                          p10_ms=1e3 * q[0], p90_ms=1e3 * q[-1], ideal_ms=1e3 * ideal,
                          predicted_ms=1e3 * predicted, prediction_error=predicted / med - 1,
                          predicted_cpu_ms=slowest(predictions[name].cpu_ms / 1e3) * 1e3,  # the host CPU bound
                          efficiency=ideal / med, cpu_ms=1e3 * slowest(statistics.median(cpus[name])),
                          softirq_ms=statistics.median(m["softirq"] for m in machine[name]), buckets=c["buckets"],
                          # Means over this rank's iterations (/proc/stat counts 10 ms ticks: a median
                          # of one iteration's reads mostly 0), and every rank's CPU per iteration in
                          # order: what the wall beyond the CPU is made of (prediction_noise.py reads them).
                          machine_ms={k: statistics.fmean(m[k] for m in machine[name]) for k in machine[name][0]},
                          cpu_iterations_ms=[[1e3 * x for x in r] for r in all_ranks(cpus[name])],
                          minor_faults=slowest(statistics.median(faults[name])),
                          phases_ms={k: 1e3 * slowest(statistics.median(v)) for k, v in phases[name].items()},
                          comm_ms={k: 1e3 * c[k] for k in COMM_KEYS},
                          iterations_ms=[1e3 * x for x in t],  # this rank's, in order: ITERS per round
                          iterations_ms_by_rank=[[1e3 * x for x in r] for r in by_rank],
                          delayed=sorted((planned or {}).get("delays") or {}),  # deft: the parameters it delayed
                          loss_diff_vs_ddp=loss_diff.get(name))
        if planned and any(planned.values()):  # usbyte's blocks and order, deft's delays: --resimulate replays them
            rows[name]["planned"] = planned  # plain dicts by parameter name; json writes the tuples as lists
        if name in tuned:
            rows[name].update(bo_bucket_mb=tuned[name].bucket_mb, bo_trials=tuned[name].trials,
                              bo_tuning_s=tuned[name].seconds)
        if name in plans:
            rows[name].update(auto_options=plans[name].options, auto_predicted_ms=plans[name].predicted_ms,
                              auto_default_ms=plans[name].default_ms, auto_planning_s=plans[name].planning_s,
                              auto_trials_s=trials_s[name], auto_shortlist=plans[name].shortlist,
                              auto_reference=plans[name].reference, auto_default=plans[name].default,
                              auto_measured_ms=plans[name].measured_ms,
                              auto_first_trial_ms=plans[name].first_trial_ms,
                              auto_confirmations=plans[name].confirmations)
    ddp = rows.get("ddp", {}).get("median_ms")
    for r in rows.values():
        r["speedup_vs_ddp"] = ddp / r["median_ms"] if ddp else None
    rows.update({name: dict(skipped=why) for name, why in skipped.items()})
    if rank == 0:
        ms = lambda s: f"{1e3 * s:.1f}"  # noqa: E731
        print(f"\n# {label}")
        print(f"load average (1 min) {load0[0]:.1f} at start, {load1[0]:.1f} at end; allocator: {allocator_policy()}")
        print(f"pieces (ms): T_fwd {ms(pieces['fwd'])}  T_bwd {ms(pieces['bwd'])}  T_step {ms(pieces['step'])}  "
              f"T_step(shard) {ms(pieces['step_shard'])}  |  CPU per compute-only iteration {ms(pieces['cpu_iter'])}")
        f = factors
        print(f"prediction: the ranks' profile (in step, slowest rank) of {len(profile.modules)} modules, median of "
              f"{len(profiles)} rounds' (fwd {profile.forward_ms:.1f}, "
              f"{min(p.forward_ms for p in profiles):.1f}-{max(p.forward_ms for p in profiles):.1f} over the rounds; "
              f"bwd {profile.backward_ms:.1f}, step {profile.step_ms:.1f} ms), compute "
              f"{f['compute_slowdown']:.3f}x slower beside an all-reduce of {contention_mib:.1f} MiB, which is "
              f"{f['comm_slowdown']:.3f}x slower beside compute (rank 0; medians of {len(contentions)} rounds', κ "
              f"{min(c['compute_slowdown'] for c in contentions):.2f}-"
              f"{max(c['compute_slowdown'] for c in contentions):.2f}); per collective, the compute loses "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in host_ms.items()) + " and per MiB "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in host_ms_per_mib.items()) + " (the layouts' CPU below "
              f"x {share:.2f}, the ranks over the cores; measured beside each other, the collectives' CPU is "
              f"{f['comm_cpu_slowdown']:.2f}x theirs alone and the compute's {f['compute_cpu_slowdown']:.2f}x: the "
              f"iteration takes at least that CPU, "
              + ("the ranks taking turns on the cores" if share > 1 else
                 f"the slowest of {world} ranks' whose compute varies by {f['iteration_cv']:.1%}") + ")")
        print("layouts (comm alone, ms; cpu = this process's CPU ms during it):")
        for key, c in comm.items():
            users = [n for n in names if comm_of[n] == key]
            print(f"  {c['buckets']:>3} buckets, m0 {c['m0_buckets']} of {c['m0_bytes'] / 2**20:4.1f} MiB: T_RS {ms(c['rs'])} (cpu {ms(c['cpu_rs'])})"
                  f"  T_AG {ms(c['ag'])} (cpu {ms(c['cpu_ag'])})  T_AR {ms(c['ar'])} (cpu {ms(c['cpu_ar'])})"
                  f"  T_AR(ordered) {ms(c['ar_ordered'])} (cpu {ms(c['cpu_ar_ordered'])})"
                  f"  T_AR(m0) {ms(c['ar_m0'])}  [{c['bytes'] / 2**20:.1f} MiB]  <- {', '.join(users)}")
        for name, (model, _) in runs.items():
            if isinstance(model, DistributedDataParallel) and parse_run(name)[2]:
                buckets = len(model.reducer._get_zeros_like_grad_buckets())  # as rebuilt after the warm-up
                print(f"  {name}: torch DDP's own {buckets} buckets (not measured alone; the ideal shown is ddp's)")
        for name, plan in plans.items():
            print(f"  {name}: {plan}; trials took {trials_s[name]:.1f} s of training")
        for name, t in tuned.items():
            print(f"  {name}: bucket_mb={t.bucket_mb:.2f} after {len(t.trials)} trials in {t.seconds:.1f} s: "
                  + ", ".join(f"{mb:.1f} MiB {1e3 * sec:.0f} ms" for mb, sec in t.trials))
        if len(loss_diff) > 1:
            print("losses vs ddp, max |diff| over the 2 warm-up steps and the ranks: "
                  + "  ".join(f"{n} {d:.1e}" for n, d in loss_diff.items() if n != "ddp"))
        bound = max(compute, base["ar"])
        print(f"lower bound max(compute, comm) = {ms(bound)} ms;  C/T_bwd = {base['ar'] / max(pieces['bwd'], 1e-9):.2f}")
        print(f"{'run':<27}{'median ms':>10}{'p10':>9}{'p90':>9}{'ideal':>9}{'effic.':>8}{'pred.':>9}{'error':>8}"
              f"{'speedup':>8}"
              f"{'cpu ms':>8}{'sirq ms':>8}{'kfaults':>8}   fwd / bwd / step ms (training thread off CPU)")
        for name, r in rows.items():
            if "skipped" in r:
                print(f"{name:<27}skipped: {r['skipped']}", flush=True)
                continue
            vs = f"{r['speedup_vs_ddp']:.3f}" if ddp else "-"
            print(f"{name:<27}{r['median_ms']:>10.1f}{r['p10_ms']:>9.1f}{r['p90_ms']:>9.1f}{r['ideal_ms']:>9.1f}"
                  f"{r['efficiency']:>8.2f}{r['predicted_ms']:>9.1f}{r['prediction_error']:>+8.1%}{vs:>8}{r['cpu_ms']:>8.1f}{r['softirq_ms']:>8.1f}{r['minor_faults'] / 1e3:>8.1f}   "
                  + " / ".join(f"{r['phases_ms'][k]:.1f} ({r['phases_ms'][k + ' off-CPU']:.1f})" for k in PHASES),
                  flush=True)
    if args.timeline:
        record_timeline(args, runs, x, y, label, predictions)
    write_json(args.json, dict(label=label, model=args.model, world_size=world, network=network, threads=threads,
                               args=vars(args), loadavg_start=load0, loadavg_end=load1, allocator=allocator_policy(),
                               pieces_ms={k: 1e3 * v for k, v in pieces.items()}, profile=profile.to_dict(),
                               profile_rounds_ms=[dict(forward=p.forward_ms, backward=p.backward_ms, step=p.step_ms)
                                                  for p in profiles],
                               contention=contention, host_ms=host_ms, host_ms_per_mib=host_ms_per_mib,
                               comm_ms=in_ms(comm, names, comm_of),
                               comm_rounds_ms=[in_ms(r, names, comm_of) for r in comm_rounds],
                               lower_bound_ms=1e3 * max(compute, base["ar"]), runs=rows))
    for model, _ in runs.values():
        settle(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
