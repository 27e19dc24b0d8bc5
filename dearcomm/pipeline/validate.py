"""The checks every public entry point of the pipeline package makes on the
numbers it is given, in one place, so that a bad value (NaN, an infinity, a
negative cost, a fractional count) is refused where it enters, with a
`dearcomm:` error naming where it came from, the field and the value, instead
of poisoning the simulator's clock (a NaN time never compares equal to
itself, which once made the event loop spin forever).

`where` says whose field it is ("layer 'l0'", "topology 'x'",
"plan_pipeline()"); `kind`, if given, says what sort of number it is ("cost",
"bandwidth") and turns the message into "<where> has a negative cost: ...".
Wrong types (a string, None, a bool) raise TypeError, wrong values ValueError.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _defect(value: Any, integer: bool) -> str:
    """What is wrong with a value that failed a check, in one word or two."""
    if isinstance(value, bool):
        return "bool"
    if not isinstance(value, numbers.Real):
        return "non-numeric"
    if not _fits_a_float(value):
        return "huge"
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "infinite"
    if integer and not isinstance(value, numbers.Integral):
        return "non-integer"
    if value < 0:
        return "negative"
    return "zero" if value == 0 else "too small"


def _fail(value: Any, field: str, where: str, expected: str, kind: Optional[str], integer: bool) -> None:
    defect = _defect(value, integer)
    head = f"{where} has {_article(defect)} {defect} {kind}" if kind else where
    # Its size from its bits: str() of an int past 4300 digits raises in Python itself.
    got = f"an int of about {int(value.bit_length() * 0.30103) + 1} digits" if defect == "huge" else repr(value)
    message = f"dearcomm: {head}: {field} must be {expected}, got {got}"
    if defect in ("bool", "non-numeric"):
        raise TypeError(f"{message} (a {type(value).__name__})")
    raise ValueError(message)


def _fits_a_float(value: Any) -> bool:
    # An int past 1.8e308 (10**400) raises OverflowError in float arithmetic.
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _finite(value: Any) -> bool:
    return _fits_a_float(value) and math.isfinite(value)


def _is_real(value: Any) -> bool:
    # bool is an int to Python, but True as a time or a count is a mistake.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite_nonnegative(value: Any, field: str, where: str, kind: Optional[str] = None, note: str = "") -> None:
    """A time, a size, a bandwidth: any finite number >= 0."""
    if not (_is_real(value) and _finite(value) and value >= 0):
        _fail(value, field, where, ">= 0 and finite" + note, kind, integer=False)


def slowdown_factor(value: Any, field: str, where: str) -> None:
    """How many times longer something takes: any finite number >= 1 (1: not slowed)."""
    if not (_is_real(value) and _finite(value) and value >= 1):
        _fail(value, field, where, "a finite factor >= 1 (1: not slowed)", None, integer=False)


def finite_sum(values: Sequence[float], what: str, where: str) -> None:
    """Finite values whose total must be finite too (floats overflow near 1.8e308)."""
    total = sum(values)
    if not math.isfinite(total):
        raise ValueError(f"dearcomm: {where}: {what} add up to {total}; expected a finite total")


def finite_positive(value: Any, field: str, where: str, kind: Optional[str] = None) -> None:
    """A rate that must carry something: any finite number > 0."""
    if not (_is_real(value) and _finite(value) and value > 0):
        _fail(value, field, where, "> 0 and finite", kind, integer=False)


def int_at_least(value: Any, minimum: int, field: str, where: str) -> None:
    """A count: an int (not a bool, not a float, even 2.0) >= minimum."""
    if not (_is_real(value) and isinstance(value, numbers.Integral) and value >= minimum):
        expected = {0: "an integer >= 0", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        _fail(value, field, where, expected, None, integer=True)


def positive_int(value: Any, field: str, where: str) -> None:
    int_at_least(value, 1, field, where)


def nonnegative_int(value: Any, field: str, where: str) -> None:
    int_at_least(value, 0, field, where)


def optional_positive_int(value: Any, field: str, where: str) -> None:
    """A cap where None means "no cap"."""
    if value is not None:
        positive_int(value, field, where)


def instance(value: Any, cls: type, field: str, where: str) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"dearcomm: {where}: {field} must be a {cls.__name__}, got {type(value).__name__} "
                        f"{value!r:.80}")


def sequence(value: Any, field: str, where: str) -> None:
    """A list, a tuple or an array of entries (a str is a sequence too, but never meant)."""
    if isinstance(value, (str, bytes)) or not (isinstance(value, Sequence) or hasattr(value, "__array__")):
        raise TypeError(f"dearcomm: {where}: {field} must be a list or tuple, got {type(value).__name__} "
                        f"{value!r:.80}")


def stage_bounds(bounds: Any, where: str) -> None:
    """Stage boundaries: a sequence of layer indices (their order is the plan's check)."""
    sequence(bounds, "bounds", where)
    for i, b in enumerate(bounds):
        nonnegative_int(b, f"bounds[{i}]", where)


def stage_devices(devices: Any, where: str) -> None:
    """Devices per stage: a sequence of non-empty sequences of device indices."""
    sequence(devices, "devices", where)
    for s, group in enumerate(devices):
        sequence(group, f"devices[{s}]", where)
        if len(group) == 0:
            raise ValueError(f"dearcomm: {where}: stage {s} has no device; expected at least one per stage")
        for i, d in enumerate(group):
            nonnegative_int(d, f"devices[{s}][{i}]", where)


def problem(profile: Any, topology: Any, where: str) -> None:
    """The (profile, topology) pair every planner and simulator call takes."""
    from .profile import ModelProfile
    from .topology import Topology
    instance(profile, ModelProfile, "profile", where)
    instance(topology, Topology, "topology", where)
