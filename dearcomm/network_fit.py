"""α–β figures for dearcomm.simulate: fitted from measured collectives, or
taken from a preset of public figures.

The simulator (csrc/sim/cost_model.cpp) costs a ring collective of n bytes
(the full buffer: the reduce-scatter's input, the all-gather's output) over p
ranks as

    reduce_scatter, all_gather:  (p-1)·α + (p-1)/p·n·β
    all_reduce:                 2(p-1)·α + 2(p-1)/p·n·β   (ordered_all_reduce too)

so a measured time is linear in (α, β) with known coefficients a(p) and
b(p, n). fit_network() solves, per collective kind, the non-negative least
squares of those coefficients against the rows that
``benchmarks/collectives.py --json`` writes, jointly over every world size
given, and reports how well the line fits:

    torchrun --nproc_per_node=2 benchmarks/collectives.py --json results/collectives.json
    python -m dearcomm.network_fit results/collectives.json

    fit = dearcomm.fit_network("results/collectives.json")
    print(fit.table())
    dearcomm.simulate(profile, world_size=8, network=fit.network)
    dearcomm.simulate(profile, world_size=8, network=dearcomm.network_preset("25gbe"))
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
from pathlib import Path
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._nnls import nnls2
from .prediction import COST_KINDS, ORDERED_ALL_REDUCE, Network, _check_number

POOR_FIT_REL_ERROR = 0.25
"""A kind whose fitted line misses some row by more than this fraction is
marked "poor" in the table: the simulator would cost such sizes that far off."""

__all__ = ["NETWORK_PRESETS", "network_preset", "fit_network", "NetworkFit", "KindFit", "ring_coefficients", "main"]

Measurements = Union[str, Path, Sequence[Union[str, Path, Mapping]]]


# ---- presets ----------------------------------------------------------------------

def _gbytes(gbytes_per_s: float) -> float:
    """Network.gbit_s from a figure in GB/s (bytes): the presets quote GB/s."""
    return gbytes_per_s * 8.0


# The ring model's β is the bus bandwidth of nccl-tests (busbw = algbw ×
# 2(p-1)/p for all-reduce, × (p-1)/p for reduce-scatter and all-gather, which
# is exactly 1/β for large n), so a published busbw is the figure to take.
NETWORK_PRESETS: Mapping[str, Network] = types.MappingProxyType({
    # 10 Gbit Ethernet: ≈ 1.1 GB/s achieved over TCP and 25–35 µs per hop, the
    # figures commonly assumed for it in cost-model studies of data-parallel
    # scheduling (and by dearcomm.pipeline's "ethernet-10g" topology).
    # Mid-range: 30 µs.
    "10gbe": Network(alpha_us=30.0, gbit_s=_gbytes(1.1)),
    # 25 Gbit Ethernet: ≈ 3 GB/s and 15–20 µs per hop (the same commonly
    # assumed figures). Mid-range: 17.5 µs.
    "25gbe": Network(alpha_us=17.5, gbit_s=_gbytes(3.0)),
    # 100 Gbit InfiniBand (EDR, RDMA): ≈ 11–12 GB/s and 2–5 µs per hop (the
    # same commonly assumed figures). Mid-range: 11.5 GB/s, 3.5 µs.
    "100gb-ib": Network(alpha_us=3.5, gbit_s=_gbytes(11.5)),
    # NVLink3 inside one 8×A100 server: nccl-tests all_reduce_perf reaches a
    # bus bandwidth of about 200–235 GB/s at large sizes (reports in
    # NVIDIA/nccl-tests issues #149, ~200 GB/s on an HPE 8×A100-80GB, and #178,
    # 208 GB/s; ~230 GB/s is the figure often quoted for DGX A100). Mid-range:
    # 220 GB/s. α: small all-reduces on 8 NVLink GPUs take some tens of µs in
    # those outputs, i.e. a few µs per ring step; 3 µs is assumed.
    "nvlink": Network(alpha_us=3.0, gbit_s=_gbytes(220.0)),
})


def network_preset(name: str) -> Network:
    """The α–β figures of a common interconnect, for predicting a schedule on
    hardware one does not have (see NETWORK_PRESETS for where each comes from)."""
    if not isinstance(name, str) or name not in NETWORK_PRESETS:
        raise ValueError(f"dearcomm: unknown network preset {name!r}; expected one of {sorted(NETWORK_PRESETS)}")
    return NETWORK_PRESETS[name]


# ---- the ring model -----------------------------------------------------------------

def ring_coefficients(kind: str, world_size: int, nbytes: float) -> Tuple[float, float]:
    """(a, b) with time = a·α + b·β, as csrc/sim/cost_model.cpp costs ``kind``
    of ``nbytes`` (the full buffer) over ``world_size`` ranks: kept in one
    place so that the fit and the simulator cannot drift apart."""
    passes = 2.0 if kind in ("all_reduce", ORDERED_ALL_REDUCE) else 1.0  # an all-reduce is RS + AG
    p = float(world_size)
    return passes * (p - 1), passes * (p - 1) / p * float(nbytes)


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured collective: ``time_us`` for ``op`` of ``bytes`` (the full
    buffer) over ``world_size`` ranks; ``source`` says where it came from."""
    op: str
    bytes: float
    time_us: float
    world_size: int
    source: str


@dataclasses.dataclass(frozen=True)
class KindFit:
    """The fitted α–β of one collective kind and how well it fits its rows."""
    kind: str
    alpha_us: float
    """Per ring step, µs."""
    gbit_s: float
    """1/β, Gbit/s."""
    r_squared: float
    """Of the fitted times against the measured times (unweighted)."""
    max_rel_error: float
    """max over the rows of |fitted − measured| / measured."""
    worst_row: Tuple[float, int]
    """(bytes, world size) of the row with that largest error."""
    n_rows: int
    world_sizes: Tuple[int, ...]

    def time_us(self, nbytes: float, world_size: int) -> float:
        """The fitted line: what the simulator would charge for this collective."""
        a, b = ring_coefficients(self.kind, world_size, nbytes)
        return a * self.alpha_us + b * 8.0 / (self.gbit_s * 1e3)

    @property
    def poor(self) -> bool:
        return self.max_rel_error > POOR_FIT_REL_ERROR


@dataclasses.dataclass(frozen=True)
class NetworkFit:
    """What fit_network() found: ``network`` for dearcomm.simulate (per_kind
    from each fit; alpha_us and gbit_s from the all-reduce fit, or the first
    kind fitted, for the kinds without rows) and, per kind, the fit quality."""
    network: Network
    kinds: Mapping[str, KindFit]
    sources: Tuple[str, ...]
    selection: str
    """Which rows were fitted, e.g. "impl 'dearcomm', every type"."""

    def table(self) -> str:
        """A printable table, one line per kind; a kind whose line misses a row
        by more than POOR_FIT_REL_ERROR is marked poor."""
        head = (f"# α–β fit of the rows ({self.selection}) of {', '.join(self.sources)}\n"
                f"{'kind':<16}{'rows':>5}  {'ranks':<9}{'alpha(us)':>10}{'Gbit/s':>10}{'R^2':>9}"
                f"{'max err':>9}  worst row")
        lines = [head]
        for fit in self.kinds.values():
            nbytes, p = fit.worst_row
            ranks = ",".join(str(w) for w in fit.world_sizes)
            lines.append(f"{fit.kind:<16}{fit.n_rows:>5}  {ranks:<9}{fit.alpha_us:>10.2f}{fit.gbit_s:>10.4g}"
                         f"{fit.r_squared:>9.4f}{fit.max_rel_error:>8.1%}  {_human_bytes(nbytes)} at {p} ranks"
                         f"{'  (poor)' if fit.poor else ''}")
        for fit in self.kinds.values():
            if fit.alpha_us == 0:
                lines.append(f"note: {fit.kind}'s α is at its bound 0: the sizes measured show no per-step latency "
                             f"(measure smaller sizes to see it)")
        lines.append(f"network = {_network_source(self.network)}")
        return "\n".join(lines)


def _network_source(network: Network) -> str:
    """The network as Python to paste, to 4 significant digits (the fit is
    not more precise than that)."""
    per_kind = ", ".join(f"{k!r}: ({a:.4g}, {g:.4g})" for k, (a, g) in network.per_kind.items())
    return f"Network(alpha_us={network.alpha_us:.4g}, gbit_s={network.gbit_s:.4g}, per_kind={{{per_kind}}})"


def _human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:g} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


# ---- reading measurements ----------------------------------------------------------

def _positive_finite(value, what: str) -> float:
    """Rejects what would make the fit meaningless: a zero, negative, NaN or
    infinite time or size (or a non-number) in a row."""
    _check_number(what, value, allow_zero=False)
    return float(value)


def _world_size(stated, given: Optional[int], where: str) -> int:
    """The row's world size: stated by its source, or else ``world_size``;
    both present and different is a mistake, not a choice."""
    if stated is None and given is None:
        raise ValueError(f"dearcomm: {where} states no world_size; pass world_size= or add it to the row")
    if stated is not None and given is not None and stated != given:
        raise ValueError(f"dearcomm: {where} states world_size {stated!r} but world_size={given!r} was passed")
    p = given if stated is None else stated
    if not isinstance(p, int) or isinstance(p, bool) or p < 2:
        raise ValueError(f"dearcomm: {where}: world_size must be an int >= 2, got {p!r}")
    return p


def _row(raw, where: str, world_size: Optional[int]) -> Row:
    if not isinstance(raw, Mapping):
        raise ValueError(f"dearcomm: {where} must be a dict with op, bytes, time_us, got {type(raw).__name__}")
    if "op" not in raw:
        raise ValueError(f"dearcomm: {where} has no 'op' (keys {sorted(raw)}); expected a row of "
                         f"benchmarks/collectives.py in sizes mode (not --fusion)")
    if raw["op"] not in COST_KINDS:
        raise ValueError(f"dearcomm: {where} has the unknown op {raw['op']!r}; expected one of {list(COST_KINDS)}")
    wrong = raw.get("wrong", 0)
    if wrong:
        raise ValueError(f"dearcomm: {where} has wrong = {wrong!r}: its collective gave wrong results, "
                         f"so its time is no measurement of a correct one; fix the run and measure again")
    for key in ("bytes", "time_us"):
        if key not in raw:
            raise ValueError(f"dearcomm: {where} has no {key!r}")
    return Row(op=raw["op"], bytes=_positive_finite(raw["bytes"], f"{where} bytes"),
               time_us=_positive_finite(raw["time_us"], f"{where} time_us"),
               world_size=_world_size(raw.get("world_size"), world_size, where), source=where)


@dataclasses.dataclass(frozen=True)
class _Selection:
    """Which of a benchmark's rows to fit: those of one implementation and,
    if given, one element type (the same bytes can cost differently per type
    where the reduction's arithmetic shows, and a mixed set then fits worse
    than either). A row that does not state the field is taken."""
    impl: str
    dtype: Optional[str]

    def takes(self, row) -> bool:
        if not isinstance(row, Mapping):
            return True  # _row() refuses it by name
        return row.get("impl", self.impl) == self.impl and (self.dtype is None or
                                                            row.get("type", self.dtype) == self.dtype)

    def __str__(self) -> str:
        return f"impl {self.impl!r}, " + ("every type" if self.dtype is None else f"type {self.dtype!r}")


def _rows_of_file(path: Path, select: _Selection, world_size: Optional[int]) -> List[Row]:
    """The selected rows of one ``collectives.py --json`` file."""
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"dearcomm: {path} is not JSON ({e}); expected the --json output of "
                         f"benchmarks/collectives.py") from None
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"dearcomm: {path} has no rows; expected the --json output of benchmarks/collectives.py "
                         f"(a dict with a non-empty 'rows' list)")
    stated = _world_size(doc.get("world_size"), world_size, str(path))
    picked = [(i, r) for i, r in enumerate(rows) if select.takes(r)]
    if not picked:
        found = sorted({(str(r.get("impl")), str(r.get("type"))) for r in rows if isinstance(r, Mapping)})
        raise ValueError(f"dearcomm: {path} has no row with {select}; it has (impl, type) {found}")
    return [_row(r, f"{path} row {i}", stated) for i, r in picked]


def _collect(measurements: Measurements, select: _Selection,
             world_size: Optional[int]) -> Tuple[List[Row], List[str]]:
    """Every row, from paths and/or row dicts, and the names of the sources."""
    if world_size is not None:
        _world_size(None, world_size, "fit_network()")
    items: Iterable = [measurements] if isinstance(measurements, (str, Path)) else measurements
    if isinstance(items, Mapping) or not isinstance(items, Iterable):
        raise ValueError(f"dearcomm: measurements must be a path, a list of paths or a list of row dicts, "
                         f"got {type(measurements).__name__}")
    rows: List[Row] = []
    sources: List[str] = []
    n_dicts = 0
    for i, item in enumerate(items):
        if isinstance(item, (str, Path)):
            rows += _rows_of_file(Path(item), select, world_size)
            sources.append(str(item))
        elif isinstance(item, Mapping):
            if select.takes(item):
                rows.append(_row(item, f"measurement {i}", world_size))
            n_dicts += 1
        else:
            raise ValueError(f"dearcomm: measurement {i} is a {type(item).__name__}; expected a path or a row dict")
    if n_dicts:
        sources.append(f"{n_dicts} given rows")
    if not rows:
        raise ValueError(f"dearcomm: no measurement to fit (an empty set, or no row with {select})")
    return rows, sources


# ---- fitting ------------------------------------------------------------------------

WEIGHTS = ("relative", "absolute")


class TimesDoNotGrow(ValueError):
    """A kind's times do not grow with its sizes: no bandwidth can be fitted
    (a stall made a small size slower than a large one, or sizes too close)."""


def _fit_kind(kind: str, rows: Sequence[Row], weights: str = "relative") -> KindFit:
    """Non-negative least squares of the ring model on one kind's rows.
    "relative": weighted by 1/time, each row counts by its relative error, so
    the largest buffer does not decide α alone (unweighted, a 64 MiB row's
    noise outweighs every small row, and the small rows are where α shows).
    "absolute": unweighted, the largest buffers decide β (see fit_network)."""
    sizes = sorted({r.bytes for r in rows})
    if len(sizes) < 2:
        raise ValueError(f"dearcomm: {kind} has {len(rows)} row(s) of {len(sizes)} distinct size(s) "
                         f"({[int(s) for s in sizes]}); at least 2 distinct sizes are needed to separate α from β")
    coef = np.array([ring_coefficients(kind, r.world_size, r.bytes) for r in rows])  # (a, b) per row
    t = np.array([r.time_us for r in rows])
    per_row = t if weights == "relative" else np.ones_like(t)  # each row's error divided by it
    A, target = coef / per_row[:, None], t / per_row
    scale = np.linalg.norm(A, axis=0)  # columns of similar norm, for a well-conditioned solve
    if abs(float(A[:, 0] @ A[:, 1])) / (scale[0] * scale[1]) > 1 - 1e-12:
        raise ValueError(f"dearcomm: the {kind} rows cannot separate α from β (their sizes and world sizes give "
                         f"proportional coefficients); measure more sizes")
    alpha_us, beta_us = nnls2(A / scale, target) / scale
    if beta_us <= 0:
        raise TimesDoNotGrow(f"dearcomm: the {kind} times do not grow with size ({len(rows)} rows); no bandwidth can "
                         f"be fitted. Measure larger sizes")
    fitted = coef @ np.array([alpha_us, beta_us])
    rel = np.abs(fitted - t) / t
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    ss_res = float(np.sum((fitted - t) ** 2))
    worst = int(np.argmax(rel))
    return KindFit(kind=kind, alpha_us=float(alpha_us), gbit_s=8.0 / (float(beta_us) * 1e3),
                   r_squared=1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0),
                   max_rel_error=float(rel[worst]), worst_row=(rows[worst].bytes, rows[worst].world_size),
                   n_rows=len(rows), world_sizes=tuple(sorted({r.world_size for r in rows})))


def fit_network(measurements: Measurements, world_size: Optional[int] = None, impl: str = "dearcomm",
                dtype: Optional[str] = None, weights: str = "relative") -> NetworkFit:
    """Fits α (µs per ring step) and bandwidth per collective kind to measured
    times, so that dearcomm.simulate charges what this cluster charges.

    measurements: a path to a ``benchmarks/collectives.py --json`` file, a list
        of such paths (world sizes may differ: each kind is fitted jointly over
        all of them), or a list of row dicts {"op", "bytes", "time_us",
        "world_size"}. ``bytes`` is the full buffer, as the benchmark and the
        simulator count it.
    world_size: for rows whose source states none (default None: every source
        states its own); a source stating another one is an error.
    impl: which rows of the benchmark's files to fit (default "dearcomm", the
        backend the engine runs; "torch" for torch.distributed's own calls).
    dtype: fit only the rows of this type ("fp32", "bf16", ...; default None:
        every type, as the simulator charges by bytes whatever the type).
    weights: "relative" (default) fits every row's time to the same relative
        error, for sizes spanning decades where α shows in the small ones;
        "absolute" fits the times themselves, so the largest sizes decide the
        bandwidth: what a planner that sums the times of 1-64 MiB buckets
        needs, and not misled by small transfers that a link passes faster
        than its rate (a token bucket's burst: tbf's 256 KB on the emulated
        1 Gbit/s link priced reduce-scatter about twice too fast, weighted).

    Raises ValueError, naming the row, for rows with wrong results, unknown
    ops, non-positive or non-finite sizes or times, world sizes < 2, files
    without rows, an empty set, and kinds with fewer than 2 distinct sizes.
    The fit quality is in the result (table(), kinds[...]): a poor fit is
    reported there, never refused.
    """
    if not isinstance(impl, str):
        raise ValueError(f"dearcomm: impl must be a str such as 'dearcomm' or 'torch', got {impl!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"dearcomm: weights must be one of {WEIGHTS}, got {weights!r}")
    if dtype is not None and not isinstance(dtype, str):
        raise ValueError(f"dearcomm: dtype must be None or a str such as 'fp32', got {dtype!r}")
    select = _Selection(impl, dtype)
    rows, sources = _collect(measurements, select, world_size)
    kinds = {kind: _fit_kind(kind, [r for r in rows if r.op == kind], weights) for kind in COST_KINDS
             if any(r.op == kind for r in rows)}
    main_fit = kinds.get("all_reduce") or next(iter(kinds.values()))
    network = Network(alpha_us=main_fit.alpha_us, gbit_s=main_fit.gbit_s,
                      per_kind={k: (f.alpha_us, f.gbit_s) for k, f in kinds.items()})
    return NetworkFit(network=network, kinds=types.MappingProxyType(kinds), sources=tuple(sources),
                      selection=str(select))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """python -m dearcomm.network_fit results/a.json [b.json ...]: prints the fit."""
    parser = argparse.ArgumentParser(description="Fit the α–β cost of collectives to benchmarks/collectives.py "
                                                 "--json output and print the fit.")
    parser.add_argument("paths", nargs="+", help="collectives.py --json files (world sizes may differ)")
    parser.add_argument("--impl", default="dearcomm", help="which rows to fit: dearcomm (default) or torch")
    parser.add_argument("--dtype", default=None, help="fit only rows of this type (fp32, bf16; default: all)")
    parser.add_argument("--world-size", type=int, default=None, help="for files that state none")
    args = parser.parse_args(argv)
    try:
        fit = fit_network(args.paths, world_size=args.world_size, impl=args.impl, dtype=args.dtype)
    except (ValueError, OSError) as e:
        parser.exit(2, f"{e}\n")
    print(fit.table())


if __name__ == "__main__":
    main()
