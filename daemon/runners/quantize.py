"""Quantize a GGUF model with llama.cpp, in a worker child process (``quantize on create``, issue 18).

Worker side, run as ``python -m daemon.runners.quantize IN OUT TYPE [--threads N]``: it calls llama.cpp's
``llama_model_quantize`` (through llama-cpp-python's ctypes binding) and writes JSON lines on stdout::

    {"type": "start", "ftype": 15, "name": "Q4_K_M"}
    {"type": "progress", "done": 3, "total": 21}     # from llama.cpp's "[   3/  21] name ..." log lines
    {"type": "done", "seconds": 1.2, "max_rss": 123456789}   # bytes, the worker's peak RSS
    {"type": "error", "message": "..."}

Anything else on fd 1 (llama.cpp's printf) is sent to stderr. llama_cpp is imported only inside the worker.

Daemon side: :func:`run_worker` starts the worker, turns its lines into progress callbacks and raises
:class:`QuantizeFailed` with a clear message when the worker fails, crashes or is killed. The daemon never imports
llama_cpp: a llama.cpp abort costs the create, never the daemon.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from errors import CorralError

# Ollama's accepted names (fs/ggml ParseFileType; upper-cased first) -> llama.cpp's LLAMA_FTYPE.
QUANT_TYPES: dict[str, int] = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K_S": 14, "Q4_K_M": 15, "Q4_K": 15, "BF16": 32}
#: The list in Ollama's error text (BF16 is accepted but not listed, as in Ollama).
LISTED_TYPES = ("F32", "F16", "Q4_K_S", "Q4_K_M", "Q8_0")
#: Only unquantized sources can be quantized.
QUANTIZABLE_SOURCES = ("F16", "BF16", "F32")
SOURCE_ERROR = "quantization is only supported for F16, BF16 and F32 models"

PROGRESS_RE = re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\s*\]")


class QuantizeFailed(CorralError):
    """The worker could not quantize the model (500): llama.cpp refused it, or the worker crashed."""


def parse_quant_type(raw: str) -> tuple[str, int]:
    """``q4_k_m`` -> ``("Q4_K_M", 15)``; an unknown name -> Ollama's 400 text listing the supported types."""
    from errors import InvalidRequest

    name = raw.upper()
    if name not in QUANT_TYPES:
        raise InvalidRequest(f"unsupported quantization type {name} - supported types are {', '.join(LISTED_TYPES)}")
    return name, QUANT_TYPES[name]


# -- worker ------------------------------------------------------------------------------------------------------
class _Out:
    def __init__(self, fd: int) -> None:
        self._f = os.fdopen(fd, "w", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        with self._lock:
            self._f.write(json.dumps(obj) + "\n")
            self._f.flush()


def _watch_parent(ppid: int) -> None:
    """Exit if the daemon dies (even by SIGKILL): the worker is reparented and nobody will read its output."""
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(3)


def _peak_rss() -> int:
    """This process's peak resident set in bytes: Linux's VmHWM (reset at exec, unlike ru_maxrss, which keeps the
    forking parent's peak), else ru_maxrss."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def quantize(inp: str, out_path: str, ftype: int, out: _Out, *, threads: int = 0) -> int:
    import llama_cpp

    tail: deque[str] = deque(maxlen=40)
    buf = [""]
    last = [-1]

    def on_log(level: int, text: bytes, user_data: Any) -> None:
        chunk = text.decode("utf-8", "replace") if text else ""
        sys.stderr.write(chunk)
        buf[0] += chunk
        while "\n" in buf[0]:
            line, buf[0] = buf[0].split("\n", 1)
            if line.strip():
                tail.append(line.strip())
        # llama.cpp writes one tensor's line in several pieces: the "[ i/ n]" prefix comes first
        for m in PROGRESS_RE.finditer(chunk):
            done, total = int(m.group(1)), int(m.group(2))
            if total > 0 and done != last[0]:
                last[0] = done
                out.send({"type": "progress", "done": done, "total": total})

    cb = llama_cpp.llama_log_callback(on_log)
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    started = time.monotonic()
    rc = int(llama_cpp.llama_model_quantize(inp.encode(), out_path.encode(), ctypes.byref(params)))
    if rc != 0:
        reason = next((line for line in reversed(tail) if "failed" in line or "error" in line.lower()), "")
        out.send({"type": "error", "message": reason or f"llama_model_quantize returned {rc}"})
        return 2
    out.send({"type": "done", "seconds": round(time.monotonic() - started, 3), "max_rss": _peak_rss()})
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m daemon.runners.quantize")
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("type", help="F16, Q8_0, Q4_K_M, ... (or a LLAMA_FTYPE number)")
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    args = ap.parse_args(argv)
    out = _Out(os.dup(1))
    os.dup2(2, 1)  # a backend's printf goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        ftype = int(args.type) if args.type.isdigit() else QUANT_TYPES[args.type.upper()]
    except KeyError:
        out.send({"type": "error", "message": f"unknown type {args.type}"})
        return 2
    out.send({"type": "start", "ftype": ftype, "name": args.type.upper()})
    try:
        return quantize(args.input, args.output, ftype, out, threads=args.threads)
    except Exception as exc:  # noqa: BLE001 - reported to the daemon
        out.send({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 2


# -- daemon side -------------------------------------------------------------------------------------------------
def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def worker_command(inp: str, out_path: str, type_name: str, *, threads: int = 0) -> list[str]:
    return [sys.executable, "-m", "daemon.runners.quantize", inp, out_path, type_name, "--threads", str(threads)]


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
    import logging

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
            log.error("quantize worker failed (%s): %s\n%s", _describe_exit(code), error or "", detail[-4000:])
            if error:
                raise QuantizeFailed(f"quantization failed: {error}")
            raise QuantizeFailed(f"quantization failed: the quantize worker stopped ({_describe_exit(code)})")
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            with contextlib.suppress(Exception):
                stream.close()  # type: ignore[union-attr]


if __name__ == "__main__":
    sys.exit(main())
