"""Synchronous pipeline planning (INFOCOM 2022; docs/guide.md, "Planning a
pipeline"): split a model's layers into stages, map the stages (possibly
replicated) onto devices joined by links of different speeds, order every
device's forward and backward tasks, and predict the iteration time.

    profile = load_shared_profile("pipedream/vgg16")
    topology = preset("nvlink-pairs", 8)
    plan = plan_pipeline(profile, topology, num_microbatches=8)
    result = simulate(plan, profile, topology)   # timeline; draw_timeline(...)

Independent of the DeAR engine; times are ms per micro-batch, sizes bytes.
"""
from .baselines import BASELINES, all_plans, dapple_plan, gpipe_plan, one_f_one_b_plan, pipedream_plan
from .brute_force import brute_force
from .draw import draw_timeline, write_chrome_trace
from .order import gpipe_orders, list_orders, one_f_one_b_orders
from .plan import BACKWARD, FORWARD, Plan, Task
from .profile import (LayerProfile, ModelProfile, chain, coarsen, load_shared_profile, profile_sequential,
                      shared_profile_names)
from .planner import plan_pipeline
from .simulate import SimResult, SimulationStuck, Span, list_schedule, simulate
from .topology import PRESETS, Topology, TransferCpu, preset, servers, switched, uniform

__all__ = [
    "BASELINES", "all_plans", "brute_force", "dapple_plan", "draw_timeline", "gpipe_plan", "one_f_one_b_plan",
    "pipedream_plan", "plan_pipeline", "write_chrome_trace",
    "BACKWARD", "FORWARD", "LayerProfile", "ModelProfile", "PRESETS", "Plan", "SimResult", "SimulationStuck", "Span",
    "Task", "Topology", "TransferCpu", "chain", "coarsen", "gpipe_orders", "list_orders", "list_schedule",
    "load_shared_profile",
    "one_f_one_b_orders", "preset", "profile_sequential", "servers", "shared_profile_names", "simulate",
    "switched", "uniform",
]
