"""The quantize worker (``quantize on create``, issue 18): a child process that quantizes a GGUF model with
llama.cpp. The daemon's side, which starts it and reads its lines, is ``daemon/runners/quantize.py``.

Run as ``python -m daemon.llama.quantize IN OUT TYPE [--threads N]`` (TYPE: a name of
``daemon.runners.protocol.QUANT_TYPES`` or a LLAMA_FTYPE number): it calls llama.cpp's ``llama_model_quantize``
(through llama-cpp-python's ctypes binding) and writes JSON lines on stdout::

    {"type": "start", "ftype": 15, "name": "Q4_K_M"}
    {"type": "progress", "done": 3, "total": 21}     # from llama.cpp's "[   3/  21] name ..." log lines
    {"type": "done", "seconds": 1.2, "max_rss": 123456789}   # bytes, the worker's peak RSS
    {"type": "error", "message": "..."}

Anything else on fd 1 (llama.cpp's printf) is sent to stderr. llama_cpp is imported only inside the worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import sys
import threading
import time
from collections import deque
from typing import Any

from daemon.runners.protocol import QUANT_TYPES

PROGRESS_RE = re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\s*\]")


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

    ap = argparse.ArgumentParser(prog="python -m daemon.llama.quantize")
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


if __name__ == "__main__":
    sys.exit(main())
