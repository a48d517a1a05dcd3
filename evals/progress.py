"""Progress of a phase over requests: a tqdm bar on a terminal, plain lines in a log (CI, nohup, a pipe).

The evaluator labels lm-eval's prompt building with it and the application's lm-eval model its generation.
"""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm


def progress_bar(total: int, initial: int = 0, *, desc: str, show: bool = True) -> tqdm | LineProgress:
    """The progress of a phase over `total` requests (`initial` already done), labelled `desc`: a tqdm bar
    on a terminal, plain lines on stderr elsewhere (:class:`LineProgress`: a log file gets no
    carriage-return redraws), nothing when `show` is False. A context manager with ``update(n)``."""
    if show and not sys.stderr.isatty():
        return LineProgress(total, initial, desc=desc)
    return tqdm(total=total, initial=initial, disable=not show, desc=desc, unit="req", dynamic_ncols=True)


class LineProgress:
    """Progress for a stream that is not a terminal (CI logs, nohup, a pipe): one plain line at most every
    `interval` seconds and one at the end, e.g. ``generate: 400/1319 requests (30.3%), 85 s``. Same use as
    the tqdm bar (context manager, update(n))."""

    def __init__(self, total: int, initial: int = 0, *, desc: str, interval: float = 30.0, file=None):
        self.total, self.n, self.desc, self.interval = total, initial, desc, interval
        self.file = file if file is not None else sys.stderr
        self.t0 = self.last = time.monotonic()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc) -> None:
        self._line()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._line()

    def _line(self) -> None:
        self.last = time.monotonic()
        pct = 100.0 * self.n / self.total if self.total else 100.0
        print(f"{self.desc}: {self.n}/{self.total} requests ({pct:.1f}%), {self.last - self.t0:.0f} s",
              file=self.file, flush=True)
