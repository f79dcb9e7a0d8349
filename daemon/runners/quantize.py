"""Quantize a GGUF model with llama.cpp, in a worker child process (``quantize on create``, issue 18): the daemon's
side. The worker, and the JSON lines it writes, are ``daemon/llama/quantize.py``.

:func:`run_worker` starts the worker, turns its lines into progress callbacks and raises
:class:`QuantizeFailed` with a clear message when the worker fails, crashes or is killed. The daemon never imports
llama_cpp: a llama.cpp abort costs the create, never the daemon.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator

from daemon.exits import describe_exit
from daemon.runners.protocol import QUANT_TYPES
from errors import CorralError, InvalidRequest

#: The list in Ollama's error text (BF16 is accepted but not listed, as in Ollama).
LISTED_TYPES = ("F32", "F16", "Q4_K_S", "Q4_K_M", "Q8_0")
#: Only unquantized sources can be quantized.
QUANTIZABLE_SOURCES = ("F16", "BF16", "F32")
SOURCE_ERROR = "quantization is only supported for F16, BF16 and F32 models"


class QuantizeFailed(CorralError):
    """The worker could not quantize the model (500): llama.cpp refused it, or the worker crashed."""


def parse_quant_type(raw: str) -> tuple[str, int]:
    """``q4_k_m`` -> ``("Q4_K_M", 15)``; an unknown name -> Ollama's 400 text listing the supported types."""
    name = raw.upper()
    if name not in QUANT_TYPES:
        raise InvalidRequest(f"unsupported quantization type {name} - supported types are {', '.join(LISTED_TYPES)}")
    return name, QUANT_TYPES[name]


def worker_command(inp: str, out_path: str, type_name: str, *, threads: int = 0) -> list[str]:
    return [sys.executable, "-m", "daemon.llama.quantize", inp, out_path, type_name, "--threads", str(threads)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_worker(
    inp: str,
    out_path: str,
    type_name: str,
    *,
    threads: int = 0,
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> Iterator[tuple[int, int]]:
    """Run the worker; yield ``(done, total)`` tensor counts as it goes. Raises :class:`QuantizeFailed`.

    Closing the iterator early (the client went away) kills the worker."""
    log = logging.getLogger("daemon.quantize")
    stderr_tail: deque[bytes] = deque(maxlen=30)
    proc = subprocess.Popen(
        worker_command(inp, out_path, type_name, threads=threads),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    if on_start is not None:
        on_start(proc)

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            stderr_tail.append(line)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    error: str | None = None
    finished = False
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            kind = msg.get("type")
            if kind == "progress":
                yield int(msg.get("done") or 0), int(msg.get("total") or 0)
            elif kind == "error":
                error = str(msg.get("message") or "unknown error")
            elif kind == "done":
                finished = True
        code = proc.wait()
        reader.join(timeout=5)
        if code != 0 or not finished:
            detail = b"".join(stderr_tail).decode("utf-8", "replace").strip()
            log.error("quantize worker failed (%s): %s\n%s", describe_exit(code), error or "", detail[-4000:])
            if error:
                raise QuantizeFailed(f"quantization failed: {error}")
            raise QuantizeFailed(f"quantization failed: the quantize worker stopped ({describe_exit(code)})")
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            with contextlib.suppress(Exception):
                stream.close()  # type: ignore[union-attr]
