"""The prompt cache on disk (issue 27): time to first token cold, warm, after a restart and after an unload; the
restore's read throughput against a plain read of the same files; twenty conversations sharing a system prompt.

Usage: .venv/bin/python bench/kv_disk.py [--rounds 3] [--parts ttft,profile,share,tails] [--models smol,tiny]
       [--write docs/benchmarks.md] [--json FILE]
       .venv/bin/python bench/kv_disk.py --from-json FILE [--write docs/benchmarks.md]   (the report again, no run)

Parts 1 and 3 come from a real ``corral serve`` on an ephemeral port with its own CORRAL_MODELS and
CORRAL_KV_DISK_DIR in a temporary work dir (CORRAL_NUM_PARALLEL=1, CORRAL_KV_DISK=8GiB), spoken to through
``/v1/chat/completions`` (streamed, ``stream_options.include_usage``): a system message, then a user question,
greedy, 8 tokens. TTFT: from sending the request to the first chunk with content, at the client. ``cached`` is the
usage's ``prompt_tokens_details.cached_tokens`` (the tokens restored or reused, not evaluated).

``ttft`` (part 1, and part 2's outside measurement), per model and per round (a new system prompt each round, a new
cache dir each round, so "cold" is cold):

* ``smol``: SmolLM2-135M-Instruct Q4_1 (scripts/fetch_smollm2.py), a 4,096-token system prompt, num_ctx 8192;
* ``tiny``: a random-weight llama GGUF written with ``gguf`` (tests/models.py ``write_tiny_gguf``: 4 layers, 512
  wide, 16 heads of 32 (8 KV heads), FFN 1024, 2,000-token vocabulary with byte fallback, context 32,768), a
  16,384-token system prompt, num_ctx 32768. Its KV cache is 4 KiB per token (64 MiB at 16k), and its cold 16k
  prefill ~30 s here.

Before each measured request on a new runner, a short warm-up chat that shares no block with it (the daemon's and
the runner's first request pay for lazy imports, the chat template's compilation, the first decode's buffers).

1. start a daemon (empty cache dir), load the model (an empty request), warm up, then ask: **cold**;
2. the same system prompt, another question: **warm** (the prefix is in the runner's slot);
3. stop the daemon (SIGTERM, after /api/ps shows the blocks on disk), start a new one, load the model, warm up, drop the
   page cache (``echo 3 > /proc/sys/vm/drop_caches``, when this runs as root), ask: **restart** (restored from
   disk, the files read from the device);
4. another question on that daemon: **warm after restart** (in RAM again: the baseline the restore is measured
   against: restore time = restart TTFT - this TTFT, both evaluating a question of the same length after the
   prefix on the same runner);
5. unload the model (``keep_alive: 0``), load it again, warm up, ask: **unload** (restored from disk; the files are
   in the page cache, as they are after an unload);
6. stop the daemon, drop the page cache, read the files of the restored blocks (the chain of the restored prefix,
   from their headers) one after the other with plain ``read`` calls of 1 MiB: the **plain sequential read**.
   Restore throughput = bytes of those files / restore time; the goal is >= 0.5x the plain read.

``profile`` (part 2, inside): the same engine code in this process (daemon/llama/runner.py ``Runner``, with the
same LoadSpec fields the daemon sets for these runs: num_ctx, num_parallel 1, num_batch 512, the cache dir, size
and a kv_key), a cold run that writes the blocks, a new Runner, the page cache dropped, the same prompt again, with
timers around the restore's steps: ``KVStore.load`` (open, read, check the header, sha256 of each payload, 4 reader
threads), ``kvblocks.join``, ``llama_state_seq_set_data``; and the rest of the time to the first token (evaluating
the prompt's tail and the first token). Then the same files read plainly, and read plus sha256, after dropping the
page cache again.

``share`` (part 3): one daemon (SmolLM2, num_ctx 8192), twenty conversations with one 2,048-token system prompt,
each its own user turn of ~300 tokens; the bytes of block files on disk against twenty independent copies (the sum,
over the conversations, of the bytes of the blocks in each one's chain); then a daemon restart and each
conversation's second turn: the disk cache's hits and misses from /api/ps (``kv_disk``), the tokens restored and
each request's cached tokens.

``tails``: the engine in-process on the random model, one runner with flash attention auto and one with it off: an
8,192-token prompt, then prompts with that prefix and 16-256 new tokens after it, TTFT by the number of new tokens
(why an in-RAM hit can take longer than a restore on this CPU).

Needs root for ``drop_caches`` (without it the report says the page cache was NOT dropped) and SmolLM2 cached. On a
shared 2-core machine the figures move with other work: medians, and the report says so.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import hashlib
import json
import mmap
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching

from tests.models import smollm2_path, write_tiny_gguf

REPO = batching.REPO
SECTION = "## Prompt cache on disk (issue 27)"
BLOCK = 256
TINY_SHAPE = {"n_layer": 4, "n_embd": 512, "n_ff": 1024, "n_vocab": 2000}
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CLIENT = httpx.Client(timeout=900, headers={"Connection": "close"})
WORDS = (
    "the a system agent tool call file read write search result user request answer model token cache block disk "
    "prompt context memory layer value key query note rule step plan check test build run error output input list "
    "table field record index page line word text code function class method module package path name type size "
    "time date number count first last next other same new old long short large small high low good best fast slow "
    "always never only also then when where which what while before after under over between into from with about "
    "must should may can will does is are was were be been has have had do not no yes each every all some any most "
    "return open close save load start stop send receive parse format print show hide keep drop move copy share "
    "server client network socket port host address header body status code version release branch commit review"
).split()


# -- the daemon ------------------------------------------------------------------------------------------------------
class Daemon:
    """``corral serve`` on an ephemeral port, its models in ``work/models``, its prompt cache in ``kv``."""

    def __init__(self, work: Path, kv: Path, log: Path, extra: dict[str, str] | None = None) -> None:
        self.port = batching.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
        env.update(
            {
                "CORRAL_HOST": f"127.0.0.1:{self.port}",
                "CORRAL_MODELS": str(work / "models"),
                "CORRAL_KV_DISK_DIR": str(kv),
                "CORRAL_KV_DISK": "8GiB",
                "CORRAL_NUM_PARALLEL": "1",
                "PYTHONPATH": str(REPO),
                **(extra or {}),
            }
        )
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve"], env=env, cwd=REPO, stdout=self._log, stderr=self._log
        )
        batching.wait_up(self.url + "/api/version", self.proc)

    def create(self, name: str, gguf: Path, num_ctx: int) -> None:
        digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
        with gguf.open("rb") as f:
            CLIENT.post(f"{self.url}/api/blobs/{digest}", content=f).raise_for_status()
        CLIENT.post(
            self.url + "/api/create",
            json={"model": name, "files": {gguf.name: digest}, "stream": False, "parameters": {"num_ctx": num_ctx}},
        ).raise_for_status()

    def load(self, name: str) -> None:
        CLIENT.post(self.url + "/api/generate", json={"model": name}).raise_for_status()

    def tokenize(self, name: str, text: str, pieces: bool = False) -> list[Any]:
        r = CLIENT.post(self.url + "/api/tokenize", json={"model": name, "content": text, "with_pieces": pieces})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def detokenize(self, name: str, tokens: list[int]) -> str:
        r = CLIENT.post(self.url + "/api/detokenize", json={"model": name, "tokens": tokens})
        r.raise_for_status()
        return str(r.json()["content"])

    def chat(self, name: str, messages: list[dict[str, str]], tokens: int = 8) -> dict[str, Any]:
        body = {
            "model": name,
            "messages": messages,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, first, text, usage = time.perf_counter(), 0.0, "", {}
        with CLIENT.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text += piece
                        if not first:
                            first = time.perf_counter() - start
        if not first:
            raise RuntimeError(f"no content streamed (usage {usage})")
        return {
            "ttft": first,
            "prompt": int(usage.get("prompt_tokens") or 0),
            "cached": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            "text": text,
        }

    def kv_disk(self, name: str) -> dict[str, Any]:
        for m in CLIENT.get(self.url + "/api/ps").json()["models"]:
            if m["name"].split(":")[0] == name:
                return dict(m.get("kv_disk") or {})
        return {}

    def wait_blocks(self, name: str, want: int, timeout: float = 120) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            kv = self.kv_disk(name)
            if kv.get("entries", 0) >= want:
                return kv
            if time.monotonic() > end:
                raise RuntimeError(f"{want} blocks never reached the disk: {kv}")
            time.sleep(0.2)

    def unload(self, name: str) -> None:
        CLIENT.post(self.url + "/api/generate", json={"model": name, "keep_alive": 0}).raise_for_status()
        end = time.monotonic() + 120
        while CLIENT.get(self.url + "/api/ps").json()["models"]:
            if time.monotonic() > end:
                raise RuntimeError("the model was not unloaded")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        self._log.close()


# -- the files -----------------------------------------------------------------------------------------------------
_PREFIX = struct.Struct("<4sHIIQ32sHHH")  # daemon/runners/kvstore.py's block header


@dataclass
class BlockFile:
    path: Path
    index: int
    hash: str
    parent: str
    size: int


def _payload_len(path: Path) -> int:
    with path.open("rb") as f:
        return int(_PREFIX.unpack(f.read(_PREFIX.size))[4])


def block_files(root: Path) -> list[BlockFile]:
    out = []
    for path in root.rglob("*.kvb"):
        with path.open("rb") as f:
            head = f.read(_PREFIX.size)
            _, _, index, _, _, _, klen, hlen, plen = _PREFIX.unpack(head)
            names = f.read(klen + hlen + plen)
        out.append(
            BlockFile(
                path,
                index,
                names[klen : klen + hlen].decode(),
                names[klen + hlen :].decode(),
                path.stat().st_size,
            )
        )
    return out


def chain(files: list[BlockFile], n: int, want_tail: str | None = None) -> list[BlockFile]:
    """The first ``n`` blocks of a chain from its root (the blocks of a restored prefix, in order). Where chains
    part before ``n`` (never for the prefixes measured here: they end inside the shared system prompt), the first
    child is followed."""
    children: dict[str, list[BlockFile]] = {}
    for f in files:
        children.setdefault(f.parent, []).append(f)
    roots = [f for f in files if f.index == 0]
    if not roots:
        return []
    out = [roots[0]]
    while len(out) < n:
        nxt = children.get(out[-1].hash) or []
        if not nxt:
            break
        out.append(sorted(nxt, key=lambda f: f.hash)[0])
    return out


def leaves(files: list[BlockFile]) -> list[list[BlockFile]]:
    """Every chain from a root to a block with no child: one per conversation."""
    by_hash = {f.hash: f for f in files}
    parents = {f.parent for f in files}
    out = []
    for f in files:
        if f.hash in parents:
            continue
        path, cur = [f], f
        while cur.index > 0 and cur.parent in by_hash:
            cur = by_hash[cur.parent]
            path.append(cur)
        out.append(path[::-1])
    return out


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def plain_read(paths: list[Path], digest: bool = False) -> float:
    """Seconds to read the files one after another (1 MiB reads), optionally with sha256 over each."""
    start = time.perf_counter()
    for p in paths:
        h = hashlib.sha256() if digest else None
        with p.open("rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                if h is not None:
                    h.update(chunk)
    return time.perf_counter() - start


# -- prompts ---------------------------------------------------------------------------------------------------------
def english(rng: random.Random, words: int) -> str:
    out, sentence = [], []
    for _ in range(words):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(6, 14):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    return " ".join(out)


def tiny_words(rng: random.Random, words: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word(i: int) -> str:
        w, j = "", i
        while True:
            w = letters[j % 26] + w
            j = j // 26 - 1
            if j < 0:
                return w

    return " ".join(word(rng.randrange(26, 600)) for _ in range(words))


def sized(d: Daemon, name: str, text: str, n: int) -> str:
    """``text`` cut to its first ``n`` tokens."""
    ids = d.tokenize(name, text)
    if len(ids) < n:
        raise RuntimeError(f"the text has {len(ids)} tokens, fewer than {n}")
    return d.detokenize(name, [int(t) for t in ids[:n]]).strip()


@dataclass
class Model:
    name: str
    gguf: Path
    num_ctx: int
    system_tokens: int
    text: Callable[[random.Random, int], str]
    words_per_token: float


def models(work: Path, which: list[str]) -> list[Model]:
    out = []
    if "smol" in which:
        smol = smollm2_path()
        if smol is None:
            sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
        out.append(Model("smol", smol, 8192, 4096, english, 1.0))
    if "tiny" in which:
        gguf = write_tiny_gguf(
            work / "tiny-16k.gguf",
            **TINY_SHAPE,
            context_length=32768,
            never_ends=True,
            chat_template=CHATML,
            seed=7,
        )
        out.append(Model("tiny", gguf, 32768, 16384, tiny_words, 1.0))
    return out


# -- part 1 and 2 (outside) ------------------------------------------------------------------------------------------
def question(m: Model, rng: random.Random, i: int) -> str:
    if m.name == "tiny":
        return tiny_words(rng, 12)
    return f"Question {i}: which rule in the text above says what to do with a {rng.choice(WORDS)} file?"


def warm_up(d: Daemon, name: str) -> None:
    """A short chat that shares no block with the measured prompts: the daemon's first request on a runner (its
    lazy imports, the chat template's compilation, the runner's first decode) is not counted in the measured one."""
    with contextlib.suppress(RuntimeError):  # a random-weight model may say nothing printable in 4 tokens
        d.chat(name, [{"role": "user", "content": "Say hello."}], tokens=4)


def ttft_round(m: Model, work: Path, r: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    kv = work / f"kv-{m.name}-{r}"
    logs = work / f"daemon-{m.name}.log"
    out: dict[str, Any] = {"round": r}
    d = Daemon(work, kv, logs)
    try:
        if m.name not in json.dumps(CLIENT.get(d.url + "/api/tags").json()):
            d.create(m.name, m.gguf, m.num_ctx)
        d.load(m.name)
        system = sized(d, m.name, m.text(rng, int(m.system_tokens * 1.3) + 200), m.system_tokens)
        qs = [question(m, rng, i) for i in range(5)]

        def ask(i: int, dd: Daemon) -> dict[str, Any]:
            return dd.chat(m.name, [{"role": "system", "content": system}, {"role": "user", "content": qs[i]}])

        warm_up(d, m.name)
        out["cold"] = ask(0, d)
        out["warm"] = ask(1, d)
        blocks = (out["cold"]["prompt"] - 1) // BLOCK
        d.wait_blocks(m.name, blocks)
    finally:
        d.stop()
    d = Daemon(work, kv, logs)
    try:
        d.load(m.name)
        warm_up(d, m.name)
        out["dropped"] = drop_caches()
        out["restart"] = ask(2, d)
        out["warm2"] = ask(3, d)
        out["kv_after_restart"] = d.kv_disk(m.name)
        d.unload(m.name)
        d.load(m.name)
        warm_up(d, m.name)
        out["unload"] = ask(4, d)
        out["kv_after_unload"] = d.kv_disk(m.name)
    finally:
        d.stop()
    n = out["restart"]["cached"] // BLOCK
    files = chain(block_files(kv), n)
    out["restored_blocks"] = len(files)
    out["restored_bytes"] = sum(f.size for f in files)
    reads = []
    for _ in range(3):
        drop_caches()
        reads.append(plain_read([f.path for f in files]))
    out["plain_read"] = statistics.median(reads)
    out["restore_s"] = out["restart"]["ttft"] - out["warm2"]["ttft"]
    out["disk_bytes"] = sum(f.size for f in block_files(kv))
    shutil.rmtree(kv, ignore_errors=True)
    return out


# -- part 2 (inside) -------------------------------------------------------------------------------------------------
class Timers:
    def __init__(self) -> None:
        self.t: dict[str, list[float]] = {}
        self.lock = threading.Lock()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                with self.lock:
                    self.t.setdefault(name, []).append(time.perf_counter() - start)

        return timed

    def total(self, name: str) -> float:
        return sum(self.t.get(name, []))


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def read_in_place(paths: list[Path], n_stream: int = 1, threads: int = 4) -> tuple[np.ndarray, float]:
    """A PROTOTYPE of the restore this bench proposes (it is not corral's code): every block file's payload is read
    with one ``preadv`` straight into its K and V rows' places in the joined state (kvblocks.join's layout), and
    its sha256 taken over those same bytes in file order, on ``threads`` threads; no payload ``bytes`` and no
    join copy. Non-transposed V only (flash attention on: what these models use on this CPU). Returns the state
    and the seconds it took; the caller compares it with kvblocks.join's."""
    from daemon.llama import kvblocks

    start = time.perf_counter()
    heads = []
    for p in paths:  # the header of each file: where its payload starts, its length and digest
        with p.open("rb") as f:
            head = f.read(_PREFIX.size)
            _, _, _, count, length, digest, klen, hlen, plen = _PREFIX.unpack(head)
            heads.append((p.stat().st_size - length, length, digest))
    with paths[0].open("rb") as f:  # the layout, from the first payload's own header
        f.seek(heads[0][0])
        _, _, cells = kvblocks._HEAD.unpack(f.read(kvblocks._HEAD.size))
        ext, v_trans, n_layer, n_v = kvblocks._LAYOUT.unpack(f.read(kvblocks._LAYOUT.size))
        if v_trans or ext:
            raise ValueError("the prototype handles non-transposed V without ext only")
        k = [kvblocks._ROW.unpack(f.read(kvblocks._ROW.size)) for _ in range(n_layer)]
        v = [(*kvblocks._ROW.unpack(f.read(kvblocks._ROW.size)), 0) for _ in range(n_v)]
    lay = kvblocks._Layout(ext=False, v_trans=False, n_layer=n_layer, k=tuple(k), v=tuple(v))
    n = cells * len(paths)
    data_at = 16 + 12 * n
    k_at, at = [], data_at + 8
    for _, row in lay.k:
        k_at.append(at + kvblocks._ROW.size)
        at += kvblocks._ROW.size + row * n
    v_at = []
    for _, row, _ in lay.v:
        v_at.append(at + kvblocks._ROW.size)
        at += kvblocks._ROW.size + row * n
    # anonymous memory of 4 KiB pages (numpy's own buffer asks for huge pages, whose first allocation after the
    # page cache was dropped can stall for compaction: 150 ms seen): its page faults are taken by the readers
    buf = np.frombuffer(mmap.mmap(-1, at + 4 * (n_stream - 1)), dtype=np.uint8)
    head_len = kvblocks._HEAD.size + len(lay.encode())

    def one(i: int) -> None:
        offset, length, digest = heads[i]
        scratch = bytearray(head_len + 4 * cells)
        views = [memoryview(scratch)]
        views += [
            buf[a + i * row * cells : a + (i + 1) * row * cells].data for a, (_, row) in zip(k_at, lay.k, strict=True)
        ]
        views += [
            buf[a + i * row * cells : a + (i + 1) * row * cells].data
            for a, (_, row, _) in zip(v_at, lay.v, strict=True)
        ]
        if sum(v.nbytes for v in views) != length:
            raise ValueError(f"block {i} is not of the first block's layout")
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            for chunk in range(0, len(views), 1000):  # IOV_MAX is 1024
                got = os.preadv(fd, views[chunk : chunk + 1000], offset)
                offset += got
        finally:
            os.close(fd)
        h = hashlib.sha256()
        for v in views:
            h.update(v)
        if h.digest() != digest:
            raise ValueError(f"block {i}: checksum mismatch")
        pos = np.frombuffer(scratch, dtype="<i4", count=cells, offset=head_len)
        if not np.array_equal(pos, np.arange(i * cells, (i + 1) * cells, dtype=pos.dtype)):
            raise ValueError(f"block {i} does not hold positions {i * cells}..")

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(paths))))
    struct.pack_into("<IiII", buf.data, 0, kvblocks.SEQ_MAGIC, 0, n_stream, n)
    meta = buf[16:data_at].view("<i4").reshape(n, 3)
    meta[:, 0] = np.arange(n, dtype="<i4")
    meta[:, 1] = 1
    meta[:, 2] = 0
    struct.pack_into("<II", buf.data, data_at, 0, lay.n_layer)
    for a, (t, row) in zip(k_at, lay.k, strict=True):
        kvblocks._ROW.pack_into(buf.data, a - kvblocks._ROW.size, t, row)
    for a, (t, row, _) in zip(v_at, lay.v, strict=True):
        kvblocks._ROW.pack_into(buf.data, a - kvblocks._ROW.size, t, row)
    buf[at:] = 0
    return buf, time.perf_counter() - start


def profile_model(m: Model, work: Path, prompt: list[int], rounds: int) -> dict[str, Any]:
    import llama_cpp

    from daemon.llama import kvdisk
    from daemon.llama.runner import Runner
    from daemon.runners.kvstore import KVStore
    from daemon.runners.protocol import LoadSpec, SampleParams
    from tests.runners.test_compute_thread import _KEEP, Chan

    kv = work / f"kv-profile-{m.name}"
    key = json.dumps({"model": "bench-" + m.name, "kv_type": "f16", "flash_attn": "auto"}, sort_keys=True)
    spec = LoadSpec(
        model_path=str(m.gguf),
        num_ctx=m.num_ctx,
        num_parallel=1,
        num_batch=512,
        kv_disk_dir=str(kv),
        kv_disk_bytes=8 << 30,
        kv_key=key,
    )
    params = SampleParams(num_predict=4, temperature=0, repeat_penalty=1.0, seed=1)

    def ask(runner: Runner, chan: Chan, rid: int) -> tuple[float, dict[str, Any]]:
        start = time.monotonic()
        runner.engine.submit(rid, prompt, params)
        while not chan.done.is_set():
            time.sleep(0.001)
        chan.done.clear()
        first = next(t for msg, t in zip(chan.msgs, chan.times, strict=True) if msg.get("type") == "token")
        done = next(msg for msg in chan.msgs if msg.get("type") in ("done", "error"))
        assert done["type"] == "done", done
        return first - start, done

    chan = Chan()
    runner = Runner(chan)  # type: ignore[arg-type]
    _KEEP.append(runner)
    runner.load(spec)
    cold, _ = ask(runner, chan, 1)
    runner.close()
    runs = []
    for rid in range(2, 2 + rounds):  # a new runner each time, the page cache dropped: a restart's restore
        timers = Timers()
        chan = Chan()
        runner = Runner(chan)  # type: ignore[arg-type]
        _KEEP.append(runner)
        runner.load(spec)
        disk = runner.engine.disk
        set_data = llama_cpp.llama_state_seq_set_data
        with (
            patched(KVStore, "load", timers.wrap("read+check", KVStore.load)),
            patched(kvdisk, "join", timers.wrap("join", kvdisk.join)),
            patched(disk, "_read", timers.wrap("lookup", disk._read)),
            patched(llama_cpp, "llama_state_seq_set_data", timers.wrap("set_data", set_data)),
        ):
            dropped = drop_caches()
            ttft, done = ask(runner, chan, rid)
        runner.close()
        runs.append({"ttft": ttft, "cached": int(done["prompt_cached"]), "dropped": dropped})
        runs[-1].update({name: timers.total(name) for name in ("lookup", "read+check", "join", "set_data")})
    n = min(r["cached"] for r in runs) // BLOCK
    files = [f.path for f in chain(block_files(kv), n)]
    size = sum(p.stat().st_size for p in files)
    reads: dict[str, list[float]] = {"plain": [], "plain_sha": [], "plain_hot": [], "in_place": []}
    payloads = [p.read_bytes()[-_payload_len(p) :] for p in files]
    joined = bytes(kvdisk.join(payloads, 1))
    del payloads
    for _ in range(3):
        drop_caches()
        reads["plain"].append(plain_read(files))
        drop_caches()
        reads["plain_sha"].append(plain_read(files, digest=True))
        reads["plain_hot"].append(plain_read(files))
        # the proposed restore, on the same files (page cache dropped), checked against kvblocks.join's state
        drop_caches()
        with contextlib.suppress(ValueError):  # a layout the prototype does not handle: no figure
            state, took = read_in_place(files)
            if bytes(state.data) != joined:
                raise RuntimeError("the prototype's state differs from kvblocks.join's")
            reads["in_place"].append(took)
    shutil.rmtree(kv, ignore_errors=True)
    out: dict[str, Any] = {"model": m.name, "prompt": len(prompt), "cold": cold, "bytes": size, "blocks": len(files)}
    out["runs"] = runs
    out["dropped"] = all(r["dropped"] for r in runs)
    for name in ("ttft", "cached", "lookup", "read+check", "join", "set_data"):
        out[name] = statistics.median(r[name] for r in runs)
    out["rest"] = statistics.median(r["ttft"] - r["lookup"] - r["set_data"] for r in runs)
    out["restore"] = statistics.median(r["lookup"] + r["set_data"] for r in runs)
    for name, values in reads.items():
        out[name] = statistics.median(values) if values else None
    return out


def tails(m: Model, work: Path, prefix: int = 8192) -> dict[str, list[tuple[int, float]]]:
    """TTFT of a prompt whose first ``prefix`` tokens are in the slot, by the length of the rest (the engine
    in-process, one runner, flash attention auto and off): why an in-RAM hit can be slower than a restore."""
    from daemon.llama.runner import Runner
    from daemon.runners.protocol import LoadSpec, SampleParams
    from tests.runners.test_compute_thread import _KEEP, Chan

    rng = random.Random(1)
    base = [1] + [300 + rng.randrange(1600) for _ in range(prefix - 1)]
    params = SampleParams(num_predict=1, temperature=0, repeat_penalty=1.0, seed=1)
    out: dict[str, list[tuple[int, float]]] = {}
    for fa in ("auto", "off"):
        chan = Chan()
        runner = Runner(chan)  # type: ignore[arg-type]
        _KEEP.append(runner)
        runner.load(LoadSpec(model_path=str(m.gguf), num_ctx=m.num_ctx, num_parallel=1, num_batch=512, flash_attn=fa))
        rows = []
        for rid, tail in enumerate([8, 16, 32, 48, 63, 64, 96, 128, 256]):
            start = time.monotonic()
            runner.engine.submit(rid, base + [300 + rng.randrange(1600) for _ in range(tail)], params)
            while not chan.done.is_set():
                time.sleep(0.001)
            chan.done.clear()
            first = next(t for msg, t in zip(chan.msgs, chan.times, strict=True) if msg.get("id") == rid)
            if rid:  # the first one is the cold run that fills the slot
                rows.append((tail, first - start))
        runner.close()
        out[fa] = rows
        print(fa, rows, flush=True)
    return out


def profile_prompt(m: Model, work: Path, seed: int) -> list[int]:
    """A prompt of the system prompt's length and a question, as token ids (from a daemon's tokenizer)."""
    rng = random.Random(seed)
    d = Daemon(work, work / "kv-tokenize", work / f"daemon-{m.name}.log")
    try:
        if m.name not in json.dumps(CLIENT.get(d.url + "/api/tags").json()):
            d.create(m.name, m.gguf, m.num_ctx)
        text = m.text(rng, int(m.system_tokens * 1.3) + 200)
        ids = [int(t) for t in d.tokenize(m.name, text)][: m.system_tokens]
        ids += [int(t) for t in d.tokenize(m.name, "\n" + question(m, rng, 0))]
        return ids
    finally:
        d.stop()


# -- part 3 ----------------------------------------------------------------------------------------------------------
def share(work: Path, seed: int, n_conv: int = 20) -> dict[str, Any]:
    smol = smollm2_path()
    if smol is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    m = Model("smol", smol, 8192, 2048, english, 1.0)
    rng = random.Random(seed)
    kv = work / "kv-share"
    logs = work / "daemon-share.log"
    d = Daemon(work, kv, logs)
    out: dict[str, Any] = {"conversations": n_conv}
    try:
        if m.name not in json.dumps(CLIENT.get(d.url + "/api/tags").json()):
            d.create(m.name, m.gguf, m.num_ctx)
        d.load(m.name)
        system = sized(d, m.name, english(rng, 2900), 2048)
        users = [sized(d, m.name, english(rng, 500), 300) + "\nWhat is the rule here?" for _ in range(n_conv)]
        convs = [[{"role": "system", "content": system}, {"role": "user", "content": u}] for u in users]
        first = []
        for c in convs:
            res = d.chat(m.name, c)
            first.append(res)
            c.append({"role": "assistant", "content": res["text"]})
            c.append({"role": "user", "content": "And the next one?"})
        want = 2048 // BLOCK + n_conv  # the shared blocks and at least one of each conversation's own
        out["kv_first"] = d.wait_blocks(m.name, want)
    finally:
        d.stop()
    files = block_files(kv)
    chains = leaves(files)
    out["files"] = len(files)
    out["disk_bytes"] = sum(f.size for f in files)
    out["independent_bytes"] = sum(sum(f.size for f in c) for c in chains)
    out["chains"] = len(chains)
    out["blocks_per_conv"] = statistics.median(len(c) for c in chains) if chains else 0
    out["block_bytes"] = statistics.median(f.size for f in files) if files else 0
    out["first_prompt"] = statistics.median(r["prompt"] for r in first)
    out["first_cached"] = [r["cached"] for r in first]
    d = Daemon(work, kv, logs)
    try:
        d.load(m.name)
        second = [d.chat(m.name, c) for c in convs]
        out["kv_second"] = d.kv_disk(m.name)
    finally:
        d.stop()
    out["second_prompt"] = statistics.median(r["prompt"] for r in second)
    out["second_cached"] = [r["cached"] for r in second]
    out["second_ttft"] = statistics.median(r["ttft"] for r in second)
    out["first_ttft"] = statistics.median(r["ttft"] for r in first[1:])
    shutil.rmtree(kv, ignore_errors=True)
    return out


# -- report ----------------------------------------------------------------------------------------------------------
def med(rows: list[dict[str, Any]], f: Callable[[dict[str, Any]], float]) -> float:
    return statistics.median(f(r) for r in rows)


def machine() -> str:
    model, cores = "?", os.cpu_count()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    return f"{model}, {cores} cores (lscpu), {os.cpu_count()} CPUs shared with other work"


def report(
    head: dict[str, str],
    ttft: dict[str, list[dict[str, Any]]],
    prof: list[dict[str, Any]],
    sh: dict[str, Any] | None,
    tail_rows: dict[str, list[tuple[int, float]]] | None = None,
) -> str:
    mib = 1 << 20
    lines = [
        SECTION,
        "",
        f"`{head['command']}` ({head['date']}; {head['machine']}; a noisy machine: other sessions "
        "run tests on the same 2 cores, so every figure is a median over rounds). Method and models: the docstring "
        "of bench/kv_disk.py. Through a real daemon (CORRAL_NUM_PARALLEL=1), `/v1/chat/completions` streamed, "
        "system prompt + question, greedy; TTFT at the client; `cached` = usage's `cached_tokens`.",
        "",
    ]
    if ttft:
        lines += [
            "TTFT (median over rounds, seconds; prompt tokens / cached tokens of the median round in brackets):",
            "",
            "| model, system prompt | rounds | cold | warm (RAM) | restart (disk, page cache dropped) | "
            "restart / cold (goal) | unload (disk, page cache warm) | unload / cold |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, rows in ttft.items():
            goal = "0.15" if name == "smol" else "0.1"
            label = "SmolLM2-135M Q4_1, 4,096 tokens" if name == "smol" else "random 4x512 llama, 16,384 tokens"
            cold = med(rows, lambda r: r["cold"]["ttft"])
            rs = med(rows, lambda r: r["restart"]["ttft"])
            un = med(rows, lambda r: r["unload"]["ttft"])
            mid = sorted(rows, key=lambda r: r["restart"]["ttft"])[len(rows) // 2]
            ratio = med(rows, lambda r: r["restart"]["ttft"] / r["cold"]["ttft"])
            ratio_u = med(rows, lambda r: r["unload"]["ttft"] / r["cold"]["ttft"])
            ok = "met" if ratio <= float(goal) else "MISSED"
            lines.append(
                f"| {label} | {len(rows)} | {cold:.2f} ({mid['cold']['prompt']}/{mid['cold']['cached']}) "
                f"| {med(rows, lambda r: r['warm']['ttft']):.3f} ({mid['warm']['prompt']}/{mid['warm']['cached']}) "
                f"| {rs:.3f} ({mid['restart']['prompt']}/{mid['restart']['cached']}) "
                f"| {ratio:.3f}x (<= {goal}x: {ok}) "
                f"| {un:.3f} ({mid['unload']['prompt']}/{mid['unload']['cached']}) | {ratio_u:.3f}x |"
            )
        lines += [
            "",
            "Restore read throughput, measured from outside (restore time = restart TTFT - the TTFT of the next "
            "question on that runner, prefix in RAM; bytes = the block files of the restored prefix; plain read = "
            "the same files read one after the other, page cache dropped, median of 3). A difference of two TTFTs "
            "that each evaluate a prompt tail at 4k-16k positions: the noise of this machine is larger than the "
            "restore at 16k (see the inside measurement below, which the verdict is taken from):",
            "",
            "| model | blocks restored | bytes | restore time | restore MiB/s | plain read | plain MiB/s | "
            "restore / plain |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, rows in ttft.items():
            rest = med(rows, lambda r: r["restore_s"])
            plain = med(rows, lambda r: r["plain_read"])
            size = med(rows, lambda r: r["restored_bytes"])
            ratio = med(rows, lambda r: r["plain_read"] / max(r["restore_s"], 1e-6))
            lines.append(
                f"| {name} | {med(rows, lambda r: r['restored_blocks']):.0f} | {size / mib:.1f} MiB | "
                f"{1000 * rest:.0f} ms | {f'{size / mib / rest:.0f}' if rest > 0 else 'n/a (noise)'} MiB/s | "
                f"{1000 * plain:.0f} ms | "
                f"{size / mib / plain:.0f} MiB/s | {f'{ratio:.2f}x' if rest > 0 else 'n/a'} |"
            )
        dropped = all(r["dropped"] for rows in ttft.values() for r in rows)
        lines += [
            "",
            "Page cache dropped before the restart request and before each plain read: "
            + ("yes (`echo 3 > /proc/sys/vm/drop_caches` as root, after `sync`)." if dropped else "NO (not root)."),
            "",
            "Per round (cold / warm / restart / warm after restart / unload TTFT in s; cached tokens at the restart; "
            "kv_disk after the restart):",
            "",
        ]
        for name, rows in ttft.items():
            for r in rows:
                kvr = r["kv_after_restart"]
                lines.append(
                    f"- {name} round {r['round']}: {r['cold']['ttft']:.2f} / {r['warm']['ttft']:.3f} / "
                    f"{r['restart']['ttft']:.3f} / {r['warm2']['ttft']:.3f} / {r['unload']['ttft']:.3f}; cached "
                    f"{r['restart']['cached']} of {r['restart']['prompt']}; hits {kvr.get('hits')}, misses "
                    f"{kvr.get('misses')}, restored {kvr.get('restored_tokens')} tokens; "
                    f"{r['disk_bytes'] / mib:.1f} MiB on disk"
                )
    if prof:
        lines += [
            "",
            "Where the time after a restart goes, inside: the runner's engine in-process (daemon/llama/runner.py, "
            "the same code as the daemon's runner child, LoadSpec num_ctx as above, num_parallel 1, num_batch 512), "
            f"one cold run that writes the blocks, then {len(prof[0]['runs'])} restored runs, each on a new Runner "
            "with the page cache dropped; medians, ms (cold TTFT in s). The lookup runs on the prefetch thread while "
            "the request waits to be admitted: read + check (`KVStore.load`: open, read, header checks, sha256, 4 "
            "threads) and `kvblocks.join`; then `llama_state_seq_set_data` on the engine thread; the rest is "
            "evaluating the "
            "prompt's tail and the first token.",
            "",
            "| model | prompt / restored | cold TTFT | restored TTFT | lookup | of it: read + check | of it: join | "
            "set_data | the rest |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in prof:
            lines.append(
                f"| {p['model']} | {p['prompt']} / {p['cached']:.0f} | {p['cold']:.2f} s | {1000 * p['ttft']:.0f} | "
                f"{1000 * p['lookup']:.0f} | {1000 * p['read+check']:.0f} | {1000 * p['join']:.0f} | "
                f"{1000 * p['set_data']:.0f} | {1000 * p['rest']:.0f} |"
            )

        def rate(p: dict[str, Any], seconds: float | None) -> str:
            if not seconds:
                return "-"
            return f"{1000 * seconds:.0f} ms, {p['bytes'] / mib / seconds:.0f} MiB/s, {p['plain'] / seconds:.2f}x"

        lines += [
            "",
            "Restore read throughput against a plain sequential read of the same block files (bytes / time; the "
            "ratio to the plain read; page cache dropped before each; medians of 3 plain reads). Goal: the restore "
            ">= 0.5x. The restore = lookup + set_data above; read + check alone; and a PROTOTYPE of the fix "
            "proposed below (bench/kv_disk.py `read_in_place`, not corral's code: each payload read by one `preadv` "
            "straight into its rows' places in the joined state, sha256 over the same bytes, 4 threads; its state "
            "checked equal to `kvblocks.join`'s):",
            "",
            "| model | bytes | plain read | restore (goal >= 0.5x) | read + check only | prototype: read in place | "
            "plain read + sha256 | plain read, page cache warm |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in prof:
            ok = "met" if p["plain"] / p["restore"] >= 0.5 else "MISSED"
            lines.append(
                f"| {p['model']} | {p['bytes'] / mib:.1f} MiB | {1000 * p['plain']:.0f} ms, "
                f"{p['bytes'] / mib / p['plain']:.0f} MiB/s | {rate(p, p['restore'])} ({ok}) | "
                f"{rate(p, p['read+check'])} | {rate(p, p['in_place'])} | {rate(p, p['plain_sha'])} | "
                f"{rate(p, p['plain_hot'])} |"
            )
    if sh:
        kv1, kv2 = sh["kv_first"], sh["kv_second"]
        saved = 1 - sh["disk_bytes"] / max(sh["independent_bytes"], 1)
        lines += [
            "",
            f"Twenty conversations, one 2,048-token system prompt (SmolLM2, each its own ~300-token user turn; "
            f"{sh['first_prompt']:.0f} prompt tokens each):",
            "",
            f"- on disk: {sh['files']} block files, {sh['disk_bytes'] / mib:.1f} MiB; twenty independent copies "
            f"({sh['chains']} chains of {sh['blocks_per_conv']:.0f} blocks of {sh['block_bytes'] / mib:.2f} MiB): "
            f"{sh['independent_bytes'] / mib:.1f} MiB; the shared blocks save {100 * saved:.0f}% "
            f"({sh['disk_bytes'] / max(sh['independent_bytes'], 1):.3f}x).",
            f"- first turns (one daemon): hits {kv1.get('hits')}, misses {kv1.get('misses')}: from the second "
            f"conversation on the runner's slot holds the shared prefix, and the disk is not read for what RAM "
            f"holds (cached tokens {statistics.median(sh['first_cached']):.0f} per request, median TTFT "
            f"{sh['first_ttft']:.3f} s).",
            f"- second turns after a daemon restart: hits {kv2.get('hits')}, misses {kv2.get('misses')}, hit rate "
            f"{kv2.get('hit_rate')}, {kv2.get('restored_tokens')} tokens restored; cached tokens per request "
            f"(median) {statistics.median(sh['second_cached']):.0f} of {sh['second_prompt']:.0f}, median TTFT "
            f"{sh['second_ttft']:.3f} s.",
        ]
    if tail_rows:
        lines += [
            "",
            "Why an in-RAM hit can be slower than a restore: TTFT (s) of a prompt whose first 8,192 tokens are in the "
            "slot, by the number of new tokens after them (the random 4x512 model, the engine in-process, one "
            "runner per flash-attention setting; `--parts tails`):",
            "",
            "| flash attention | " + " | ".join(str(t) for t, _ in tail_rows["auto"]) + " |",
            "|---|" + "---|" * len(tail_rows["auto"]),
        ]
        for fa, rows in tail_rows.items():
            lines.append(f"| {fa} | " + " | ".join(f"{x:.2f}" for _, x in rows) + " |")
    lines += reading(ttft, prof, sh)
    return "\n".join(wrap(line) for line in lines) + "\n"


def wrap(line: str) -> str:
    """Prose and list items wrapped at 120 columns, as the rest of docs/benchmarks.md; tables and headings not."""
    if not line or line.startswith(("|", "#")):
        return line
    indent = "  " if line.startswith("- ") else ""
    return textwrap.fill(line, 120, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def reading(ttft: dict[str, list[dict[str, Any]]], prof: list[dict[str, Any]], sh: dict[str, Any] | None) -> list[str]:
    """What the numbers say, from the numbers (a rerun rewrites it with its own)."""
    out = ["", "Reading:", ""]
    for name, rows in ttft.items():
        goal = 0.15 if name == "smol" else 0.1
        ratio = med(rows, lambda r: r["restart"]["ttft"] / r["cold"]["ttft"])
        p = next((x for x in prof if x["model"] == name), None)
        inside = ""
        if p is not None:
            inside = (
                f"; inside, the restore (lookup + set_data) is {1000 * p['restore']:.0f} ms of a "
                f"{1000 * p['ttft']:.0f} ms TTFT, the rest evaluating the prompt's tail and the first token"
            )
        out.append(
            f"- {name}: after a restart the first token comes in {ratio:.3f}x the cold time (goal <= {goal}x: "
            f"{'met' if ratio <= goal else 'MISSED'}), every whole block of the system prompt restored "
            f"({rows[0]['restart']['cached']} of {rows[0]['restart']['prompt']} tokens cached){inside}."
        )
        if med(rows, lambda r: r["warm"]["ttft"]) > med(rows, lambda r: r["restart"]["ttft"]):
            out.append(
                f"- {name}: the in-RAM TTFT ({med(rows, lambda r: r['warm']['ttft']):.2f} s) is above the restored "
                f"one ({med(rows, lambda r: r['restart']['ttft']):.2f} s) in these rounds. Both evaluate the rest "
                "of the prompt after what they hold: the in-RAM hit the 46 tokens after the longest cached prefix, "
                "the restore the 98 after the last whole block; and with flash attention on, llama.cpp's CPU kernel "
                "is several times slower for fewer than 64 new tokens at long contexts with this model's "
                "32-wide heads (the tails table above; SmolLM2's 64-wide heads showed no such step in a run under "
                "heavy load). It is why the outside restore time is negative for this model, and it slows in-RAM "
                "hits of short turns as much: an engine that evaluates at least 64 tokens (re-evaluating a few "
                "cached ones) would take the fast path."
            )
    for p in prof:
        ratio = p["plain"] / p["restore"]
        without = p["plain"] / (p["restore"] - p["join"])
        out.append(
            f"- {p['model']}: the restore reads {p['bytes'] / (1 << 20):.0f} MiB at {ratio:.2f}x the plain read "
            f"(goal >= 0.5x: {'met' if ratio >= 0.5 else 'MISSED'}). Reading and checking the blocks "
            f"({1000 * p['read+check']:.0f} ms) runs at {p['plain'] / p['read+check']:.2f}x the plain read (the "
            f"sha256 hidden behind 4 reader threads); `kvblocks.join` then takes {1000 * p['join']:.0f} ms, "
            f"{100 * p['join'] / p['restore']:.0f}% of the restore, and `llama_state_seq_set_data` "
            f"{1000 * p['set_data']:.0f} ms. Without the join's time the restore would be {without:.2f}x."
        )
    if prof:
        out.append(
            "- Why the join costs nearly as much as the read: it writes every byte once more. It writes them in one "
            "pass into anonymous memory the kernel maps in advance (`MAP_POPULATE`, commit ab47d6c; before, "
            '`b"".join` into a fresh `bytes` took a page fault per 4 KiB written: 61 ms for SmolLM2\'s 90 MiB, now '
            "46), and the payloads it reads from are fresh `bytes` from `os.read`. Next step (not made): read "
            "each block's payload straight into its place in the joined state. kvblocks "
            "gives the layout from the first block's header (where each layer's K and V rows of block i go); "
            "`KVStore.load` reads each file's payload with one `os.preadv` into memoryviews of one anonymous "
            "`mmap` buffer at those offsets (its page faults then spread over the 4 reader threads; numpy's own "
            "buffer asks for huge pages, whose first allocation right after a page-cache drop stalled 150-190 ms "
            "in compaction in a few of our tries) and takes the sha256 over the same views in file order; the "
            "positions go to a small scratch and are checked; the join is left writing the header and the cells' "
            "metadata. A transposed V (flash attention off), whose rows scatter element by element past "
            "`IOV_MAX` (1024), keeps today's join. The prototype column above is that, in this script: "
            + ", ".join(
                f"{p['model']} {p['plain'] / p['in_place']:.2f}x the plain read" for p in prof if p.get("in_place")
            )
            + " (its state checked byte for byte against `kvblocks.join`'s)."
        )
        out.append(
            "- The random model's KV cache is small (4 KiB per token: 64 MiB at 16k), so its restore is a small part "
            "of its TTFT. A 7-8B model keeps ~128 KiB per token (2 GiB at 16k): there the restore's throughput is "
            "what the time after a restart is made of, and the join's copy and page faults grow with it."
        )
    if sh is not None:
        out.append(
            f"- Twenty conversations: {sh['disk_bytes'] / max(sh['independent_bytes'], 1):.3f}x the bytes of twenty "
            f"independent copies ({sh['files']} block files: the system prompt's {sh['files'] - sh['chains']} "
            f"shared, one of each conversation's own); after a restart every second turn was a hit "
            f"({sh['kv_second'].get('hits')} hits, {sh['kv_second'].get('misses')} misses)."
        )
    return out


def write_section(path: Path, text: str) -> None:
    doc = path.read_text()
    start = doc.find(SECTION)
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        end = doc.find("\n## ", start + len(SECTION))
        doc = doc[:start] + text + (doc[end + 1 :] if end >= 0 else "")
        doc = doc.replace(text + "## ", text + "\n## ")
    path.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="ttft,profile,share,tails")
    ap.add_argument("--models", default="smol,tiny")
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--write", type=Path)
    ap.add_argument("--json", type=Path, help="also write the raw results (and the command, date, machine) here")
    ap.add_argument("--from-json", type=Path, help="measure nothing: write the report of a --json file again")
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        ttft, prof, sh, head = data["ttft"], data["profile"], data["share"], data["head"]
        args.tails = data.get("tails")
    else:
        command = [a for a in sys.argv[1:] if not a.startswith("--json")]
        if "--json" in sys.argv[1:]:
            at = sys.argv.index("--json")
            command = sys.argv[1:at] + sys.argv[at + 2 :]
        head = {
            "command": " ".join([".venv/bin/python bench/kv_disk.py", *command]),
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
        }
        args.tails = None
        ttft, prof, sh = measure(args)
    text = report(head, ttft, prof, sh, args.tails)
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"head": head, "ttft": ttft, "profile": prof, "share": sh, "tails": args.tails}, indent=1, default=str
            )
        )
    if args.write:
        write_section(args.write, text)


def measure(
    args: argparse.Namespace,
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]], dict[str, Any] | None]:
    parts = args.parts.split(",")
    ttft: dict[str, list[dict[str, Any]]] = {}
    prof: list[dict[str, Any]] = []
    sh = None
    with tempfile.TemporaryDirectory(prefix="corral-kvbench-") as tmp:
        work = Path(tmp)
        ms = models(work, args.models.split(","))
        if "ttft" in parts:
            for m in ms:
                ttft[m.name] = []
                for r in range(args.rounds):
                    row = ttft_round(m, work, r, args.seed * 1000 + r)
                    ttft[m.name].append(row)
                    print(
                        f"{m.name} round {r}: cold {row['cold']['ttft']:.2f}s, warm {row['warm']['ttft']:.3f}s, "
                        f"restart {row['restart']['ttft']:.3f}s (cached {row['restart']['cached']}/"
                        f"{row['restart']['prompt']}), warm2 {row['warm2']['ttft']:.3f}s, unload "
                        f"{row['unload']['ttft']:.3f}s (cached {row['unload']['cached']}); restored "
                        f"{row['restored_bytes'] >> 20} MiB, plain read {row['plain_read']:.3f}s, dropped "
                        f"{row['dropped']}",
                        flush=True,
                    )
        if "profile" in parts:
            for m in ms:
                p = profile_model(m, work, profile_prompt(m, work, args.seed + 99), args.rounds)
                prof.append(p)
                print(json.dumps(p), flush=True)
        if "share" in parts:
            sh = share(work, args.seed + 7)
            print(json.dumps(sh), flush=True)
        if "tails" in parts:
            tiny = next((m for m in ms if m.name == "tiny"), None) or models(work, ["tiny"])[0]
            args.tails = tails(tiny, work)
    return ttft, prof, sh


if __name__ == "__main__":
    main()
