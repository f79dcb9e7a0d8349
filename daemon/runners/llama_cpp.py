"""The runner child process: owns one llama.cpp model. The only module in corral that imports llama_cpp.

Run as ``python -m daemon.runners.llama_cpp``. It speaks length-prefixed JSON frames (``protocol.py``) on its
original stdout; everything else (llama.cpp's logs included) goes to stderr. A reader thread takes frames from
stdin so a ``cancel`` reaches a generation between two tokens. EOF on stdin or a new parent pid (the daemon died,
even by SIGKILL) ends the process at once.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import queue
import random
import sys
import threading
import time
import traceback
from typing import Any

from daemon.runners.protocol import encode, read_frame

PROMPT_TOO_LONG = (
    "the prompt is longer than the context length currently available to the model; shorten the prompt, adjust "
    "the context length in settings, or use a model with a longer context length"
)


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Channel:
    def __init__(self, out_fd: int) -> None:
        self._out = os.fdopen(out_fd, "wb", buffering=0)
        self._lock = threading.Lock()

    def send(self, obj: dict[str, Any]) -> None:
        data = encode(obj)
        with self._lock:
            self._out.write(data)


class Runner:
    def __init__(self, chan: Channel) -> None:
        import llama_cpp

        self.lc = llama_cpp
        self.chan = chan
        self.llm: Any = None
        self.log_lines: list[str] = []
        self.cancelled: set[int] = set()
        self.spec: dict[str, Any] = {}
        self._log_cb = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self._log_cb, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user: Any) -> None:
        line = text.decode("utf-8", errors="replace")
        if len(self.log_lines) < 5000:
            self.log_lines.append(line.rstrip("\n"))
        sys.stderr.write(line)

    # -- load ----------------------------------------------------------------------------------------------------
    def load(self, spec: dict[str, Any]) -> None:
        import psutil

        self.spec = spec
        threads = int(spec.get("num_thread") or 0) or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        n_ctx = int(spec["num_ctx"]) * max(1, int(spec.get("num_parallel") or 1))
        kwargs: dict[str, Any] = dict(
            model_path=spec["model_path"], n_ctx=n_ctx, n_batch=int(spec.get("num_batch") or 512),
            n_gpu_layers=int(spec.get("num_gpu", 0)), n_threads=threads, n_threads_batch=threads,
            embedding=bool(spec.get("embedding")), verbose=False, seed=0,
        )
        if spec.get("use_mmap") is not None:
            kwargs["use_mmap"] = bool(spec["use_mmap"])
        adapters = spec.get("adapters") or []
        if adapters:
            kwargs["lora_path"] = adapters[0]
        if not os.path.isfile(spec["model_path"]):
            raise RequestError(f"model file {spec['model_path']} does not exist", 500)
        self.llm = self.lc.Llama(**kwargs)
        self._eog_vocab = self.llm._model.vocab

    def info(self) -> dict[str, Any]:
        llm = self.llm
        return {
            "n_ctx": llm.n_ctx(), "n_ctx_train": llm._model.n_ctx_train(), "n_vocab": llm.n_vocab(),
            "n_embd": llm.n_embd(), "n_gpu_layers": int(self.spec.get("num_gpu", 0)),
            "gpu_offload_supported": bool(self.lc.llama_supports_gpu_offload()), "log_lines": self.log_lines,
            "pid": os.getpid(),
        }

    # -- helpers ---------------------------------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        return bool(self.lc.llama_vocab_is_eog(self._eog_vocab, token))

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=True))

    # -- generate --------------------------------------------------------------------------------------------------
    def generate(self, rid: int, req: dict[str, Any]) -> None:
        llm = self.llm
        p = req.get("params") or {}
        tokens = list(req.get("context") or []) + self.tokenize(req["prompt"], bool(req.get("add_special", True)))
        n_ctx = llm.n_ctx()
        if not tokens:
            tokens = [llm.token_bos()]
        if len(tokens) >= n_ctx:
            if not (req.get("shift", True) and req.get("truncate", True)):
                raise RequestError(PROMPT_TOO_LONG)
            keep = min(max(0, int(p.get("num_keep", 4))), n_ctx // 2)
            tail = n_ctx // 2 - keep
            tokens = tokens[:keep] + tokens[len(tokens) - tail:]
        grammar = None
        try:
            if p.get("json_schema"):
                grammar = self.lc.LlamaGrammar.from_json_schema(p["json_schema"], verbose=False)
            elif p.get("grammar"):
                grammar = self.lc.LlamaGrammar.from_string(p["grammar"], verbose=False)
        except Exception as exc:  # noqa: BLE001
            raise RequestError(f"invalid format: could not build a grammar: {exc}") from exc
        seed = int(p.get("seed", -1))
        llm.set_seed(seed if seed >= 0 else random.randint(0, 2**31 - 1))
        num_predict = int(p.get("num_predict", -1))
        limit = 10 * n_ctx if num_predict < 0 else num_predict
        stops = [s for s in (p.get("stop") or []) if s]
        temperature = float(p.get("temperature", 0.8))

        cached = 0
        for a, b in zip(llm._input_ids[: llm.n_tokens], tokens):
            if a != b:
                break
            cached += 1
        prompt_eval_count = max(1, len(tokens) - cached)

        started = time.perf_counter_ns()
        first_at = None
        out_tokens: list[int] = []
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = ""
        done_reason = "stop"
        if limit == 0:
            done_reason = "length"
        gen = llm.generate(
            tokens, top_k=int(p.get("top_k", 40)), top_p=float(p.get("top_p", 0.9)), min_p=float(p.get("min_p", 0.0)),
            typical_p=float(p.get("typical_p", 1.0)), temp=temperature, repeat_penalty=float(p.get("repeat_penalty", 1.1)),
            frequency_penalty=float(p.get("frequency_penalty", 0.0)),
            presence_penalty=float(p.get("presence_penalty", 0.0)), mirostat_mode=int(p.get("mirostat", 0)),
            mirostat_tau=float(p.get("mirostat_tau", 5.0)), mirostat_eta=float(p.get("mirostat_eta", 0.1)),
            grammar=grammar, reset=True,
        ) if limit > 0 else iter(())
        try:
            for token in gen:
                if first_at is None:
                    first_at = time.perf_counter_ns()
                if rid in self.cancelled:
                    done_reason = "stop"
                    break
                if self.is_eog(token):
                    break
                out_tokens.append(token)
                piece = llm.detokenize([token])
                pending += decoder.decode(piece)
                emit, hit = split_stop(pending, stops)
                if emit:
                    self.chan.send({"id": rid, "type": "token", "text": emit})
                if hit:
                    pending = ""
                    break
                pending = pending[len(emit):]
                if len(out_tokens) >= limit:
                    done_reason = "length"
                    break
                if llm.n_tokens >= n_ctx:
                    done_reason = "length"
                    break
        finally:
            gen.close() if hasattr(gen, "close") else None
        pending += decoder.decode(b"", final=True)
        if pending and rid not in self.cancelled:
            self.chan.send({"id": rid, "type": "token", "text": pending})
        ended = time.perf_counter_ns()
        first_at = first_at or ended
        self.chan.send({
            "id": rid, "type": "done", "done_reason": done_reason, "prompt_eval_count": prompt_eval_count,
            "prompt_eval_duration": max(1, first_at - started), "eval_count": len(out_tokens),
            "eval_duration": max(1, ended - first_at), "context": tokens + out_tokens,
        })

    # -- embeddings ------------------------------------------------------------------------------------------------
    def embed(self, inputs: list[str], truncate: bool) -> dict[str, Any]:
        llm = self.llm
        n_ctx = llm.n_ctx()
        counts = []
        for text in inputs:
            n = len(self.tokenize(text, True))
            if n > n_ctx and not truncate:
                raise RequestError("the input length exceeds the context length")
            counts.append(min(n, n_ctx))
        vectors = []
        for text in inputs:
            out = llm.embed(text, normalize=False, truncate=True)
            if out and isinstance(out[0], list):  # per-token embeddings (no pooling): mean-pool them
                dim = len(out[0])
                out = [sum(row[i] for row in out) / len(out) for i in range(dim)]
            vectors.append([float(x) for x in out])
        return {"vectors": vectors, "prompt_eval_count": sum(counts)}

    # -- dispatch --------------------------------------------------------------------------------------------------
    def handle(self, msg: dict[str, Any]) -> None:
        rid = int(msg.get("id", 0))
        op = msg.get("op")
        try:
            if op == "generate":
                self.generate(rid, msg["req"])
            elif op == "embed":
                self.chan.send({"id": rid, "type": "result", **self.embed(list(msg["inputs"]),
                                                                           bool(msg.get("truncate", True)))})
            elif op == "tokenize":
                self.chan.send({"id": rid, "type": "result",
                                "tokens": self.tokenize(msg["text"], bool(msg.get("add_special", True)))})
            elif op == "detokenize":
                text = self.llm.detokenize(list(msg["tokens"])).decode("utf-8", errors="replace")
                self.chan.send({"id": rid, "type": "result", "text": text})
            else:
                raise RequestError(f"unknown operation {op!r}", 500)
        except RequestError as exc:
            self.chan.send({"id": rid, "type": "error", "message": str(exc), "status": exc.status})
        except Exception as exc:  # noqa: BLE001 - report and keep serving
            traceback.print_exc()
            self.chan.send({"id": rid, "type": "error", "message": f"llama.cpp error: {exc}", "status": 500})
        finally:
            self.cancelled.discard(rid)


def split_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """(text safe to emit, whether a stop string was hit). Holds back a suffix that may begin a stop string."""
    if not stops:
        return text, False
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        return text[:first], True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold], False


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != ppid:
            os._exit(0)


def main() -> None:
    proto_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed (by us or llama.cpp) goes to stderr, never into the protocol
    sys.stdout = os.fdopen(1, "w", buffering=1)  # fd 1 now points at stderr
    chan = Channel(proto_fd)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    runner_ref: list[Runner] = []

    def read() -> None:
        stdin = sys.stdin.buffer
        while True:
            try:
                msg = read_frame(stdin)
            except Exception:  # noqa: BLE001
                msg = None
            if msg is None or msg.get("op") == "shutdown":
                os._exit(0)
            if msg.get("op") == "cancel":
                if runner_ref:
                    runner_ref[0].cancelled.add(int(msg.get("id", 0)))
                continue
            inbox.put(msg)

    threading.Thread(target=read, daemon=True).start()
    first = inbox.get()
    if not first or first.get("op") != "load":
        chan.send({"type": "load_error", "message": "the first message must be load"})
        os._exit(1)
    try:
        runner = Runner(chan)
        runner_ref.append(runner)
        runner.load(first["spec"])
        chan.send({"type": "loaded", "info": runner.info()})
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        lines = runner_ref[0].log_lines[-20:] if runner_ref else []
        chan.send({"type": "load_error", "message": f"{exc}", "log_lines": lines})
        os._exit(1)
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                break
            runner.handle(msg)
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
