"""Each collective's cost to the host (dearcomm.host_cost): the fit recovers
the CPU per collective from synthetic timings of both shapes (one collective
of several sizes; several layouts of the same bytes in more or fewer
collectives: the benchmark), the share of a CPU second a rank's compute
loses follows the cores, and the network probe charges rank 0's CPU of a
small call on every rank."""
import math

import pytest
import torch

from dearcomm.host_cost import cores_share, fit_host_cpu, fit_host_ms

MIB = 1 << 20


def test_the_fit_recovers_the_cpu_per_collective_from_one_collective_of_several_sizes():
    # cpu = 0.3 ms + 0.05 ms per MiB (all-reduce), 0.1 + 0.02 (the others)
    sizes = (MIB // 4, 2 * MIB, 16 * MIB)
    samples = {"all_reduce": [(1, b, 0.3 + 0.05 * b / MIB) for b in sizes],
               "reduce_scatter": [(1, b, 0.1 + 0.02 * b / MIB) for b in sizes],
               "all_gather": [(1, b, 0.1 + 0.02 * b / MIB) for b in sizes]}
    got = fit_host_ms(samples, share=2.0)
    assert got == {"all_reduce": pytest.approx(0.6), "reduce_scatter": pytest.approx(0.2),
                   "all_gather": pytest.approx(0.2)}


def test_the_fit_recovers_it_from_layouts_of_the_same_bytes_in_more_collectives():
    total = 3 * MIB  # 2, 15 and 20 buckets of it: cpu = 1.2 ms each + 0.4 ms per MiB
    samples = {"all_reduce": [(n, total, 1.2 * n + 0.4 * total / MIB) for n in (2, 15, 20)]}
    assert fit_host_ms(samples, share=1.0) == {"all_reduce": pytest.approx(1.2)}
    # Noise that would make the CPU per collective negative charges nothing.
    assert fit_host_ms({"all_reduce": [(2, total, 5.0), (20, total, 4.0)]}, share=1.0) == {"all_reduce": 0.0}


def test_the_same_fit_gives_the_cpu_per_mib_of_either_shape():
    sizes = (MIB // 4, 2 * MIB, 16 * MIB)
    per_call, per_mib = fit_host_cpu({"all_reduce": [(1, b, 0.3 + 0.05 * b / MIB) for b in sizes],
                                      "all_gather": [(n, 3 * MIB, 1.2 * n + 0.4 * 3) for n in (2, 15, 20)]},
                                     share=2.0)
    assert per_call == {"all_reduce": pytest.approx(0.6), "all_gather": pytest.approx(2.4)}
    assert per_mib == {"all_reduce": pytest.approx(0.1), "all_gather": pytest.approx(0.8)}
    # Neither term where the samples cannot separate them; nothing on cores the compute leaves free.
    assert fit_host_cpu({"all_reduce": [(1, MIB, 2.0)]}, share=1.0) == ({"all_reduce": 0.0}, {"all_reduce": 0.0})
    assert fit_host_cpu({"all_reduce": [(1, b, 1.0 + b / MIB) for b in sizes]}, share=0.0)[1] == {"all_reduce": 0.0}


def test_what_cannot_separate_the_two_terms_charges_nothing():
    assert fit_host_ms({"all_reduce": [(1, MIB, 2.0)]}, share=1.0) == {"all_reduce": 0.0}
    # collectives in proportion to bytes: a fixed and a per-byte cost look alike
    assert fit_host_ms({"all_gather": [(1, MIB, 1.0), (2, 2 * MIB, 2.0)]}, share=1.0) == {"all_gather": 0.0}
    assert fit_host_ms({"all_reduce": [(1, MIB, 1.0), (1, 2 * MIB, 2.0)]}, share=0.0) == {"all_reduce": 0.0}


@pytest.mark.parametrize("samples,share,match", [
    ({"broadcast": [(1, 1, 1.0)]}, 1.0, "samples for 'broadcast'"),
    ({"all_reduce": [(1, MIB, -1.0), (1, 2 * MIB, 1.0)]}, 1.0, "all_reduce cpu_ms must be"),
    ({"all_reduce": [(0, MIB, 1.0), (1, 2 * MIB, 1.0)]}, 1.0, "all_reduce collectives must be"),
    ({"all_reduce": [(1, math.nan, 1.0), (1, 2 * MIB, 1.0)]}, 1.0, "all_reduce bytes must be"),
    ({}, -1.0, "share must be"),
])
def test_bad_samples_get_clear_errors(samples, share, match):
    with pytest.raises(ValueError, match=match):
        fit_host_ms(samples, share)


def test_a_cpu_second_costs_the_ranks_over_the_cores_where_compute_fills_them():
    cpu = torch.device("cpu")
    assert cores_share(cpu, local_ranks=4, threads=1, cores=2) == 2.0  # 4 ranks on 2 cores: each loses 2x
    assert cores_share(cpu, local_ranks=2, threads=1, cores=2) == 1.0
    assert cores_share(cpu, local_ranks=1, threads=16, cores=16) == pytest.approx(1 / 16)  # spread over 16 cores
    assert cores_share(cpu, local_ranks=2, threads=1, cores=16) == 0.0  # idle cores run the collectives
    assert cores_share(torch.device("cuda", 0), local_ranks=8, threads=1, cores=2) == 0.0  # not on the GPU's way


def test_cores_share_reads_torchrun_s_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cores_share(torch.device("cpu"), threads=1, cores=2) == 2.0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert cores_share(torch.device("cpu"), threads=1, cores=2) == 0.0  # one rank, one thread: a core to spare


@pytest.mark.parametrize("kwargs", [dict(local_ranks=0), dict(threads=1.5), dict(cores=True)])
def test_cores_share_rejects_bad_counts(kwargs):
    args = dict(local_ranks=2, threads=1, cores=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match="cores_share's"):
        cores_share(torch.device("cpu"), **args)


def test_the_probe_s_host_cost_is_the_short_value_of_calls_that_take_one_of_two():
    from dearcomm.network_probe import HOST_REPEATS, HOST_STATISTIC

    short, long = [0.25 + 0.02 * i for i in range(HOST_REPEATS)], 3.5
    # A third of the calls long (polling while the link holds the data): the median's
    # value lands on the long one where 8 of 15 are; the host cost must not.
    for n_long in (5, 8, 11):
        values = [long] * n_long + short[:HOST_REPEATS - n_long]
        assert HOST_STATISTIC(values) < 1.0, f"{n_long} of {HOST_REPEATS} long"
    assert HOST_STATISTIC([long] * HOST_REPEATS) == long, "every call long: that is the cost"
    assert HOST_STATISTIC([2.0, 1.0, 3.0, 4.0]) == 2.0
    with pytest.raises(ValueError, match="no values"):
        HOST_STATISTIC([])


def _probe_worker(rank, world_size):
    """The probe on a real gloo group, each rank's calls made to read a CPU
    time of its own, (rank + 1)·k ms per call and 0.1 of that per MiB (kind
    k of COST_KINDS, from 1): every rank gets rank 0's per-call cost (of its
    16 KiB calls) and per-MiB cost (the slope over every size), times the
    cores' share (fixed at 1.5 on rank 0 and 3 on the other, a host of other
    cores: one rank of one thread on this machine's cores would have 0, and
    every figure with it): rank 0's on every rank, kept as cores_share."""
    from dearcomm import network_probe
    from dearcomm.prediction import COST_KINDS

    timed = network_probe._timed

    def rank_tagged(kind, full, shard, *args, **kwargs):
        wall, _ = timed(kind, full, shard, *args, **kwargs)
        ms = (rank + 1) * (1 + COST_KINDS.index(kind))
        return wall, 1000.0 * ms * (1 + 0.1 * full.numel() * 4 / 2**20)
    network_probe._timed = rank_tagged
    network_probe.cores_share = lambda device: 1.5 if rank == 0 else 3.0
    network = network_probe.probe_network(None, torch.device("cpu")).network
    return network.host_ms, network.cores_share, network.per_kind, network.host_ms_per_mib


def network_probe_host_mib() -> float:
    """MiB of the probe's small call (HOST_BYTES, rounded to the ranks)."""
    from dearcomm.network_probe import HOST_BYTES, _buffers
    return _buffers(HOST_BYTES, 2, torch.device("cpu"))[0].numel() * 4 / MIB


def test_the_probe_charges_rank_0s_cpu_of_a_small_call_on_every_rank():
    from tests.multiprocess import run_workers

    results = run_workers(_probe_worker, 2, deadline=120)
    (host_ms, share, per_kind, per_mib), (other, other_share, other_per_kind, other_per_mib) = results
    assert host_ms == other and per_mib == other_per_mib, "every rank holds rank 0's host cost"
    assert share == other_share == 1.5, "every rank holds rank 0's share of the cores"
    small = 1 + 0.1 * network_probe_host_mib()
    assert host_ms == pytest.approx({"reduce_scatter": 1.0 * small * share, "all_gather": 2.0 * small * share,
                                     "all_reduce": 3.0 * small * share, "ordered_all_reduce": 4.0 * small * share})
    assert per_mib == pytest.approx({"reduce_scatter": 0.1 * share, "all_gather": 0.2 * share,
                                     "all_reduce": 0.3 * share, "ordered_all_reduce": 0.4 * share})
    # On a CPU the ordered all-reduce (deft's) is a collective of its own, fitted beside the three.
    assert per_kind == other_per_kind and set(per_kind) == {"reduce_scatter", "all_gather", "all_reduce",
                                                            "ordered_all_reduce"}
    assert all(gbit_s > 0 for _, gbit_s in per_kind.values())
