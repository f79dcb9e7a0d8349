"""How a child process ended, in words: the one place that names signals and exit codes (issue 26, duplicate D40).

Used for runners (``process.py``), the quantize worker (``quantize.py``), the crash fallbacks
(``daemon/scheduling/fallback.py``) and the llama.cpp probe (``daemon/hardware.py``). A negative return code is
the signal that ended the process, as ``subprocess`` and ``asyncio`` report it.
"""

from __future__ import annotations

import signal


def signal_name(sig: int) -> str:
    """``SIGSEGV`` for 11; ``signal 99`` for a number this platform does not name."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def exit_signal(code: int | None) -> int | None:
    """The signal that ended a process with return code ``code``, if one did."""
    return -code if code is not None and code < 0 else None


def describe_exit(code: int | None) -> str:
    """``killed by SIGSEGV``, ``exit code 1``, or ``it stopped`` when the code is not known yet."""
    if code is None:
        return "it stopped"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exit code {code}"
