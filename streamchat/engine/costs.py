"""What a step costs: a model of step time the scheduler learns from the steps it runs.

Owns one small linear model, fitted online by exponentially weighted least
squares over the recent steps:

    seconds ~ fixed + per_token * tokens + per_pair * pairs

`tokens` drives the weight matrix products, `pairs` (query-key pairs: a
chunk of n tokens over c cached ones has n * (c + n), a decode row 1 * c)
drives attention. The fit starts from priors (roughly right for a 135M model
on two CPU cores) and follows the machine, the model and the kernels it
runs on as they are, so the scheduler can fill a step to a time target.
Torch-free and I/O-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR = (0.010, 0.002, 5e-7)  # seconds: per step, per token, per query-key pair
PRIOR_WEIGHT = 0.5  # the priors count as this many steps' worth of evidence
FORGET = 0.97  # each step's weight decays by this per later step


@dataclass
class StepCosts:
    fixed: float = PRIOR[0]
    per_token: float = PRIOR[1]
    per_pair: float = PRIOR[2]
    num_observed: int = 0
    # weighted normal equations over (1, tokens, pairs) against seconds, priors included
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)

    def estimate(self, tokens: int, pairs: int) -> float:
        """Seconds a step of `tokens` tokens and `pairs` query-key pairs should take."""
        return self.fixed + self.per_token * tokens + self.per_pair * pairs

    def tokens_within(self, seconds: float, context: int) -> int:
        """The largest chunk n over `context` cached tokens whose marginal cost fits `seconds`.

        per_token * n + per_pair * n * (context + n) <= seconds, solved for n.
        """
        a, b = self.per_pair, self.per_token + self.per_pair * context
        if seconds <= 0:
            return 0
        if a <= 0:
            return int(seconds / b) if b > 0 else 1 << 30
        n = (-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a)
        return max(0, int(n))

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        """Fold one measured step into the fit."""
        x = (1.0, float(tokens), float(pairs))
        for i in range(3):
            self._xty[i] = self._xty[i] * FORGET + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = self._xtx[i][j] * FORGET + x[i] * x[j]
        self.num_observed += 1
        self._solve()

    def _solve(self) -> None:
        # ridge toward the priors, scaled per coefficient so each prior weighs PRIOR_WEIGHT steps
        scale = [1.0, max(self._xtx[1][1], 1.0) / max(self.num_observed, 1),
                 max(self._xtx[2][2], 1.0) / max(self.num_observed, 1)]
        m = [[self._xtx[i][j] + (PRIOR_WEIGHT * scale[i] if i == j else 0.0) for j in range(3)]
             for i in range(3)]
        y = [self._xty[i] + PRIOR_WEIGHT * scale[i] * PRIOR[i] for i in range(3)]
        sol = _solve3(m, y)
        if sol is not None:
            # costs are never negative: a noisy fit must not promise free work
            self.fixed, self.per_token, self.per_pair = (max(v, 0.0) for v in sol)


def _solve3(m: list[list[float]], y: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    a = [row[:] + [y[i]] for i, row in enumerate(m)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                for c in range(col, 4):
                    a[r][c] -= f * a[col][c]
    return tuple(a[i][3] / a[i][i] for i in range(3))
