"""The guard's per-round session: which guard is active, what it reported, how many steps ran.

A Flower mod (``flguard.flower.guard_mod``) opens one ``GuardSession`` while a *train* message is
handled; the training code underneath — ``make_guarded``'s optimizer or the functional
``guard_step`` — finds it here and files a report for every step it guarded. Every
``torch.optim.Optimizer.step()`` taken while the session is open is counted by one global
optimizer hook, so the mod can tell a round whose every step was guarded from one that guarded
some steps and not others. The session lives in a context variable: each Flower handler (and
each thread) sees only its own.

This module sits at the guard's level (no Flower import), so the drop-in optimizer can use it
and the Flower layer can build on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from flguard.guard import Guard
from flguard.guard.report import GuardReport


@dataclass
class GuardSession:
    """The guard of one train message and what happened under it.

    ``optimizer_steps`` counts every ``Optimizer.step()`` call that ran while the session was
    active (a guarded optimizer's inner step included); ``guarded_steps`` counts the steps whose
    gradient went through the guard. They agree when — and only when — every optimizer step was
    guarded.
    """

    guard: Guard
    reports: list[GuardReport] = field(default_factory=list)
    optimizer_steps: int = 0
    guarded_steps: int = 0

    def file(self, report: GuardReport) -> None:
        """Record one guarded step's report."""
        self.reports.append(report)
        self.guarded_steps += 1

    def unguarded_steps(self) -> int:
        """Optimizer steps the guard never saw (0 for a loop without an optimizer)."""
        return max(self.optimizer_steps - self.guarded_steps, 0)


_ACTIVE: contextvars.ContextVar[GuardSession | None] = contextvars.ContextVar("flguard_guard_session", default=None)
_HOOK_LOCK = threading.Lock()
_HOOK_INSTALLED = False


def active_session() -> GuardSession | None:
    """The session of the train message being handled, if any."""
    return _ACTIVE.get()


def _count_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    session = _ACTIVE.get()
    if session is not None:
        session.optimizer_steps += 1


def _install_step_counter() -> None:
    """One process-wide post-step hook on every torch optimizer (installed once, on first use)."""
    global _HOOK_INSTALLED
    with _HOOK_LOCK:
        if not _HOOK_INSTALLED:
            register_optimizer_step_post_hook(_count_step)
            _HOOK_INSTALLED = True


@contextlib.contextmanager
def open_session(guard: Guard) -> Iterator[GuardSession]:
    """Make a fresh session for ``guard`` active for the duration of the block."""
    _install_step_counter()
    session = GuardSession(guard)
    token = _ACTIVE.set(session)
    try:
        yield session
    finally:
        _ACTIVE.reset(token)
