"""The network probe wrap()'s "auto" starts with (dearcomm.network_probe),
run several times in a row on one group: how far its fit (α, bandwidth) and
each collective's host CPU (Network.host_ms per call, host_ms_per_mib per MiB)
move between probes.

    sudo python benchmarks/netlab.py --ranks 4 --rate 1gbit -- benchmarks/probe_repeat.py --times 4
    torchrun --nproc_per_node=2 benchmarks/probe_repeat.py
"""
import argparse

import torch
import torch.distributed as dist

from dearcomm.network_probe import probe_network
from dearcomm.prediction import COST_KINDS


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--times", type=int, default=4, help="probes in a row")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # as train_bench.py's ranks on this machine's cores
    rank = dist.get_rank()
    if rank == 0:
        print(f"world {dist.get_world_size()}; host CPU per collective and per MiB (ms of compute), then the α-β fit")
        print(f"{'probe':>5}" + "".join(f"{k:>30}" for k in COST_KINDS) + f"{'alpha us':>10}{'Gbit/s':>8}")
    for i in range(args.times):
        network = probe_network(None, torch.device("cpu")).network
        if rank == 0:
            print(f"{i:>5}" + "".join(f"{network.host_ms[k]:>15.2f}{network.host_ms_per_mib[k]:>11.3f}/MiB"
                                      for k in COST_KINDS)
                  + f"{network.alpha_us:>10.0f}{network.gbit_s:>8.2f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
