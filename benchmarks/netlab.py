"""An emulated cluster on one machine: N network namespaces joined through a
bridge by veth pairs, every interface rate-limited with tbf (netem is not
available here), one rank per namespace, gloo over TCP between them.

    sudo python benchmarks/netlab.py --ranks 2 --rate 1gbit -- benchmarks/train_bench.py --model mlp
    sudo python benchmarks/netlab.py --ranks 3 --rate 1gbit,1gbit,200mbit -- ...   # a rate per rank

Runs `python SCRIPT ARGS` once per rank with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, ...) and GLOO_SOCKET_IFNAME set, so scripts call
dist.init_process_group("gloo") as under torchrun. Needs root. Uses only
addresses inside the namespaces it creates (10.77.<n>.0/24), and removes them
all on exit, on failure and on Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
from typing import List, Sequence


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _in(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *args], check=True, capture_output=True, text=True)


class Cluster:
    """Namespaces, bridge and rate limits; a context manager that always cleans up."""

    def __init__(self, ranks: int, rate: str, burst: str = "256kb", latency: str = "100ms") -> None:
        """rate: one tbf rate for every interface, or a comma-separated rate
        per rank (that rank's sending and receiving side both run at it)."""
        if not 2 <= ranks <= 16:
            raise SystemExit(f"netlab: --ranks must be 2..16, got {ranks}")
        self.rates = rate.split(",") if "," in rate else [rate] * ranks
        if len(self.rates) != ranks:
            raise SystemExit(f"netlab: --rate lists {len(self.rates)} rates for {ranks} ranks; give one or one per rank")
        self.ranks, self.rate, self.burst, self.latency = ranks, rate, burst, latency
        tag = f"{os.getpid() % 100000}"
        self.hub = f"dcl{tag}-hub"
        self.namespaces = [f"dcl{tag}-r{i}" for i in range(ranks)]
        self.subnet = random.Random(os.getpid()).randint(1, 250)
        self.addresses = [f"10.77.{self.subnet}.{i + 1}" for i in range(ranks)]
        self.created: List[str] = []

    def interface(self, rank: int) -> str:
        return f"dc{rank}"

    def __enter__(self) -> "Cluster":
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _limit(self, ns: str, dev: str, rate: str) -> None:
        _in(ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", self.burst, "latency", self.latency)

    def _create(self) -> None:
        _ip("netns", "add", self.hub)
        self.created.append(self.hub)
        _in(self.hub, "ip", "link", "add", "br0", "type", "bridge")
        _in(self.hub, "ip", "link", "set", "br0", "up")
        for rank, (ns, address) in enumerate(zip(self.namespaces, self.addresses)):
            _ip("netns", "add", ns)
            self.created.append(ns)
            inner, outer = self.interface(rank), f"hb{rank}"
            _ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", self.hub)
            _in(ns, "ip", "addr", "add", f"{address}/24", "dev", inner)
            _in(ns, "ip", "link", "set", inner, "up")
            _in(ns, "ip", "link", "set", "lo", "up")
            _in(self.hub, "ip", "link", "set", outer, "master", "br0")
            _in(self.hub, "ip", "link", "set", outer, "up")
            self._limit(ns, inner, self.rates[rank])       # this rank's sending
            self._limit(self.hub, outer, self.rates[rank])  # this rank's receiving

    def remove(self) -> None:
        for ns in reversed(self.created):  # deleting a namespace deletes its interfaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()

    def launch(self, command: Sequence[str], port: int = 29511) -> int:
        """Runs `command` once per rank inside its namespace; returns the first
        non-zero exit code (the others are stopped), or 0."""
        procs = []
        try:
            for rank, ns in enumerate(self.namespaces):
                # All ranks share this machine's cores: LOCAL_WORLD_SIZE says so.
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.ranks),
                           LOCAL_WORLD_SIZE=str(self.ranks), MASTER_ADDR=self.addresses[0], MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME=self.interface(rank), OMP_NUM_THREADS="1",
                           DEARCOMM_NETLAB=f"{self.ranks}x{self.rate}")
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *command], env=env))
            codes = [p.wait() for p in procs]
            return next((c for c in codes if c != 0), 0)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="tbf rate per interface, e.g. 1gbit, 10gbit, 500mbit; "
                        "or one per rank, comma-separated: 1gbit,1gbit,200mbit")
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: run with this Python")
    args = parser.parse_args(argv)
    script = [a for a in args.script if a != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the script to run after --")
    if os.geteuid() != 0:
        print("netlab: needs root (network namespaces, veth, tc); run it with sudo or as root", file=sys.stderr)
        return 2
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"netlab: '{tool}' was not found (Debian: apt-get install iproute2)", file=sys.stderr)
            return 2
    # Ctrl-C and SIGTERM unwind through the context manager, which removes everything.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with Cluster(args.ranks, args.rate) as cluster:
        print(f"netlab: {args.ranks} ranks at {args.rate} per interface: "
              f"{', '.join(f'{ns}={a}' for ns, a in zip(cluster.namespaces, cluster.addresses))}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            return cluster.launch([sys.executable, *script], port=args.port)
    return 130


if __name__ == "__main__":
    sys.exit(main())
