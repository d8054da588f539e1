"""The signal plumbing: SIGTERM as an interrupt, and signals held off during renames."""

import os
import signal
import time

import pytest

from leantune.utils import signals


def test_sigterm_raises_terminated_inside_the_block_only():
    before = signal.getsignal(signal.SIGTERM)
    with signals.as_interrupts():
        assert signals.received() is None
        with pytest.raises(signals.Terminated) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert isinstance(signals.received(), signals.Terminated)  # noted
    assert isinstance(e.value, KeyboardInterrupt)  # handled wherever Ctrl-C is
    assert signals.exit_code(e.value) == 143 and signals.exit_code(KeyboardInterrupt()) == 130
    assert signal.getsignal(signal.SIGTERM) is before
    with signals.as_interrupts():
        assert signals.received() is None  # a new outermost block starts clean


def test_an_interrupt_swallowed_by_a_finaliser_is_delivered_again(capsys):
    """Python ignores an exception raised in __del__ (printing "Exception ignored in"); the
    interrupt is raised again outside it, and nothing is printed."""

    class Finalised:
        def __del__(self):
            raise KeyboardInterrupt

    with signals.as_interrupts():
        with pytest.raises(KeyboardInterrupt):
            Finalised()  # dropped at once: __del__ runs and raises
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the signal delivered again lands here
                time.sleep(0.01)
    assert "Exception ignored" not in capsys.readouterr().err


@pytest.mark.parametrize("sig, exc", [(signal.SIGINT, KeyboardInterrupt),
                                      (signal.SIGTERM, signals.Terminated)])
def test_deferred_holds_a_signal_until_the_block_is_done(sig, exc):
    done = []
    with pytest.raises(exc):
        with signals.deferred():
            os.kill(os.getpid(), sig)
            done.append("renamed")  # the block runs to its end
    assert done == ["renamed"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_deferred_without_a_signal_raises_nothing():
    with signals.deferred():
        pass
