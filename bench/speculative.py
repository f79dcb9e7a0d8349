"""Speculative decoding (issue 28): corral with a draft model and with n-gram prompt lookup, against itself without
speculation and against llama-server on the same files, in the same run.

Usage: bench/setup_peers.sh && .venv/bin/python bench/speculative.py [--rounds 5] [--tokens 256]
       [--drafts Q4_K_S] [--ngram 3] [--draft-max 16] [--draft-min 0] [--draft-p-min 0.75]
       [--streams 16] [--stream-rounds 3] [--stream-tokens 64] [--configs corral,corral-draft,...]
       [--write docs/benchmarks.md]

Files. The target is SmolLM2-135M-Instruct at F16, written once from the cached Q4_1 file
(scripts/fetch_smollm2.py) with the ``gguf`` package: every quantized tensor dequantized to F16 (the F32 ones kept),
the same metadata with ``general.file_type`` F16; it is cached as ~/.cache/corral-bench/SmolLM2-135M-Instruct-F16.gguf.
Each draft (``--drafts``, comma-separated) is that target quantized by corral itself: ``POST /api/create`` with
``quantize`` (what ``corral create -q TYPE`` sends) in the benchmark's daemon; llama-server loads the very blob
corral wrote (its path from ``/api/show``'s Modelfile).

Configurations (``--configs``, all by default; a missing peer binary leaves its rows out with a note):

* ``corral``: no speculation (model ``bench``);
* ``corral-draft``: the draft model per request, ``options.draft_model`` (model ``spec-TYPE``, the same target blob
  under another name, so its runner keeps its draft loaded while ``bench``'s keeps none);
* ``corral-ngram``: prompt lookup, ``options.draft_ngram`` (model ``bench``: no reload, the option is per request);
* ``draft-alone``: the draft model by itself (model ``draft-TYPE``, no speculation): what one of its tokens costs
  against one of the target's;
* ``llama-server``: no speculation;
* ``llama-server-draft``: ``--spec-type draft-simple --model-draft`` with ``--spec-draft-n-max/-n-min/-p-min``;
* ``llama-server-ngram``: ``--spec-type ngram-simple`` with ``--spec-ngram-simple-size-n`` (the n-gram length)
  and ``--spec-ngram-simple-size-m`` (the longest draft).

Both servers get the same speculation settings (``--draft-max``, ``--draft-min``, ``--draft-p-min``, ``--ngram``;
the defaults are corral's option defaults and an n-gram of 3). llama-server runs one slot (``-np 1``, ``-c`` the
context): it only serves the single-stream rows.

Single stream: greedy (temperature 0, no repeat penalty), ``--tokens`` tokens, streamed through the chat APIs
(corral's ``/api/chat``, llama-server's ``/v1/chat/completions``: both apply the model's chat template), two
prompts: a chat question, and a code edit that repeats most of its input (rename a variable in a 60-line function).
Every configuration is up at once (idle servers use no CPU: checked) and they take turns in an order that rotates
each round. tok/s = (completion tokens - 1) / (time from the first streamed token to the last), at the client: the
first token is the prompt's, the rest is decoding. The servers' own rates are shown beside it (corral:
``eval_count / eval_duration``; llama-server: ``timings.predicted_per_second``). ``draft_n`` / ``draft_n_accepted``
come from corral's final object and llama-server's ``timings``; the acceptance rate is their quotient. The text of
every configuration is compared with the same server's without speculation (greedy speculation must not change it),
llama-server's without speculation with corral's.

Many streams: ``--streams`` simultaneous greedy chat requests (the chat prompt) on corral with each speculation
configuration against without, ``--stream-tokens`` tokens each, ``--stream-rounds`` rounds, aggregate tokens / wall
time from the first request to the last token; the ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching

CACHE = Path(os.environ.get("CORRAL_BENCH_DIR", Path.home() / ".cache" / "corral-bench"))
TARGET = CACHE / "SmolLM2-135M-Instruct-F16.gguf"
LOG = CACHE / "speculative-corral.log"
HEAD = "## Speculative decoding: a draft model and prompt lookup (issue 28)"
CTX = 2048
PEER = batching.LLAMA_SERVER
T = TypeVar("T")
CONFIGS = (
    "corral",
    "corral-draft",
    "corral-ngram",
    "draft-alone",
    "llama-server",
    "llama-server-draft",
    "llama-server-ngram",
)

CHAT = (
    "I have started working from home and I feel tired and distracted by the afternoon. "
    "What are five good habits that would help me stay healthy and focused? Explain each one in a short paragraph."
)

FUNCTION = '''\
def summarize_orders(orders, tax_rate, discounts):
    """Totals per customer, with tax and discounts applied."""
    x = {}
    for order in orders:
        customer = order["customer"]
        if customer not in x:
            x[customer] = {"count": 0, "net": 0.0, "tax": 0.0, "gross": 0.0}
        amount = 0.0
        for item in order["items"]:
            price = item["price"] * item["quantity"]
            if item.get("sku") in discounts:
                price = price * (1 - discounts[item["sku"]])
            amount += price
        x[customer]["count"] += 1
        x[customer]["net"] += amount
        x[customer]["tax"] += amount * tax_rate
        x[customer]["gross"] += amount * (1 + tax_rate)
    for customer in x:
        entry = x[customer]
        if entry["count"] > 0:
            entry["average"] = entry["gross"] / entry["count"]
        else:
            entry["average"] = 0.0
        entry["net"] = round(entry["net"], 2)
        entry["tax"] = round(entry["tax"], 2)
        entry["gross"] = round(entry["gross"], 2)
        entry["average"] = round(entry["average"], 2)
    best = None
    for customer in x:
        if best is None or x[customer]["gross"] > x[best]["gross"]:
            best = customer
    worst = None
    for customer in x:
        if worst is None or x[customer]["gross"] < x[worst]["gross"]:
            worst = customer
    total_net = 0.0
    total_tax = 0.0
    total_gross = 0.0
    for customer in x:
        total_net += x[customer]["net"]
        total_tax += x[customer]["tax"]
        total_gross += x[customer]["gross"]
    report = {
        "customers": x,
        "best": best,
        "worst": worst,
        "total_net": round(total_net, 2),
        "total_tax": round(total_tax, 2),
        "total_gross": round(total_gross, 2),
    }
    if len(x) == 0:
        report["average_gross"] = 0.0
    else:
        report["average_gross"] = round(total_gross / len(x), 2)
    return report
'''

EDIT = (
    "Rename the variable `x` to `totals` everywhere in this Python function. Reply with the whole function and "
    f"nothing else.\n\n```python\n{FUNCTION}```"
)

PROMPTS = {"chat": CHAT, "edit": EDIT}


# -- the files -------------------------------------------------------------------------------------------------------
def write_target(source: Path, out: Path) -> Path:
    """``source`` with every quantized tensor dequantized to F16 (F32 and F16 tensors as they are) and the same
    metadata, ``general.file_type`` set to F16: written to a temporary name, then renamed."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        if key == "general.quantization_version":
            continue  # nothing in the file is quantized any more
        kind = f.types[0]
        sub = f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), kind, sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = np.array(t.data)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
        # the reader's shape is ggml's (innermost first); numpy's is the reverse
        writer.add_tensor(t.name, data.reshape(tuple(reversed([int(d) for d in t.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def target_path() -> Path:
    if TARGET.is_file():
        return TARGET
    source = batching.smollm2_path()
    if source is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"writing {TARGET} (F16, from {source})", flush=True)
    return write_target(source, TARGET)


# -- the servers -----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    tokens: int  # completion tokens
    first: float  # seconds from the request to the first streamed token
    last: float  # ... to the last one
    text: str
    server_tps: float  # the server's own decoding rate
    draft_n: int | None  # None: the server did not say
    draft_n_accepted: int | None

    @property
    def tps(self) -> float:
        span = self.last - self.first
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0


def _fail(what: str, r: httpx.Response) -> None:
    if r.status_code not in (200, 201):
        r.read()
        sys.exit(f"{what}: HTTP {r.status_code}: {r.text[:500]} (corral's daemon log: {LOG})")


class Corral(batching.Corral):
    """corral's daemon (``CORRAL_NUM_PARALLEL`` slots) with model ``bench`` (the F16 target), and for each draft
    type Q a model ``draft-Q`` (the target quantized by corral's create) and ``spec-Q`` (the target again, the model
    requests name with ``options.draft_model``)."""

    name = "corral"

    def __init__(self, gguf: Path, work: Path, slots: int, quants: list[str]) -> None:
        self.port = batching.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
        env.update(
            {
                "CORRAL_HOST": f"127.0.0.1:{self.port}",
                "CORRAL_MODELS": str(work / "models"),
                "CORRAL_KV_DISK_DIR": str(work / "kv"),  # its own prompt cache on disk, never the user's
                "PYTHONPATH": str(batching.REPO),
                "CORRAL_NUM_PARALLEL": str(slots),
            }
        )
        with LOG.open("wb") as log:  # the daemon's log, kept after the run (a runner that fails says why there)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli", "serve"], env=env, cwd=batching.REPO, stdout=log, stderr=log
            )
        try:
            self._setup(gguf, quants)
        except BaseException:
            self.close()  # a daemon that failed to set up is not left running
            raise

    def _setup(self, gguf: Path, quants: list[str]) -> None:
        batching.wait_up(self.url + "/api/version", self.proc)
        digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
        with gguf.open("rb") as f:
            r = httpx.post(f"{self.url}/api/blobs/{digest}", content=f, timeout=120)
            _fail("blob upload", r)
        self.create({"model": "bench", "files": {gguf.name: digest}, "parameters": {"num_ctx": CTX}})
        self.draft_files: dict[str, Path] = {}
        for q in quants:
            started = time.monotonic()
            self.create({"model": f"draft-{q}", "files": {gguf.name: digest}, "quantize": q})
            print(f"corral create -q {q}: {time.monotonic() - started:.1f} s", flush=True)
            self.create({"model": f"spec-{q}", "files": {gguf.name: digest}, "parameters": {"num_ctx": CTX}})
            self.draft_files[q] = self.blob(f"draft-{q}")

    def create(self, body: dict[str, Any]) -> None:
        with batching.CLIENT.stream("POST", self.url + "/api/create", json={**body, "stream": True}) as r:
            _fail(f"create {body['model']}", r)
            last: dict[str, Any] = {}
            for line in r.iter_lines():
                if line:
                    last = json.loads(line)
        if last != {"status": "success"}:
            sys.exit(f"create {body['model']} failed: {last}")

    def blob(self, model: str) -> Path:
        """The GGUF file a model's Modelfile names (``FROM /path``), for llama-server to load the same file."""
        r = httpx.post(self.url + "/api/show", json={"model": model}, timeout=60)
        _fail(f"show {model}", r)
        for line in r.json()["modelfile"].splitlines():
            if line.startswith("FROM ") and Path(line[5:].strip()).is_file():
                return Path(line[5:].strip())
        sys.exit(f"show {model}: no FROM line naming a file in its Modelfile")

    def chat(self, model: str, prompt: str, tokens: int, options: dict[str, Any]) -> Result:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "keep_alive": -1,  # a slow round must not unload a runner between its turns
            "options": {"temperature": 0, "repeat_penalty": 1.0, "num_predict": tokens, **options},
        }
        start = time.perf_counter()
        first = last = 0.0
        text, final = "", {}
        with batching.CLIENT.stream("POST", self.url + "/api/chat", json=body) as r:
            _fail(f"corral /api/chat {model} {options}", r)
            for line in r.iter_lines():
                if not line:
                    continue
                obj = json.loads(line)
                if obj.get("error"):
                    sys.exit(f"corral /api/chat {model} {options}: {obj['error']} (corral's daemon log: {LOG})")
                piece = (obj.get("message") or {}).get("content") or ""
                if piece:
                    last = time.perf_counter() - start
                    first = first or last
                    text += piece
                if obj.get("done"):
                    final = obj
        count, ns = int(final.get("eval_count") or 0), int(final.get("eval_duration") or 0)
        return Result(
            count,
            first,
            last,
            text,
            count / (ns / 1e9) if ns else 0.0,
            final.get("draft_n"),
            final.get("draft_n_accepted"),
        )


class LlamaServer(batching.OpenAIPeer):
    """llama-server on the target with one slot, and the speculation flags given."""

    def start(self, argv: list[str], ready_path: str = "/v1/models") -> None:
        try:
            super().start(argv, ready_path)
        except BaseException:
            if getattr(self, "proc", None) is not None:
                self.close()  # a server that did not come up is not left running
            raise

    def __init__(self, name: str, gguf: Path, flags: list[str]) -> None:
        self.name = name
        self.flags = flags
        self.start(batching.llama_server_argv(gguf, CTX, 1, *flags), "/health")

    def chat(self, model: str, prompt: str, tokens: int, options: dict[str, Any]) -> Result:
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "temperature": 0,
            "repeat_penalty": 1.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first = last = 0.0
        text, usage, timings = "", 0, {}
        with batching.CLIENT.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            _fail(f"{self.name} /v1/chat/completions", r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = int(obj["usage"].get("completion_tokens") or 0)
                if obj.get("timings"):
                    timings = obj["timings"]
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        last = time.perf_counter() - start
                        first = first or last
                        text += piece
        speculating = any(f.startswith("--spec-type") for f in self.flags)
        return Result(
            usage,
            first,
            last,
            text,
            float(timings.get("predicted_per_second") or 0.0),
            # llama-server leaves the two out when nothing was drafted
            int(timings.get("draft_n", 0)) if speculating else None,
            int(timings.get("draft_n_accepted", 0)) if speculating else None,
        )


@dataclass
class Config:
    key: str  # corral, corral-draft, ... (what --configs names)
    label: str
    kind: str  # "none", "draft Q", "n-gram N": llama-server's row of the same kind is the reference
    server: Any
    model: str = "bench"
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return "llama-server" if self.key.startswith("llama-server") else "corral"

    def request(self, prompt: str, tokens: int) -> Result:
        result: Result = self.server.chat(self.model, prompt, tokens, self.options)
        return result


def configurations(args: argparse.Namespace, work: Path, stack: contextlib.ExitStack) -> list[Config]:
    keys = args.configs.split(",")
    if unknown := [k for k in keys if k not in CONFIGS]:
        sys.exit(f"unknown configuration {', '.join(unknown)}: use {', '.join(CONFIGS)} (comma-separated)")
    quants = [q for q in args.drafts.split(",") if q]
    if not quants and any(k.endswith("-draft") or k == "draft-alone" for k in keys):
        sys.exit("--drafts is empty: name the quantization types of the draft models (e.g. Q4_K_S,Q8_0)")
    if any(k.startswith("llama-server") for k in keys) and not PEER.is_file():
        print(f"llama-server is not built ({PEER}): bench/setup_peers.sh builds it; its rows are left out")
        keys = [k for k in keys if not k.startswith("llama-server")]
    target = target_path()
    spec = {"draft_max": args.draft_max, "draft_min": args.draft_min, "draft_p_min": args.draft_p_min}
    peer_spec = [
        "--spec-draft-n-max",
        str(args.draft_max),
        "--spec-draft-n-min",
        str(args.draft_min),
        "--spec-draft-p-min",
        str(args.draft_p_min),
    ]
    (work / "corral").mkdir()
    corral = Corral(
        target,
        work / "corral",
        args.parallel,
        quants if {"corral-draft", "draft-alone", "llama-server-draft"} & set(keys) else [],
    )
    stack.callback(corral.close)
    out: list[Config] = []

    def peer(name: str, flags: list[str]) -> LlamaServer:
        server = LlamaServer(name, target, flags)
        stack.callback(server.close)
        return server

    for key in keys:
        if key == "corral":
            out.append(Config(key, "corral, no speculation", "none", corral))
        elif key == "corral-draft":
            for q in quants:
                out.append(
                    Config(
                        key,
                        f"corral, draft {q} (`options.draft_model`)",
                        f"draft {q}",
                        corral,
                        f"spec-{q}",
                        {"draft_model": f"draft-{q}", **spec},
                    )
                )
        elif key == "draft-alone":
            for q in quants:
                out.append(
                    Config(key, f"the draft {q} alone (corral, model `draft-{q}`)", "alone", corral, f"draft-{q}")
                )
        elif key == "corral-ngram":
            out.append(
                Config(
                    key,
                    f"corral, n-gram {args.ngram} (`options.draft_ngram`)",
                    f"n-gram {args.ngram}",
                    corral,
                    "bench",
                    {"draft_ngram": args.ngram, **spec},
                )
            )
        elif key == "llama-server":
            out.append(Config(key, "llama-server, no speculation", "none", peer("llama-server", [])))
        elif key == "llama-server-draft":
            for q in quants:
                flags = ["--spec-type", "draft-simple", "--model-draft", str(corral.draft_files[q]), *peer_spec]
                out.append(
                    Config(
                        key,
                        f"llama-server, draft {q} (`--model-draft`)",
                        f"draft {q}",
                        peer(f"llama-server {q}", flags),
                    )
                )
        elif key == "llama-server-ngram":
            flags = [
                "--spec-type",
                "ngram-simple",
                "--spec-ngram-simple-size-n",
                str(args.ngram),
                "--spec-ngram-simple-size-m",
                str(args.draft_max),
            ]
            out.append(
                Config(
                    key,
                    f"llama-server, n-gram {args.ngram} (`--spec-type ngram-simple`)",
                    f"n-gram {args.ngram}",
                    peer("llama-server n-gram", flags),
                )
            )
    return out


# -- measuring -------------------------------------------------------------------------------------------------------
class Quiet:
    """What the machine's other processes take while a measurement runs: the CPU time of the whole machine less that
    of the benchmark's servers (their process trees) and of this process, in cores. A measurement taken while they
    used more than ``limit`` cores is taken again (after a pause, up to ``retries`` times): on a shared 2-core machine
    one other busy process halves what llama.cpp's two threads get, and makes them wait for each other."""

    def __init__(self, servers: list[Any], limit: float, retries: int) -> None:
        self.roots = [psutil.Process(s.proc.pid) for s in servers]
        self.me = psutil.Process()
        self.limit, self.retries = limit, retries
        self.retaken = self.noisy = 0

    def _ours(self) -> float:
        total = 0.0
        for p in [self.me, *self.roots]:
            with contextlib.suppress(psutil.Error):
                for q in [p, *(p.children(recursive=True) if p is not self.me else [])]:
                    with contextlib.suppress(psutil.Error):
                        t = q.cpu_times()
                        total += t.user + t.system
        return total

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()  # guest time is inside user time; steal is not this machine's work
        return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))

    def measure(self, fn: Callable[[], T]) -> T:
        for attempt in range(self.retries + 1):
            busy, ours, start = self._busy(), self._ours(), time.perf_counter()
            value = fn()
            wall = time.perf_counter() - start
            other = ((self._busy() - busy) - (self._ours() - ours)) / wall
            if other <= self.limit:
                return value
            if attempt < self.retries:
                self.retaken += 1
                time.sleep(5)
        self.noisy += 1  # kept, as the last try
        return value


def burst(config: Config, streams: int, prompt: str, tokens: int) -> float:
    """``streams`` simultaneous requests: completion tokens over the wall time from the first request to the last
    token."""
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as ex:
        done = list(ex.map(lambda _: config.request(prompt, tokens), range(streams)))
    return sum(r.tokens for r in done) / (time.perf_counter() - start)


def run(args: argparse.Namespace) -> None:
    single: dict[tuple[str, str], list[Result]] = {}
    many: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        configs = configurations(args, Path(tmp), stack)
        for c in configs:  # warm up: loads the runners (the draft with its target), the prompts' first evaluation
            for prompt in PROMPTS.values():
                c.request(prompt, 8)
        servers = list({id(c.server): c.server for c in configs}.values())
        batching.check_idle(servers)
        quiet = Quiet(servers, args.quiet, args.retries)
        for r in range(args.rounds):
            for p, (name, prompt) in enumerate(PROMPTS.items()):
                k = (r + p) % len(configs)  # the order rotates with the round and the prompt
                for c in configs[k:] + configs[:k]:
                    single.setdefault((c.label, name), []).append(
                        quiet.measure(lambda: c.request(prompt, args.tokens))  # noqa: B023 (called at once)
                    )
                print(
                    f"round {r + 1} {name} ({quiet.retaken} retaken so far): "
                    + ", ".join(f"{c.label.split(' (')[0]} {single[(c.label, name)][-1].tps:.1f}" for c in configs)
                    + " tok/s",
                    flush=True,
                )
        corral = [c for c in configs if c.family == "corral" and c.kind != "alone"]
        if args.streams and corral:
            for c in corral:  # warm this level up (a burst's first step evaluates all the prompts)
                burst(c, args.streams, CHAT, 16)
            for r in range(args.stream_rounds):
                k = r % len(corral)
                for c in corral[k:] + corral[:k]:
                    many.setdefault(c.label, []).append(
                        quiet.measure(lambda: burst(c, args.streams, CHAT, args.stream_tokens))  # noqa: B023
                    )
                print(
                    f"round {r + 1}, {args.streams} streams: "
                    + ", ".join(f"{c.label.split(' (')[0]} {many[c.label][-1]:.1f}" for c in corral)
                    + " tok/s",
                    flush=True,
                )
    lines = render(args, configs, single, many, quiet)
    print("\n".join(lines))
    if args.write:
        batching.write_section(args.write, lines, HEAD)


# -- the table -------------------------------------------------------------------------------------------------------
def command(args: argparse.Namespace) -> str:
    return (
        f"bench/setup_peers.sh && .venv/bin/python bench/speculative.py --rounds {args.rounds} --tokens {args.tokens} "
        f"--drafts {args.drafts} --ngram {args.ngram} --draft-max {args.draft_max} --draft-min {args.draft_min} "
        f"--draft-p-min {args.draft_p_min} --streams {args.streams} --stream-rounds {args.stream_rounds} "
        f"--stream-tokens {args.stream_tokens} --quiet {args.quiet} --retries {args.retries} "
        f"--configs {args.configs}" + (f" --write {args.write}" if args.write else "")
    )


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if y > 0]


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def render(
    args: argparse.Namespace,
    configs: list[Config],
    single: dict[tuple[str, str], list[Result]],
    many: dict[str, list[float]],
    quiet: Quiet,
) -> list[str]:
    lines = [
        HEAD,
        "",
        f"Command: `{command(args)}`",
        "",
        f"Target SmolLM2-135M-Instruct F16 (written from the Q4_1 file with `gguf`), drafts {args.drafts} made by "
        f"corral's own `corral create -q`; CPU only, 2 cores; greedy, {args.tokens} tokens, no repeat penalty, "
        f"streamed through the chat APIs; speculation settings for both servers: draft_max {args.draft_max}, "
        f"draft_min {args.draft_min}, draft_p_min {args.draft_p_min}, n-gram {args.ngram}. corral runs "
        f"{args.parallel} slots, llama-server one. All servers up at once, taking turns in a rotating order, "
        f"{args.rounds} rounds; tok/s = (completion tokens - 1) / (first streamed token to last), the median over the "
        "rounds; ratios are medians of the per-round ratios. A measurement during which the machine's other processes "
        f"used more than {args.quiet} of a core was taken again (up to {args.retries} times): {quiet.retaken} were "
        f"taken again, {quiet.noisy} kept from a last try that was still disturbed.",
        "",
        "| prompt | configuration | tok/s | x without speculation (same server) | corral x llama-server (same kind) "
        "| server's own tok/s | draft_n | draft_n_accepted | acceptance | same text as without | tok/s each round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def tps(label: str, prompt: str) -> list[float]:
        return [x.tps for x in single.get((label, prompt), [])]

    for prompt in PROMPTS if single else ():
        base = {
            fam: next((c for c in configs if c.family == fam and c.kind == "none"), None)
            for fam in ("corral", "llama-server")
        }
        for c in configs:
            rs = single[(c.label, prompt)]
            own = base[c.family]
            vs_without = _med(_ratios(tps(c.label, prompt), tps(own.label, prompt))) if own and own is not c else "-"
            peer = next((p for p in configs if p.family == "llama-server" and p.kind == c.kind), None)
            vs_peer = (
                _med(_ratios(tps(c.label, prompt), tps(peer.label, prompt))) if c.family == "corral" and peer else "-"
            )
            drafted = [x.draft_n for x in rs if x.draft_n is not None]
            accepted = [x.draft_n_accepted for x in rs if x.draft_n_accepted is not None]
            if c.kind in ("none", "alone"):
                dn = da = acc = "-"
            elif drafted and accepted:
                dn, da = f"{statistics.median(drafted):.0f}", f"{statistics.median(accepted):.0f}"
                acc = f"{sum(accepted) / sum(drafted):.0%}" if sum(drafted) else "0 drafted"
            else:
                dn = da = acc = "not reported"
            ref = own if own and own is not c else base["corral"] if c.family == "llama-server" else None
            if ref is None or c.kind == "alone":
                same = "-"
            else:
                texts = [x.text for x in single[(ref.label, prompt)]]
                hits = sum(x.text == texts[0] for x in rs)
                same = "yes" if hits == len(rs) else f"no ({hits}/{len(rs)})"
                if ref is base["corral"] and c.family == "llama-server":
                    same += " (vs corral)"
            lines.append(
                f"| {prompt} | {c.label} | **{statistics.median(tps(c.label, prompt)):.1f}** | **{vs_without}** | "
                f"**{vs_peer}** | {statistics.median(x.server_tps for x in rs):.1f} | {dn} | {da} | {acc} | {same} | "
                + ", ".join(f"{x:.1f}" for x in tps(c.label, prompt))
                + " |"
            )
    if many:
        off = next((c for c in configs if c.family == "corral" and c.kind == "none"), None)
        lines += [
            "",
            f"{args.streams} simultaneous streams, corral, the chat prompt, {args.stream_tokens} tokens each, "
            f"{args.stream_rounds} rounds: aggregate completion tokens / wall time.",
            "",
            "| configuration | aggregate tok/s | x without speculation | each round |",
            "|---|---|---|---|",
        ]
        for c in configs:
            if c.label not in many:
                continue
            ratio = _med(_ratios(many[c.label], many[off.label])) if off and c is not off else "-"
            lines.append(
                f"| {c.label} | {statistics.median(many[c.label]):.1f} | **{ratio}** | "
                + ", ".join(f"{x:.1f}" for x in many[c.label])
                + " |"
            )
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="single-stream rounds (medians over them)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--drafts", default="Q4_K_S", help="draft quantization types, comma-separated (corral create -q)")
    ap.add_argument("--ngram", type=int, default=3, help="n-gram length of prompt lookup")
    ap.add_argument("--draft-max", type=int, default=16)
    ap.add_argument("--draft-min", type=int, default=0)
    ap.add_argument("--draft-p-min", type=float, default=0.75)
    ap.add_argument("--parallel", type=int, default=16, help="corral's CORRAL_NUM_PARALLEL")
    ap.add_argument("--streams", type=int, default=16, help="simultaneous streams of the many-streams part (0: skip)")
    ap.add_argument("--stream-rounds", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream of the many-streams part")
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.3,
        help="take a measurement again when other processes used more than this many cores during it",
    )
    ap.add_argument("--retries", type=int, default=3, help="most times one measurement is taken again")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--write", type=Path, help="replace this section of a markdown file (docs/benchmarks.md)")
    args = ap.parse_args()
    if args.streams > args.parallel:
        sys.exit(f"--streams {args.streams} is more than corral's {args.parallel} slots (--parallel)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # the servers are stopped on the way out
    run(args)


if __name__ == "__main__":
    main()
