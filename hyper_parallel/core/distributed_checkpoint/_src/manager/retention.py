"""Retention: which committed steps a CheckpointManager keeps, which it deletes, which files stay.

Kept after each commit (never before): the newest ``keep_latest`` committed steps, every step
divisible by ``keep_every_steps``, the ``keep_best`` best steps by ``best_metric``, always the
newest committed step and the steps a caller protects (the one being saved, the one about to
load); with no rule set, every step is kept (:func:`plan_retention`, pure).

A deleted step's files that a kept step still names (an incremental step reads its unchanged
chunks from earlier steps' files) stay in its directory, without ``.metadata``, until nothing
names them (:class:`Retention` remembers who names what). Retention never deletes what a save
did not write: it hands whole steps, minus those files, to the deleter; a failed save's
leftovers and the start-up sweep keep them too.

While a step's ``.metadata`` cannot be read (corrupt, or written by a newer release), what it
names is unknown: every step directory present when the manager started is then kept whole
(:meth:`Retention.doubt`), never swept, retired or cleaned, until a restart finds no such step.

It decides; it does not delete (:mod:`.step_deletion`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from ..base.options import RetentionOptions
from ..format import metadata as md
from ..format.metadata import step_dir_name
from .step_listing import step_of_name

__all__ = ["Retention", "best_steps", "plan_retention"]


def plan_retention(
    steps: dict[int, dict[str, Any] | None],
    rules: RetentionOptions,
    *,
    protect: Iterable[int] = (),
    references: Callable[[int], Iterable[int]] = lambda step: (),
) -> list[int]:
    """The committed steps to delete: those no rule of ``rules`` keeps (pure; the manager's policy).

    Kept: the newest ``keep_latest``; every step divisible by ``keep_every_steps``; the
    ``keep_best`` best by ``steps[step][best_metric]`` (``best_mode`` "min" or "max"; steps
    without a finite number for it do not compete; ties go to the newer step); the newest
    step; ``protect``; and, transitively, every step a kept step ``references``. With no rule
    set, nothing is deleted.
    """
    r = rules
    if not steps or (r.keep_latest is None and r.keep_every_steps is None and r.keep_best is None):
        return []
    order = sorted(steps)
    keep = {order[-1], *protect}
    if r.keep_latest is not None:
        keep.update(order[-r.keep_latest:] if r.keep_latest > 0 else [])
    if r.keep_every_steps is not None:
        keep.update(s for s in order if s % r.keep_every_steps == 0)
    if r.keep_best is not None and r.best_metric is not None:
        keep.update(best_steps(steps, r.best_metric, r.best_mode)[:r.keep_best])
    todo = list(keep)
    while todo:  # a kept step keeps every step ``references`` says it needs
        for ref in references(todo.pop()):
            if ref in steps and ref not in keep:
                keep.add(ref)
                todo.append(ref)
    return [s for s in order if s not in keep]


def _metric_value(metrics: dict[str, Any] | None, name: str) -> float | None:
    value = metrics.get(name) if isinstance(metrics, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def best_steps(steps: dict[int, dict[str, Any] | None], metric: str, mode: str) -> list[int]:
    """Steps with a finite ``metric``, best first (ties: the newer step first)."""
    scored = [(v, s) for s, m in steps.items() if (v := _metric_value(m, metric)) is not None]
    sign = 1.0 if mode == "min" else -1.0
    return [s for _, s in sorted(scored, key=lambda vs: (sign * vs[0], -vs[1]))]


def named_elsewhere(meta: md.Metadata) -> frozenset[tuple[str, str]]:
    """(step directory, file) of every file of another step that ``meta`` names."""
    return frozenset((f.dir, f.name) for f in meta.files if f.dir)


class Retention:
    """A manager's retention rules, and (on the coordinator) the files of other steps that
    committed steps name, so that deleting a step never deletes what a kept step reads."""

    def __init__(self, rules: RetentionOptions):
        self.rules = rules
        self.refs: dict[int, frozenset[tuple[str, str]]] = {}  # step -> files of other steps it names
        # the same, by the directory named: dir -> file -> how many committed steps name it, so that
        # asking for one directory's kept files does not walk every step's references (1,000 steps)
        self._named: dict[str, dict[str, int]] = {}
        self.lingering: set[str] = set()  # deleted steps' directories kept for files later steps name
        self.doubted: frozenset[str] = frozenset()  # step directories an unreadable step may name: kept whole

    def doubt(self, names: Iterable[str]) -> None:
        """A step that cannot be read may name files of any of the step directories ``names``
        (those present when it was found): none of them is deleted, in whole or in part."""
        self.doubted = self.doubted | frozenset(names)

    def in_doubt(self, name: str) -> bool:
        """Whether step directory ``name`` is kept whole for an unreadable step (see :meth:`doubt`)."""
        return name in self.doubted

    def learn(self, step: int, meta: md.Metadata) -> None:
        """Committed ``step`` (its metadata ``meta``) names the files it names."""
        self._drop(step)
        self.refs[step] = refs = named_elsewhere(meta)
        for d, f in refs:
            files = self._named.setdefault(d, {})
            files[f] = files.get(f, 0) + 1

    def _drop(self, step: int) -> None:
        for d, f in self.refs.pop(step, ()):
            files = self._named[d]
            files[f] -= 1
            if not files[f]:
                del files[f]
                if not files:
                    del self._named[d]

    def kept_files(self, name: str) -> tuple[str, ...]:
        """Files of step directory ``name`` that some committed step's metadata names."""
        return tuple(sorted(self._named.get(name, ())))

    def referenced_files(self, meta: md.Metadata) -> list[str]:
        """A committed step's own files, and the files of its directory later steps name."""
        own = step_of_name(meta)
        return sorted(set(meta.file_names()) | set(self.kept_files(own) if own else ()))

    def best(self, steps: dict[int, dict[str, Any] | None]) -> int | None:
        """The best step by ``best_metric`` (None without a metric or a scored step)."""
        if not self.rules.best_metric:
            return None
        ranked = best_steps(steps, self.rules.best_metric, self.rules.best_mode)
        return ranked[0] if ranked else None

    def plan(self, steps: dict[int, dict[str, Any] | None], protect: set[int]) -> list[int]:
        """The committed steps to delete now (never ``protect``)."""
        # Steps named by a kept step are not kept whole: only the files it names survive their
        # step's deletion (see kept_files), so retention counts steps, not references.
        protect = protect | {s for s in steps if self.in_doubt(step_dir_name(s))}
        return plan_retention(steps, self.rules, protect=protect)

    def forget(self, doomed: list[int]) -> tuple[list[tuple[int, tuple[str, ...]]], list[str]]:
        """Steps ``doomed`` go: ``(step, files of it to keep)`` for each, and the directories of
        steps deleted earlier that nothing names any more (to remove whole)."""
        for s in doomed:
            self._drop(s)
        # a deleted step's files that kept steps still name stay (incremental checkpoints);
        # directories kept only for such files go once nothing names them any more
        delete = [(s, self.kept_files(step_dir_name(s))) for s in doomed]
        self.lingering.update(step_dir_name(s) for s, keep in delete if keep)
        release = [n for n in self.lingering if not self.kept_files(n)]
        self.lingering.difference_update(release)
        return delete, release
