"""Non-negative least squares for two unknowns (the α–β fit of the network
and the host CPU's per-collective and per-MiB fit share it)."""
import numpy as np


def nnls2(A: np.ndarray, t: np.ndarray) -> np.ndarray:
    """min |A x − t| with x ≥ 0 for two unknowns: the unconstrained solution if
    it is feasible, otherwise the best one with a variable at zero (for two
    unknowns the constrained optimum lies on one of those boundaries)."""
    x, *_ = np.linalg.lstsq(A, t, rcond=None)
    if (x >= 0).all():
        return x
    candidates = []
    for keep in (0, 1):
        col = A[:, keep]
        value = max(0.0, float(col @ t) / float(col @ col))
        x = np.zeros(2)
        x[keep] = value
        candidates.append((float(np.sum((A @ x - t) ** 2)), x))
    return min(candidates, key=lambda c: c[0])[1]
