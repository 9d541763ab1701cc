"""Charts: matplotlib without a display, and where a section's PNG goes.

A section draws its own chart (its figure's layout is the section's business) and
imports `plt` and `save` from here inside its chart function, so importing a section
never loads matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.harness import report

__all__ = ["plt", "save"]


def save(figure: Any, result: report.SectionResult, *, dpi: int) -> Path:
    """The section's chart beside its results (`<section>.png`, `-quick` when scaled down)."""
    figure.tight_layout()
    stem = result.section + ("-quick" if result.quick else "")
    path = report.RESULTS_DIR / f"{stem}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path
