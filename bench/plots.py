"""Shared plotting plumbing for the benchmark scripts: headless matplotlib and one way to save."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display on CI or servers); imported only when plotting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: str, name: str) -> str:
    """Write `fig` as `out/name` (creating `out`), close it, and return the path."""
    Path(out).mkdir(parents=True, exist_ok=True)
    path = str(Path(out) / name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
