"""Kill points: named places in every write sequence where a test can kill the process.

Crash safety is tested, not assumed: each write, rename and delete that leantune makes into a
user's folder first calls `point(label)`. In normal runs this is a dictionary lookup and nothing
else. A test sets, in the environment of a child process:

    LEANTUNE_FAULT_TRACE=FILE   append one line per kill point reached ("<n>\t<label>")
    LEANTUNE_KILL_AT=N          SIGKILL the process at the N-th kill point reached (1-based)
    LEANTUNE_KILL_LABEL=TEXT    ... counting only points whose label contains TEXT

so a test can first record every point a command passes, then kill it at each one in turn and
check that the next command (a --resume, a retry, an export) finds every file it needs.
"""

from __future__ import annotations

import os
import signal

_count = 0


def point(label: str) -> None:
    """A place where a kill must leave the user's files recoverable (see the module doc)."""
    env = os.environ
    if "LEANTUNE_KILL_AT" not in env and "LEANTUNE_FAULT_TRACE" not in env:
        return
    only = env.get("LEANTUNE_KILL_LABEL")
    if only and only not in label:
        return
    global _count
    _count += 1
    trace = env.get("LEANTUNE_FAULT_TRACE")
    if trace:
        with open(trace, "a") as f:
            f.write(f"{_count}\t{label}\n")
    kill_at = env.get("LEANTUNE_KILL_AT")
    if kill_at and int(kill_at) == _count:
        os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    """Start counting again (a forked test child)."""
    global _count
    _count = 0
