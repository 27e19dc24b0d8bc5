"""Synchronous pipeline planning (docs/pipeline.md): split a model's layers
into stages, map the stages (possibly replicated) onto devices joined by
links of different speeds, order every device's forward and backward tasks
within its memory, and predict the iteration time.

    profile = load_shared_profile("pipedream/vgg16")      # packaged profiles
    topology = preset("nvlink-pairs", 8).with_memory(16e9)
    plan = plan_pipeline(profile, topology, num_microbatches=8)
    result = simulate(plan, profile, topology)   # timeline; draw_timeline(...)

Independent of the DeAR engine and of torch (only runtime.py and measure.py need torch);
times are ms per micro-batch, sizes bytes.
"""
from .baselines import BASELINES, all_plans, dapple_plan, gpipe_plan, one_f_one_b_plan, pipedream_plan
from .brute_force import brute_force
from .draw import draw_timeline, write_chrome_trace
from .exhaustive import exhaustive_plan
from .memory import check_memory, device_memory, peak_in_flight
from .order import gpipe_orders, list_orders, one_f_one_b_orders, warmup_orders
from .plan import BACKWARD, FORWARD, Plan, Task
from .profile import LayerProfile, ModelProfile, chain, coarsen, profile_sequential
from .profile_data import layer_records, load_shared_profile, param_tensors, shared_profile_names
from .planner import plan_pipeline
from .simulate import SimResult, SimulationStuck, Span, list_schedule, simulate
from .topology import PRESETS, Topology, TransferCpu, preset, servers, switched, uniform

__all__ = [
    "BASELINES", "all_plans", "brute_force", "check_memory", "dapple_plan", "device_memory", "draw_timeline",
    "exhaustive_plan", "gpipe_plan", "one_f_one_b_plan", "peak_in_flight", "warmup_orders",
    "pipedream_plan", "plan_pipeline", "write_chrome_trace",
    "BACKWARD", "FORWARD", "LayerProfile", "ModelProfile", "PRESETS", "Plan", "SimResult", "SimulationStuck", "Span",
    "Task", "Topology", "TransferCpu", "chain", "coarsen", "gpipe_orders", "list_orders", "list_schedule",
    "layer_records", "load_shared_profile", "param_tensors",
    "one_f_one_b_orders", "preset", "profile_sequential", "servers", "shared_profile_names", "simulate",
    "switched", "uniform",
]
