"""The daemon's side of a runner: a child process per loaded model, spoken to over its stdin/stdout pipes.

This module never imports llama_cpp. A crash of llama.cpp (abort, segfault) ends only the child: requests in
flight get :class:`RunnerCrashed`, and the scheduler loads the model again on the next request.

A runner has its own resource limits, set in the child before llama.cpp is imported: the open-file limit the daemon
started with (the daemon raises its own for many connections; a runner needs a few files, and a hostile model file
that makes llama.cpp misbehave should not have thousands), and no core dumps (a runner's memory holds the prompts
of every user of the model). A ``num_thread`` above this machine's bound (a model made on a bigger machine) is
lowered to it, and the log says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeVar

from daemon.exits import describe_exit, exit_signal
from daemon.rpc import RpcLoad, check_load, placement
from daemon.runners.base import (
    SLOT_ERRORS,
    Embedding,
    Event,
    GenerateRequest,
    KVDiskInfo,
    LoadFailed,
    LoadSpec,
    MemoryUse,
    Piece,
    RunnerCrashed,
    RunnerError,
    RunnerInfo,
    SlotInfo,
    SlotRefused,
    SlotResult,
)
from daemon.runners.protocol import (
    HEADER,
    MAX_FRAME,
    AdaptersOp,
    AdaptersReply,
    BatchReply,
    Call,
    CancelOp,
    DetokenizeOp,
    DoneReply,
    EmbedOp,
    EmbedReply,
    ErrorReply,
    GenerateOp,
    LoadedReply,
    LoadErrorReply,
    LoadOp,
    Op,
    PiecesOp,
    PiecesReply,
    ProtocolError,
    Reply,
    RerankOp,
    RerankReply,
    ShutdownOp,
    SlotErasedReply,
    SlotEraseOp,
    SlotRestoredReply,
    SlotRestoreOp,
    SlotSavedReply,
    SlotSaveOp,
    SlotsOp,
    SlotsReply,
    StageReply,
    TextReply,
    TokenizeOp,
    TokenReply,
    TokensReply,
    TruncatedReply,
    decode_reply,
    encode,
    parse_payload,
    request_id,
)
from errors import InvalidRequest
from modelfile.params import THREADS_PER_CPU, clamp_num_thread

#: default seconds a load may go without progress (CORRAL_LOAD_TIMEOUT, as OLLAMA_LOAD_TIMEOUT); math.inf = forever
LOAD_TIMEOUT = 300.0
_R = TypeVar("_R", bound=Reply)


# The runner's own limits, applied by the child before it imports anything heavy (no preexec_fn: the daemon has
# threads). argv[1] is the module to run (so tools that look for runners by command line find it), argv[2] the
# limits as JSON: [[resource name, soft, hard], ...].
_BOOT = """
import json, runpy, sys
try:
    import resource
except ImportError:
    resource = None
module, limits = sys.argv[1], json.loads(sys.argv[2])
for name, soft, hard in limits if resource is not None else ():
    try:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    except (AttributeError, ValueError, OSError) as e:
        print(f"runner: could not set {name} to {soft}: {e}", file=sys.stderr)
sys.argv = [module]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
_STARTING_NOFILE: int | None = None


def remember_starting_limits() -> None:
    """Note this process's open-file limit before the daemon raises it (``daemon.api.server`` calls this first), so
    runners get the one the daemon was started with. Only the first call counts."""
    global _STARTING_NOFILE
    if _STARTING_NOFILE is not None:
        return
    try:
        import resource
    except ImportError:  # Windows
        return
    _STARTING_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def runner_limits() -> list[tuple[str, int, int]]:
    """The limits a runner starts with: [(resource name, soft, hard)]. Open files: the daemon's starting soft limit
    (the current one when none was noted), as both soft and hard; core dumps: none."""
    try:
        import resource
    except ImportError:  # Windows: no rlimits
        return []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = _STARTING_NOFILE if _STARTING_NOFILE is not None else soft
    if hard != resource.RLIM_INFINITY and (nofile == resource.RLIM_INFINITY or nofile > hard):
        nofile = hard
    return [("RLIMIT_NOFILE", nofile, nofile), ("RLIMIT_CORE", 0, 0)]


class RunnerRequestError(InvalidRequest):
    """The runner refused a request (a 400: prompt too long, bad grammar...)."""


# llama.cpp's own one-line reasons for refusing a model that a client may see: they name what is in the model file
# (an architecture, a tensor, a key, counts), never a path, an address or a native trace. Anything else stays in the
# daemon log.
_WORD = r"[\w.\-+]{1,128}"
_SAFE_LOAD_REASONS = tuple(
    re.compile(p)
    for p in (
        rf"unknown model architecture: '{_WORD}'",
        rf"missing tensor '{_WORD}'",
        rf"tensor '{_WORD}' not found",
        rf"tensor '{_WORD}' has wrong shape; expected [\d, ]{{1,80}}, got [\d, ]{{1,80}}",
        r"wrong number of tensors; expected \d{1,9}, got \d{1,9}",
        rf"key not found in model: {_WORD}",
        rf"n > N_MAX: \d{{1,20}} > \d{{1,20}} for key {_WORD}",
        rf"key {_WORD} has wrong array length; expected \d{{1,20}}, got \d{{1,20}}",
        rf"unknown pre-tokenizer type: '{_WORD}'",
        rf"unknown tokenizer: '{_WORD}'",
        r"vision projector: mismatch between text model \(n_embd = \d{1,9}\) and mmproj \(n_embd = \d{1,9}\)",
        r"vision projector: not a projector this llama.cpp supports",
    )
)
_LOAD_ERROR = re.compile(r"error loading model: (.+)$")
_NESTED = re.compile(
    r"^(?:error loading model (?:architecture|hyperparameters|vocabulary|tensors)|check_tensor_dims"
    r"|create_tensor): "
)
# what llama.cpp's RPC client says before it aborts the process on a server that stopped answering
_RPC_LOST = re.compile(r"Remote RPC server crashed or returned malformed response|Failed to connect to \S+:\d+")
TAIL_LINES = 20  # stderr lines written to the daemon log when a runner fails


_BUFFER_SIZE = re.compile(r"(\w+?)(?:_Mapped)?\s+(model|KV|compute|output|RS) buffer size\s*=\s*([\d.]+)\s*MiB")


def parse_llama_log(lines: Iterable[str]) -> MemoryUse:
    """Sum llama.cpp's "<device> <kind> buffer size = N MiB" lines (a runner's load log) into the bytes of RAM and
    VRAM the model takes."""
    lines = list(lines)
    ram, vram = 0, sum(placement(lines).values())  # llama.cpp RPC servers' buffers (issue 30) count as VRAM
    for line in lines:
        m = _BUFFER_SIZE.search(line)
        if not m:
            continue
        device, size = m.group(1), int(float(m.group(3)) * (1 << 20))
        if device.upper().startswith("CPU"):
            ram += size
        else:
            vram += size
    return MemoryUse(ram=ram, vram=vram)


def safe_load_reason(lines: list[str]) -> str | None:
    """llama.cpp's reason for refusing the model, from its log lines, when it is one of the known path-free
    messages; else None (the client is told to see the daemon log)."""
    for line in reversed(lines):
        m = _LOAD_ERROR.search(line.strip())
        if m is None:
            continue
        reason = m.group(1).strip()
        while (nested := _NESTED.match(reason)) is not None:
            reason = reason[nested.end() :]
        if (
            len(reason) <= 200
            and "/" not in reason
            and "\\" not in reason
            and any(p.fullmatch(reason) for p in _SAFE_LOAD_REASONS)
        ):
            return reason
        return None
    return None


class ProcessRunner:
    def __init__(
        self,
        spec: LoadSpec,
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        log: logging.Logger | None = None,
        load_timeout: float = LOAD_TIMEOUT,
    ) -> None:
        self.spec = spec
        self.load_timeout = load_timeout if load_timeout > 0 else math.inf  # CORRAL_LOAD_TIMEOUT; <= 0 = forever
        self._progress_at = 0.0  # loop time of the load's last sign of progress (a stage frame or a log line)
        self._python = python
        self._env = env
        self._log = log or logging.getLogger("daemon.runner")
        self._proc: asyncio.subprocess.Process | None = None
        self._info: RunnerInfo | None = None
        self._stderr: deque[str] = deque(maxlen=50)
        # each request's replies; None: the runner is gone
        self._queues: dict[int, asyncio.Queue[Reply | None]] = {}
        self._next_id = 0
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._err_reader: asyncio.Task[None] | None = None
        self._loaded: asyncio.Future[LoadedReply | LoadErrorReply] | None = None
        self._dead = False
        self._memory = MemoryUse(0, 0)
        self._stage = "start"  # what the runner said it was doing last (load, warm-up, ready)
        self._decoded = False  # a decode finished: a crash from now on is not the configuration's first-decode fault
        self._stderr_logged = False
        self._kv_disk: KVDiskInfo | None = None  # the prompt cache on disk, as the last SlotsReply had it
        self.rpc: RpcLoad | None = None  # this load's llama.cpp RPC servers (issue 30), as /api/ps shows them
        self._rpc_lost = False  # llama.cpp said an RPC server stopped answering (it aborts the runner then)

    # -- Runner protocol -------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def memory(self) -> MemoryUse:
        return self._memory

    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and not self._dead

    def info(self) -> dict[str, int | str | bool]:
        return self._info.public() if self._info is not None else {}

    @property
    def kv_disk(self) -> KVDiskInfo | None:
        """The runner's prompt cache on disk as its last :meth:`slots` answer reported it (None before one)."""
        return self._kv_disk

    async def start(self) -> None:
        if self.spec.rpc_servers:  # servers that do not answer now are left out, their layers kept here
            self.spec, self.rpc = await check_load(self.spec, self._log)
        env = dict(self._env if self._env is not None else os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        threads = clamp_num_thread(self.spec.num_thread)
        if threads != self.spec.num_thread:
            self._log.warning(
                "model %s asks for num_thread=%d; this machine has %d logical CPUs, so it runs with %d "
                "(%d per logical CPU at most)",
                self.spec.model_path,
                self.spec.num_thread,
                os.cpu_count() or 1,
                threads,
                THREADS_PER_CPU,
            )
            self.spec = dataclasses.replace(self.spec, num_thread=threads)
        self._proc = await asyncio.create_subprocess_exec(
            self._python,
            "-c",
            _BOOT,
            "daemon.llama.runner",
            json.dumps(runner_limits()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            limit=MAX_FRAME,
        )
        self._loaded = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read_frames())
        self._err_reader = asyncio.ensure_future(self._read_stderr())
        self._send(LoadOp(self.spec))
        try:
            msg = await self._wait_loaded()
        except TimeoutError:
            await self.close()
            limit = f"{self.load_timeout:g}s"
            self._log_stderr(f"timed out loading {self.spec.model_path}: no progress for {limit} (CORRAL_LOAD_TIMEOUT)")
            raise LoadFailed(
                f"timed out waiting for the model to load: no progress for {limit}; raise "
                f"CORRAL_LOAD_TIMEOUT (now {limit}; 0 = wait forever) for slow disks or large models, "
                "and see the daemon log"
            ) from None
        if not isinstance(msg, LoadedReply):
            await self.close()
            code = self._proc.returncode if self._proc else None
            sig = exit_signal(code)
            # what the runner said (it may hold paths) and its stderr go to the daemon log only
            self._log_stderr(
                f"could not load {self.spec.model_path} ({describe_exit(code)}): {msg.message or 'the runner exited'}",
                list(msg.log_lines),
            )
            if self._rpc_lost:  # not a fault of this machine's kernels: no safer configuration is learnt from it
                raise LoadFailed(
                    f"llama runner process has terminated: an RPC server ({', '.join(self.spec.rpc_servers)}) "
                    "stopped answering while the model loaded; the next load leaves out a server that does not answer"
                )
            if sig is not None:
                stage = "warm-up" if self._stage == "warm-up" else "load"
                raise LoadFailed(
                    f"llama runner process has terminated: {describe_exit(code)} during {stage}",
                    signal=sig,
                    stage=stage,
                )
            reason = safe_load_reason(list(msg.log_lines) + list(self._stderr))
            raise LoadFailed(
                "llama runner process has terminated: llama.cpp could not load the model: "
                + (reason or "see the daemon log for details")
            )
        self._info = msg.info
        self._memory = parse_llama_log(msg.info.log_lines)
        if self.rpc is not None:
            self.rpc.bytes = placement(msg.info.log_lines)
        self._log.info(
            "runner loaded pid=%s model=%s ram=%d vram=%d",
            self.pid,
            self.spec.model_path,
            self._memory.ram,
            self._memory.vram,
        )

    async def _wait_loaded(self) -> LoadedReply | LoadErrorReply:
        """The runner's load answer; asyncio.TimeoutError after ``load_timeout`` seconds without progress (a stage
        frame or a log line from the runner restarts the clock)."""
        assert self._loaded is not None
        loop = asyncio.get_running_loop()
        self._progress_at = loop.time()
        while True:
            if math.isinf(self.load_timeout):
                return await asyncio.shield(self._loaded)
            left = self._progress_at + self.load_timeout - loop.time()
            if left <= 0:
                raise TimeoutError
            try:
                return await asyncio.wait_for(asyncio.shield(self._loaded), left)
            except TimeoutError:
                continue  # progress may have come meanwhile: check again

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Event]:
        # no lock: the runner batches concurrent generations (up to num_parallel at once, the rest wait there)
        rid, q = self._open()
        self._send(GenerateOp(rid, req))
        finished = False
        try:
            while True:
                msg = await q.get()
                if msg is None:
                    raise self._crashed()
                if isinstance(msg, TokenReply):
                    self._decoded = True
                    yield msg.token
                elif isinstance(msg, DoneReply):
                    self._decoded = True
                    finished = True
                    yield msg.done
                    return
                elif isinstance(msg, TruncatedReply):  # the prompt was cut to fit the context (said before any token)
                    yield msg.truncated
                elif isinstance(msg, ErrorReply):
                    finished = True
                    raise self._error(msg)
        finally:
            if not finished and self.alive():
                # the consumer left early: cancel and wait for the runner to finish this request
                self._send(CancelOp(rid))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._drain(q), 30)
            self._queues.pop(rid, None)

    async def embed(self, inputs: list[str], *, truncate: bool = True) -> Embedding:
        msg = await self._call(lambda rid: EmbedOp(rid, tuple(inputs), truncate), EmbedReply)
        self._decoded = True
        return msg.embedding

    async def slots(self) -> list[SlotInfo]:
        """The runner's sequence slots: id, busy, and how many tokens its KV cache holds for reuse."""
        reply = await self._call(SlotsOp, SlotsReply)
        self._kv_disk = reply.kv_disk
        return list(reply.slots)

    async def save_slot(self, slot: int, filename: str) -> SlotResult:
        """Write what ``slot`` holds to the saved slot ``filename`` (the runner writes the file: its state never
        crosses the pipe)."""
        msg = await self._slot_call(lambda rid: SlotSaveOp(rid, slot, filename), SlotSavedReply)
        return SlotResult(msg.slot, msg.n_saved, msg.filename, msg.n_written, msg.save_ms)

    async def restore_slot(self, slot: int, filename: str) -> SlotResult:
        msg = await self._slot_call(lambda rid: SlotRestoreOp(rid, slot, filename), SlotRestoredReply)
        return SlotResult(msg.slot, msg.n_restored, msg.filename, msg.n_read, msg.restore_ms)

    async def erase_slot(self, slot: int) -> SlotResult:
        msg = await self._slot_call(lambda rid: SlotEraseOp(rid, slot), SlotErasedReply)
        return SlotResult(msg.slot, msg.n_erased)

    async def drop_adapters(self, paths: tuple[str, ...]) -> tuple[str, ...]:
        """Free the LoRA adapters at ``paths`` once no sequence uses them; the adapters loaded after that (the
        runner loads an adapter the first time a request names it: ``GenerateRequest.adapters``)."""
        return (await self._call(lambda rid: AdaptersOp(rid, tuple(paths)), AdaptersReply)).loaded

    async def _slot_call(self, op: Callable[[int], Call], answer: type[_R]) -> _R:
        """A slot action: the runner's refusals become the slot errors their status names (``SLOT_ERRORS``)."""
        try:
            return await self._call(op, answer)
        except RunnerError as exc:
            kind = SLOT_ERRORS.get(exc.status or 500)
            if kind is None or kind is SlotRefused:
                raise
            raise kind(str(exc)) from None
        except RunnerRequestError as exc:
            raise SlotRefused(str(exc)) from None

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        return list((await self._call(lambda rid: TokenizeOp(rid, text, add_special), TokensReply)).tokens)

    async def detokenize(self, tokens: list[int]) -> str:
        return (await self._call(lambda rid: DetokenizeOp(rid, tuple(tokens)), TextReply)).text

    async def rerank(self, query: str, documents: list[str], *, truncate: bool = True) -> tuple[list[float], int]:
        """Each document's relevance score to ``query`` (a runner loaded with ``LoadSpec.rerank``), and the tokens
        evaluated."""
        msg = await self._call(lambda rid: RerankOp(rid, query, tuple(documents), truncate), RerankReply)
        self._decoded = True
        return list(msg.scores), msg.prompt_eval_count

    async def token_pieces(self, tokens: list[int]) -> list[Piece]:
        """Each token's text: a string, or a list of byte values where it is not valid UTF-8 alone."""
        return list((await self._call(lambda rid: PiecesOp(rid, tuple(tokens)), PiecesReply)).pieces)

    async def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(Exception):
                self._send(ShutdownOp())
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._dead = True
        for task in (self._reader, self._err_reader):
            if task is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(task, 2)

    # -- internals -------------------------------------------------------------------------------------------------
    def _open(self) -> tuple[int, asyncio.Queue[Reply | None]]:
        if not self.alive():
            raise self._crashed()
        self._next_id += 1
        q: asyncio.Queue[Reply | None] = asyncio.Queue()
        self._queues[self._next_id] = q
        return self._next_id, q

    async def _drain(self, q: asyncio.Queue[Reply | None]) -> None:
        while True:
            msg = await q.get()
            if msg is None or isinstance(msg, (DoneReply, ErrorReply)):
                return

    async def _call(self, op: Callable[[int], Call], answer: type[_R]) -> _R:
        """Send the op made for a new request id, and wait for its one reply: ``answer``, or an error."""
        async with self._lock:
            rid, q = self._open()
            try:
                sent = op(rid)
                self._send(sent)
                msg = await q.get()
                if msg is None:
                    raise self._crashed()
                if isinstance(msg, ErrorReply):
                    raise self._error(msg)
                if not isinstance(msg, answer):
                    raise RunnerError(f"the runner answered {sent.op} with a {msg.type} reply")
                return msg
            finally:
                self._queues.pop(rid, None)

    def _send(self, op: Op) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        if self._proc.stdin.is_closing():
            raise self._crashed()
        self._proc.stdin.write(encode(op))

    def _error(self, msg: ErrorReply) -> Exception:
        if msg.status == 400:
            return RunnerRequestError(msg.message)
        return RunnerError(msg.message, status=msg.status)

    @property
    def exit_signal(self) -> int | None:
        """The signal that ended the runner, if one did."""
        return exit_signal(self._proc.returncode if self._proc else None)

    @property
    def decoded(self) -> bool:
        return self._decoded

    def _crashed(self) -> RunnerCrashed:
        """The error for requests that find the runner gone: how it ended, never its stderr (native traces, paths),
        which goes to the daemon log."""
        code = self._proc.returncode if self._proc else None
        self._log_stderr(f"stopped unexpectedly ({describe_exit(code)})")
        if self._rpc_lost:  # llama.cpp aborts on a lost RPC server: not a native fault (no signal, no fallback)
            return RunnerCrashed(
                f"the model runner lost an RPC server ({', '.join(self.spec.rpc_servers)}); the model will be loaded "
                "again on the next request, without a server that does not answer",
                early=not self._decoded,
            )
        return RunnerCrashed(
            f"the model runner stopped unexpectedly ({describe_exit(code)}); the model will be loaded again on the "
            "next request",
            signal=self.exit_signal,
            early=not self._decoded,
        )

    def _log_stderr(self, what: str, llama_log: list[str] | None = None) -> None:
        """Once per runner: why it failed, the end of llama.cpp's log (when the runner sent it) and the tail of its
        stderr, in the daemon log (for the administrator), as one record."""
        if self._stderr_logged:
            return
        self._stderr_logged = True
        lines = [str(x).rstrip() for x in (llama_log or [])[-TAIL_LINES:]]
        lines += [x for x in list(self._stderr)[-TAIL_LINES:] if x not in lines]
        tail = " | ".join(x.strip() for x in lines if x.strip())
        self._log.warning("runner pid=%s %s; stderr: %s", self.pid, what, tail or "(empty)")

    async def _read_frames(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        out = self._proc.stdout
        try:
            while True:
                head = await out.readexactly(HEADER.size)
                (n,) = HEADER.unpack(head)
                data = await out.readexactly(n)
                try:
                    obj = parse_payload(data)
                    msg = decode_reply(obj)
                except ProtocolError as exc:
                    self._malformed(exc, data)
                    continue
                self._route(msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._dead = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._proc.wait(), 5)
            if self._loaded is not None and not self._loaded.done():
                self._loaded.set_result(LoadErrorReply(f"the runner exited ({describe_exit(self._proc.returncode)})"))
            for q in self._queues.values():
                q.put_nowait(None)
            if self._proc.returncode not in (0, None):
                self._log.warning("runner exited pid=%s %s", self._proc.pid, describe_exit(self._proc.returncode))

    def _route(self, msg: Reply) -> None:
        """A reply to the request it answers, or to the load in progress."""
        if isinstance(msg, BatchReply):  # an engine step's replies in one frame (``Channel.send_many``)
            for one in msg.msgs:
                self._route(one)
        elif isinstance(msg, StageReply):
            self._stage = msg.stage
            self._progress_at = asyncio.get_running_loop().time()
        elif isinstance(msg, (LoadedReply, LoadErrorReply)):
            if self._loaded is not None and not self._loaded.done():
                self._loaded.set_result(msg)
        else:
            q = self._queues.get(msg.id)
            if q is not None:
                q.put_nowait(msg)

    def _malformed(self, exc: ProtocolError, data: bytes) -> None:
        """A frame the daemon cannot read (a bug in one side of the protocol): logged, and the request it names,
        if any, fails alone; the runner goes on serving the others."""
        self._log.error("runner pid=%s sent a malformed frame: %s", self.pid, exc)
        with contextlib.suppress(ProtocolError):
            rid = request_id(parse_payload(data))
            q = self._queues.get(rid) if rid is not None else None
            if q is not None:
                q.put_nowait(ErrorReply(rid or 0, f"the runner sent a malformed reply: {exc}", 500))

    async def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while True:
            line = await self._proc.stderr.readline()
            if not line:
                return
            text = line.decode("utf-8", errors="replace").rstrip()
            self._progress_at = asyncio.get_running_loop().time()
            self._stderr.append(text)
            if self.rpc is not None and _RPC_LOST.search(text):
                self._rpc_lost = True
            self._log.debug("runner pid=%s: %s", self._proc.pid, text)
