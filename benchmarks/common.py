"""What every benchmark measures and reports the same way: timing, medians, tables, JSON.

- :class:`Timer` times a block: wall seconds (``perf_counter``) and this process's CPU
  seconds (every thread); optionally it profiles the block with cProfile.
- :func:`time_reps` is the repetition loop: untimed warm-up runs, then ``reps`` timed runs,
  with a hook before each run (a barrier) and one that turns a rank's seconds into the job's
  (the slowest rank's).
- :func:`summary`, :func:`percentile`, :func:`slowest`, :func:`median_of_slowest`: the
  statistics the reports print (medians, spread, the slowest rank per repetition).
- :func:`table_head` / :func:`table_row` (markdown), :func:`text_table` (aligned columns for
  a terminal), :func:`target_line` (one target, met or not) and :func:`write_json`.

Not here: what a benchmark measures (its state dict, scenarios and targets: ``bench_*.py``,
``dcp_*.py``).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

__all__ = ["Timer", "cpu_seconds", "time_reps", "summary", "percentile", "slowest", "median_of_slowest",
           "table_head", "table_row", "text_table", "target_line", "write_json"]


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Timer:
    """Times a ``with`` block: :attr:`wall_s` (``perf_counter``) and :attr:`cpu_s` (this process).

    Args:
        profile: a file path: also profile the block with cProfile (the calling thread) and
            write there the top functions by own and by cumulative time.

    Example::

        with Timer() as t:
            save(sd, path)
        print(t.wall_s, t.cpu_s)
    """

    def __init__(self, profile: str | None = None):
        self.profile = profile
        self.wall_s = self.cpu_s = 0.0
        self._prof: Any = None

    @property
    def seconds(self) -> float:
        """:attr:`wall_s`."""
        return self.wall_s

    def __enter__(self) -> Timer:
        if self.profile:
            import cProfile

            self._prof = cProfile.Profile()
            self._prof.enable()
        self._c0 = cpu_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.cpu_s = cpu_seconds() - self._c0
        if self._prof is not None:
            import io
            import pstats

            self._prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(self._prof, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(30)
            with open(self.profile, "w") as f:
                f.write(text.getvalue())


def time_reps(fn: Callable[[], Any], reps: int, *, warmup: int = 0, before: Callable[[], Any] | None = None,
              reduce: Callable[[float], float] | None = None) -> list[float]:
    """Wall seconds of ``reps`` runs of ``fn``, after ``warmup`` untimed ones.

    Args:
        before: called before every run, outside the timing (e.g. a barrier).
        reduce: maps this process's seconds to the figure kept (e.g. the max over ranks).
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        out.append(reduce(seconds) if reduce is not None else seconds)
    return out


def summary(values: Iterable[float]) -> dict[str, float | list[float]]:
    """Median and spread (min–max) of repeated measurements."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "values": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    vals = sorted(values)
    return vals[min(len(vals) - 1, int(round(q * (len(vals) - 1))))]


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per repetition, the slowest rank's seconds (``per_rank[rank][rep]``)."""
    return [max(vals) for vals in zip(*per_rank, strict=True)]


def median_of_slowest(per_rank: Sequence[Sequence[float]]) -> float:
    """The median over repetitions of the slowest rank: how long the job waited, typically."""
    return statistics.median(slowest(per_rank))


def table_head(*columns: str) -> list[str]:
    """A markdown table's header and separator lines."""
    return [table_row(*columns), "|" + "---|" * len(columns)]


def table_row(*cells: Any) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def text_table(header: Sequence[str], rows: Iterable[Sequence[Any]], indent: int = 2) -> str:
    """Aligned columns for a terminal: the first left-aligned, the others right-aligned."""
    lines = [[str(c) for c in header], *([str(c) for c in r] for r in rows)]
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(lines[0]))]
    out = []
    for line in lines:
        cells = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(line)]
        out.append(" " * indent + "  ".join(cells).rstrip())
    return "\n".join(out)


def target_line(t: dict) -> str:
    """``  [met    ] <target>: <detail>`` for a target dict with ``met`` (True, False or None)."""
    mark = {True: "met    ", False: "NOT met", None: "n/a    "}[t["met"]]
    return f"  [{mark}] {t['target']}: {t['detail']}"


def write_json(path: str | os.PathLike, doc: Any) -> None:
    """``doc`` as indented JSON (what is not JSON written as its ``str``)."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def bar_chart(path: str | os.PathLike, title: str, bars: Sequence[tuple[str, float]], unit: str,
              note: str = "") -> str | None:
    """A horizontal bar chart (PNG) of ``bars`` (label, value), for the docs' performance page.

    Returns the path, or None when matplotlib (a dev extra) is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(bars) + 1.4))
    labels = [label for label, _ in bars]
    values = [value for _, value in bars]
    ax.barh(range(len(bars)), values, color="#3f51b5")
    ax.set_yticks(range(len(bars)), labels)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
    ax.set_xlim(0, max(values, default=1) * 1.15 or 1)  # room for the value labels
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=10)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.fspath(path)
