"""Stopping by signal: SIGTERM (a cluster's preemption, `kill`) is handled like Ctrl-C.

Within `as_interrupts()` Ctrl-C raises `KeyboardInterrupt` and SIGTERM `Terminated` (a
`KeyboardInterrupt`), so every `except KeyboardInterrupt` that checkpoints a run handles both.
Exit codes follow the shell's 128 + signal number: 130 for Ctrl-C (SIGINT), 143 for SIGTERM.

A signal can land anywhere, and some code does not let the exception through: Python ignores
one raised in a finaliser (`__del__`, printing "Exception ignored in ..."), and libraries turn it
into another error while they import. So each signal is also noted (`received`), one ignored in
a finaliser is delivered again (silently) outside it, and the command reports an error that
follows a signal as the interruption it was.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived."""


_received: list[int] = []  # signals that arrived within `as_interrupts`
_previous_hook: list = []  # sys.unraisablehook outside each `as_interrupts` block


def exit_code(interrupt: BaseException) -> int:
    return 143 if isinstance(interrupt, Terminated) else 130


def describe(interrupt: BaseException) -> str:
    return "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted (Ctrl-C)"


def received() -> KeyboardInterrupt | None:
    """The first signal noted in the outermost `as_interrupts` block so far, as its exception."""
    if not _received:
        return None
    return Terminated() if _received[0] == signal.SIGTERM else KeyboardInterrupt()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise(signum, frame):
    _received.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def _unraisable(args):
    """An interrupt raised inside a finaliser cannot propagate: deliver it again a moment later
    (from a timer thread, so that it lands outside), without Python's "Exception ignored"
    report. Anything else goes to the hook that was there before."""
    if isinstance(args.exc_value, KeyboardInterrupt):
        signum = signal.SIGTERM if isinstance(args.exc_value, Terminated) else signal.SIGINT
        main = threading.main_thread().ident
        timer = threading.Timer(0.001, signal.pthread_kill, (main, signum))
        timer.daemon = True
        timer.start()
        return
    _previous_hook[-1](args)


@contextlib.contextmanager
def as_interrupts():
    """Within the block, Ctrl-C and SIGTERM raise (and are noted); outside the main thread: no
    change. Blocks nest; the outermost one starts with nothing noted."""
    if not _in_main_thread():
        yield
        return
    if not _previous_hook:
        _received.clear()
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGINT, signal.SIGTERM)}
    _previous_hook.append(sys.unraisablehook)
    sys.unraisablehook = _unraisable
    try:
        yield
    finally:
        sys.unraisablehook = _previous_hook.pop()
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred():
    """Hold off Ctrl-C and SIGTERM until the block (a few renames that must not be cut halfway)
    is done; one that arrived meanwhile is raised after it."""
    if not _in_main_thread():
        yield
        return
    got: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if got:
        _received.append(got[0])
        raise Terminated() if got[0] == signal.SIGTERM else KeyboardInterrupt()


def exit_quietly_on_signal() -> None:
    """From now on a Ctrl-C or SIGTERM ends the process at once with its exit code, without a
    traceback: for the moments after the command has answered (interpreter shutdown, waiting on
    download threads), when one more Ctrl-C means "just stop"."""
    if not _in_main_thread():
        return
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(143))
