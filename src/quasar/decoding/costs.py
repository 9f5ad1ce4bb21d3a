"""What a forward costs as a function of its rows, measured as it runs: the batch weighs draft rows with it and
the draft length chooses k by it (quasar.decoding.batch, quasar.decoding.speculative)."""

from __future__ import annotations


class CostModel:
    """What a forward costs as a function of its rows, fitted on the recent ones: seconds ~ a + b * rows by
    least squares with exponentially decaying weights, so it follows the batch and the machine as they change.
    (Default model, W8A8, kernels:dpbusd: a ~ 5 ms, the weights' read; b ~ 0.5-1 ms, a row's compute.)"""

    DECAY, MIN_WEIGHT, MIN_SPREAD, PRIOR = 0.97, 4.0, 0.5, 0.125

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.last: tuple[float, float] | None = None

    def add(self, rows: int, seconds: float) -> None:
        d = self.DECAY
        self.w, self.x, self.y = d * self.w + 1, d * self.x + rows, d * self.y + seconds
        self.xx, self.xy = d * self.xx + rows * rows, d * self.xy + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b) from the recent forwards; while they hardly vary in rows, the last fit that could tell them
        apart (None before there is one)."""
        if self.w >= self.MIN_WEIGHT:
            mx, my = self.x / self.w, self.y / self.w
            spread = self.xx / self.w - mx * mx
            if spread >= self.MIN_SPREAD:
                b = max(0.0, (self.xy / self.w - mx * my) / spread)
                self.last = (max(0.0, my - b * mx), b)
        return self.last

    def pays(self, value: float, tokens: float, rows: int) -> bool:
        """Whether one more row worth `value` expected tokens raises the tokens per second of a forward that
        now holds `rows` rows worth `tokens`: value / b > tokens / (a + b * rows). Before the first fit, a row
        is taken to cost PRIOR of the weights' read (about what it does on the default model)."""
        a, b = self.fit() or (1.0, self.PRIOR)
        return value * (a + b * rows) > b * tokens


class StepCosts(CostModel):
    """A CostModel that also keeps the recent mean time of each step size it has seen (decaying like the fit): CPU
    kernels work in tiles of rows, so a verify step of 2 or 4 rows may cost what one of 1 does, which a line
    through all sizes misses. `cost(rows)` is that size's own mean once it was timed MIN_SEEN times, else the line
    (before the line exists, the prior line a + PRIOR * a * rows through the size seen most; None before any
    step)."""

    MIN_SEEN = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, float] = {}  # rows -> decayed count of steps of that size
        self.total: dict[int, float] = {}  # rows -> decayed sum of their seconds

    def add(self, rows: int, seconds: float) -> None:
        super().add(rows, seconds)
        self.seen[rows] = self.DECAY * self.seen.get(rows, 0.0) + 1
        self.total[rows] = self.DECAY * self.total.get(rows, 0.0) + seconds

    def cost(self, rows: int) -> float | None:
        if self.seen.get(rows, 0.0) >= self.MIN_SEEN:
            return self.total[rows] / self.seen[rows]
        line = self.fit()
        if line is not None:
            return line[0] + line[1] * rows
        if not self.seen:
            return None
        known = max(self.seen, key=self.seen.__getitem__)
        return self.total[known] / self.seen[known] * (1 + self.PRIOR * rows) / (1 + self.PRIOR * known)
