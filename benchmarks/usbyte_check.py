"""US-Byte's planner against the engine that trains with its plans, on
random profiles, simulated: for each profile the planner's own predicted
iteration beside dearcomm.simulate of the same blocks and order (the usbyte
policy and executor on a virtual clock), and usbyte's plan against
bytescheduler (the best of its partition x credit grid) and wfbp.

    python benchmarks/usbyte_check.py [--profiles 60] [--seed 5]

Prints the distributions (median, min, max); a prediction from stated
assumptions, not a measurement."""
import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dearcomm  # noqa: E402
from dearcomm import ModuleProfile, Network, simulate  # noqa: E402
from dearcomm.usbyte import plan_modules  # noqa: E402

WORLD = 4


def random_profile(rng, unit):
    return [ModuleProfile(f"m{i}", rng.uniform(0, 2), rng.uniform(0, 3),
                          [rng.randint(1, 5000) * unit for _ in range(rng.randint(1, 3))])
            for i in range(rng.randint(2, 8))]


def spread(values):
    return f"median {statistics.median(values):.3f}, min {min(values):.3f}, max {max(values):.3f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=60)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    unit = dearcomm._C.partition_unit(WORLD, torch.float32)
    engine_over_planner, over_bytescheduler, over_wfbp = [], [], []
    for _ in range(args.profiles):
        profile = random_profile(rng, unit)
        network = Network(alpha_us=rng.uniform(0, 50), gbit_s=rng.uniform(1, 20))
        job = plan_modules(profile, network, WORLD)
        engine_over_planner.append(job.predicted_ms / job.plan.iteration_ms)
        bytescheduler = min(simulate(profile, schedule="bytescheduler", world_size=WORLD, network=network,
                                     partition_mb=p, credit_mb=c).iteration_ms
                            for p in (None, 1, 4) for c in (None, 1, 4))
        wfbp = simulate(profile, schedule="wfbp", world_size=WORLD, network=network).iteration_ms
        over_bytescheduler.append(bytescheduler / job.predicted_ms)
        over_wfbp.append(wfbp / job.predicted_ms)
    print(f"# {args.profiles} random profiles (2-8 modules, 1-3 tensors each, up to 5000 partition units), "
          f"{WORLD} ranks, α 0-50 µs, 1-20 Gbit/s; usbyte = plan_modules' plan, its unit tuned")
    print(f"engine / planner iteration (same blocks and order): {spread(engine_over_planner)}; "
          f"equal (within 0.1%) in {sum(abs(r - 1) < 1e-3 for r in engine_over_planner)}")
    print(f"usbyte speedup over bytescheduler (best of 9 settings): {spread(over_bytescheduler)}")
    print(f"usbyte speedup over wfbp: {spread(over_wfbp)}")


if __name__ == "__main__":
    main()
