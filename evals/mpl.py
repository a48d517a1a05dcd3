"""matplotlib for the reports (evals/report.py, evals/trends.py), imported quietly.

On its first import in a fresh environment (no font cache in $MPLCONFIGDIR, e.g. a new machine or CI
container) matplotlib builds its font list and logs "generated new fontManager" at INFO, which under
run.py's logging became the first line of a run's output. Its font_manager logger is set to WARNING here,
before matplotlib is imported (its warnings still show). The Agg canvas is used directly: no GUI backend,
no pyplot state.
"""

from __future__ import annotations

import logging

logging.getLogger("matplotlib.font_manager").setLevel(logging.WARNING)

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.dates import AutoDateLocator, DateFormatter  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["AutoDateLocator", "DateFormatter", "Figure", "FigureCanvasAgg"]
