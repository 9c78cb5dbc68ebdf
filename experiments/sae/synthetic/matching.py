"""``linear_sum_assignment``: the minimum-cost one-to-one matching of a rectangular cost matrix (the Hungarian
method, shortest augmenting paths with potentials, O(n^2 m)). The project does not depend on scipy; this gives the
optimum scipy's ``linear_sum_assignment`` gives (the same total cost; on ties the pairs may differ).
"""

from __future__ import annotations

import numpy as np


def linear_sum_assignment(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row and column indices of a minimum-cost matching (``min(n, m)`` pairs, rows ascending), as scipy's.

    Example:
        >>> rows, cols = linear_sum_assignment(np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]]))
        >>> rows.tolist(), cols.tolist()
        ([0, 1, 2], [1, 0, 2])
    """
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2:
        raise ValueError(f"a cost matrix is 2-D; got shape {cost.shape}")
    if not np.isfinite(cost).all():
        raise ValueError("the cost matrix holds a NaN or an infinity")
    if cost.shape[0] > cost.shape[1]:
        cols, rows = linear_sum_assignment(cost.T)
        order = np.argsort(rows)
        return rows[order], cols[order]
    n, m = cost.shape
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    u, v = np.zeros(n + 1), np.zeros(m + 1)
    row_of_col = np.zeros(m + 1, dtype=np.int64)  # 1-based rows; 0: the column is free
    way = np.zeros(m + 1, dtype=np.int64)
    free_rows = range(1, n + 1)
    if n == m:  # column reduction (Jonker-Volgenant): each column's cheapest row, taken where no other column has
        # taken it; feasible potentials (u = 0, v = column minima) tight on those pairs, so only the rest augment
        best = cost.argmin(axis=0)
        v[1:] = cost[best, np.arange(m)]
        taken = np.zeros(n, dtype=bool)
        for j, i in enumerate(best):
            if not taken[i]:
                taken[i] = True
                row_of_col[j + 1] = i + 1
        free_rows = (np.nonzero(~taken)[0] + 1).tolist()
    for i in free_rows:
        row_of_col[0] = i
        j0 = 0
        minv = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = row_of_col[j0]
            free = ~used[1:]
            reduced = cost[i0 - 1] - u[i0] - v[1:]
            better = free & (reduced < minv[1:])
            minv[1:][better] = reduced[better]
            way[1:][better] = j0
            candidates = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(candidates)) + 1
            delta = candidates[j1 - 1]
            u[row_of_col[used]] += delta
            v[used] -= delta
            minv[1:][free] -= delta
            j0 = j1
            if row_of_col[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            row_of_col[j0] = row_of_col[j1]
            j0 = j1
    assigned = np.nonzero(row_of_col[1:])[0]
    rows = row_of_col[1:][assigned] - 1
    order = np.argsort(rows)
    return rows[order], assigned[order]
