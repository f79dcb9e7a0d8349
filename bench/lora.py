"""Many LoRA adapters on one base (issue 29): four fine-tunes of SmolLM2 served at once, 16 streams spread over
them, by corral as it was before issue 29 (a runner per model), by corral with the shared runner, and by
llama-server with the four adapters loaded and per-request ``lora``.

Usage: bench/setup_peers.sh && git worktree add --detach /tmp/corral-before 9fd7123 &&
       .venv/bin/python bench/lora.py [--rounds 5] [--tokens 128] [--streams 16] [--ctx 2048] [--scale 0.3]
       [--before /tmp/corral-before] [--configs before,shared,llama-server] [--write docs/benchmarks.md]

Files. The base is SmolLM2-135M-Instruct Q4_1 (scripts/fetch_smollm2.py). The four adapters are written once with
tests/models.write_lora_gguf (random rank-4 A/B on every layer's attn_q and attn_v, seeds 1-4, ``--scale``: outputs
differ visibly and stay English) and cached as ~/.cache/corral-bench/SmolLM2-lora-s{SCALE}-{SEED}.gguf.

Servers, all up at once (idle, they use no CPU: checked), taking turns in an order that rotates each round:

* ``before``: corral at the commit before issue 29 (``--before``, a worktree, run with this venv, as
  bench/speed.py's ``corral@CHECKOUT``): models ``lora-0``..``lora-3`` are ``FROM`` the base model plus one
  ``ADAPTER`` each (``POST /api/create`` with ``from`` and ``adapters``), so four runners, each with
  ``CORRAL_NUM_PARALLEL`` = streams / 4 slots (the four streams it serves);
* ``shared``: this checkout's corral, the same four models, ``CORRAL_NUM_PARALLEL`` = streams: one runner holds the
  base once and the four adapters. Both corrals hold the same number of slots of ``--ctx`` tokens in all;
* ``llama-server``: ``--lora`` once per adapter (in model order), ``-np`` streams, ``-c`` streams x ctx, each
  request naming its adapter with ``lora: [{"id": i, "scale": 1.0}]`` (the others are then at scale 0).

A round: on each server, ``--streams`` simultaneous greedy chat requests (no repeat penalty, ``--tokens`` tokens),
stream i on model/adapter i mod 4 with prompt i // 4 (bench/batching.py's prompts, so four different prompts per
adapter), streamed (corral: ``/api/chat``; llama-server: ``/v1/chat/completions``; both apply the model's chat
template). Aggregate tok/s = completion tokens of all streams / wall time from the first request to the last token.
Memory: the servers' processes that hold the model (corral's runner processes, llama-server itself), sampled every
second during each burst: the peak of their summed RSS, and of their summed PSS (proportional set size: a page
shared by several processes, as the base GGUF mapped by four runners, counted once in all). A burst during which
the machine's other processes used more than ``--quiet`` cores is taken again (bench/speculative.py's rule).

Text check: each adapter's 16 (well, streams / 4) answers are compared with the same request on the ``before``
server (greedy: the shared runner must give what a runner per model gives), and the four adapters' answers to the
same prompt must differ from each other.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching
import speculative

from tests.models import write_lora_gguf

CACHE = Path(os.environ.get("CORRAL_BENCH_DIR", Path.home() / ".cache" / "corral-bench"))
TITLE = "## Many LoRA adapters on one base (issue 29)"
PEER = batching.LLAMA_SERVER
ADAPTERS = 4
CONFIGS = ("before", "shared", "llama-server")


def adapter_paths(base: Path, scale: float) -> list[Path]:
    """The four adapters for ``base``, written once (to a temporary name, then renamed) and cached."""
    CACHE.mkdir(parents=True, exist_ok=True)
    out = []
    for seed in range(1, ADAPTERS + 1):
        path = CACHE / f"SmolLM2-lora-s{scale:g}-{seed}.gguf"
        if not path.is_file():
            tmp = path.with_name(path.name + ".partial")
            write_lora_gguf(tmp, base, rank=4, seed=seed, scale=scale)
            tmp.replace(path)
            print(f"wrote {path}", flush=True)
        out.append(path)
    return out


def kv_bytes(base: Path, cells: int) -> int:
    """The f16 K and V cache of ``cells`` positions of the model in ``base``, from its GGUF header."""
    import gguf

    fields = gguf.GGUFReader(str(base)).fields
    arch = fields["general.architecture"].contents()

    def get(key: str, default: int | None = None) -> int:
        f = fields.get(f"{arch}.{key}")
        if f is None:
            if default is None:
                sys.exit(f"{base}: no {arch}.{key} in its header")
            return default
        return int(f.contents())

    head = get("embedding_length") // get("attention.head_count")
    k = get("attention.key_length", head) * get("attention.head_count_kv")
    v = get("attention.value_length", head) * get("attention.head_count_kv")
    return get("block_count") * (k + v) * 2 * cells


@dataclass
class Answer:
    tokens: int
    text: str


def _fail(what: str, r: httpx.Response) -> None:
    if r.status_code != 200:
        r.read()
        sys.exit(f"{what}: HTTP {r.status_code}: {r.text[:500]}")


class Corral(batching.Corral):
    """A corral daemon (this checkout, or ``checkout``) with the base and the four adapter models."""

    def __init__(self, name: str, checkout: Path, base: Path, adapters: list[Path], ctx: int, slots: int) -> None:
        self.name = name
        self.work = Path(tempfile.mkdtemp(prefix=f"corral-lora-{name}-"))
        repo = batching.REPO
        batching.REPO = checkout  # the daemon runs from this copy of corral, with this venv
        try:
            self._start(slots)
        finally:
            batching.REPO = repo
        try:
            digests = [self._blob(p) for p in [base, *adapters]]
            self._create({"model": "base", "files": {base.name: digests[0]}, "parameters": {"num_ctx": ctx}})
            for i, (path, digest) in enumerate(zip(adapters, digests[1:], strict=True)):
                self._create(
                    {
                        "model": f"lora-{i}",
                        "from": "base",
                        "adapters": {path.name: digest},
                        "parameters": {"num_ctx": ctx},
                    }
                )
        except BaseException:
            self.close()
            raise

    def _start(self, slots: int) -> None:
        self.port = batching.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
        env.update(
            {
                "CORRAL_HOST": f"127.0.0.1:{self.port}",
                "CORRAL_MODELS": str(self.work / "models"),
                "CORRAL_KV_DISK_DIR": str(self.work / "kv"),
                "PYTHONPATH": str(batching.REPO),
                "CORRAL_NUM_PARALLEL": str(slots),
                "CORRAL_MAX_LOADED_MODELS": str(ADAPTERS + 1),
                "CORRAL_KEEP_ALIVE": "1h",
            }
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve"],
            env=env,
            cwd=batching.REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        batching.wait_up(self.url + "/api/version", self.proc)

    def _blob(self, path: Path) -> str:
        digest = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        with path.open("rb") as f:
            r = httpx.post(f"{self.url}/api/blobs/{digest}", content=f, timeout=120)
        if r.status_code not in (200, 201):
            sys.exit(f"{self.name}: upload {path.name}: HTTP {r.status_code}: {r.text[:500]}")
        return digest

    def _create(self, body: dict[str, Any]) -> None:
        r = httpx.post(self.url + "/api/create", json={**body, "stream": False}, timeout=300)
        _fail(f"{self.name}: create {body['model']}", r)

    def ask(self, adapter: int, prompt: str, tokens: int) -> Answer:
        body = {
            "model": f"lora-{adapter}",
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "options": {"temperature": 0, "repeat_penalty": 1.0, "num_predict": tokens},
        }
        text, count = "", 0
        with batching.CLIENT.stream("POST", self.url + "/api/chat", json=body) as r:
            _fail(f"{self.name} /api/chat lora-{adapter}", r)
            for line in r.iter_lines():
                if not line:
                    continue
                obj = json.loads(line)
                if obj.get("error"):
                    sys.exit(f"{self.name} /api/chat lora-{adapter}: {obj['error']}")
                text += (obj.get("message") or {}).get("content") or ""
                if obj.get("done"):
                    count = int(obj.get("eval_count") or 0)
        return Answer(count, text)

    def holders(self) -> list[psutil.Process]:
        """The runner processes (they hold the weights, the adapters and the KV cache)."""
        out = []
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "daemon.llama.runner" in " ".join(p.cmdline()):
                        out.append(p)
        return out

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        shutil.rmtree(self.work, ignore_errors=True)


class LlamaServer(batching.OpenAIPeer):
    """llama-server with the adapters loaded (``--lora`` each, in model order) and ``streams`` slots."""

    def __init__(self, base: Path, adapters: list[Path], ctx: int, slots: int) -> None:
        self.name = "llama-server"
        loras = [arg for p in adapters for arg in ("--lora", str(p))]
        self.start(batching.llama_server_argv(base, ctx, slots, *loras), "/health")

    def ask(self, adapter: int, prompt: str, tokens: int) -> Answer:
        body = {
            "model": "bench",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "temperature": 0,
            "repeat_penalty": 1.0,
            "lora": [{"id": adapter, "scale": 1.0}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, usage = "", 0
        with batching.CLIENT.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            _fail(f"llama-server /v1/chat/completions lora {adapter}", r)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = int(obj["usage"].get("completion_tokens") or 0)
                for choice in obj.get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
        return Answer(usage, text)

    def holders(self) -> list[psutil.Process]:
        return [psutil.Process(self.proc.pid)]


Server = Corral | LlamaServer


class Memory:
    """Samples the summed RSS and PSS of a server's model-holding processes every second while running (reading
    smaps_rollup takes the process's memory lock: more often would slow what is measured)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.rss = self.pss = 0
        self.procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        rss = pss = 0
        procs = self.server.holders()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                info = p.memory_full_info()
                rss += info.rss
                pss += info.pss
        self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
        self.procs = max(self.procs, len(procs))

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    def __enter__(self) -> Memory:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


@dataclass
class Burst:
    tps: float
    tokens: int
    rss: int
    pss: int
    procs: int
    answers: list[Answer]


def plan(streams: int) -> list[tuple[int, str]]:
    """Stream i: adapter i mod 4, prompt i // 4 (mod the prompts)."""
    return [(i % ADAPTERS, batching.PROMPTS[(i // ADAPTERS) % len(batching.PROMPTS)]) for i in range(streams)]


def burst(server: Server, streams: int, tokens: int) -> Burst:
    work = plan(streams)
    with Memory(server) as mem:
        start = time.perf_counter()
        with cf.ThreadPoolExecutor(streams) as ex:
            answers = list(ex.map(lambda w: server.ask(w[0], w[1], tokens), work))
        wall = time.perf_counter() - start
    count = sum(a.tokens for a in answers)
    return Burst(count / wall, count, mem.rss, mem.pss, mem.procs, answers)


def run(args: argparse.Namespace) -> None:
    base = batching.smollm2_path()
    if base is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    if args.streams % ADAPTERS:
        sys.exit(f"--streams {args.streams}: use a multiple of {ADAPTERS} (as many streams on each adapter)")
    keys = [k for k in args.configs.split(",") if k]
    if unknown := [k for k in keys if k not in CONFIGS]:
        sys.exit(f"unknown --configs {', '.join(unknown)}: use {', '.join(CONFIGS)}")
    if "before" in keys and not (args.before / "daemon").is_dir():
        sys.exit(f"{args.before} is not a corral checkout: git worktree add --detach {args.before} 9fd7123")
    if "llama-server" in keys and not PEER.is_file():
        print(f"{PEER} is missing (bench/setup_peers.sh builds it): llama-server left out", flush=True)
        keys.remove("llama-server")
    adapters = adapter_paths(base, args.scale)
    results: dict[str, list[Burst]] = {k: [] for k in keys}
    with contextlib.ExitStack() as stack:
        servers: dict[str, Server] = {}
        for k in keys:
            started = time.monotonic()
            if k == "before":
                server: Server = Corral(k, args.before.resolve(), base, adapters, args.ctx, before_slots(args))
            elif k == "shared":
                server = Corral(k, args.shared.resolve(), base, adapters, args.ctx, args.streams)
            else:
                server = LlamaServer(base, adapters, args.ctx, args.streams)
            stack.callback(server.close)
            servers[k] = server
            burst(server, ADAPTERS, 4)  # warm up: loads the runners and the adapters (one request on each)
            print(f"{k}: up and warm in {time.monotonic() - started:.1f} s", flush=True)
        batching.check_idle(list(servers.values()))
        quiet = speculative.Quiet(list(servers.values()), args.quiet, args.retries)
        kv = kv_bytes(base, args.ctx * args.streams)
        stopped = ""
        try:
            for r in range(args.rounds):
                k0 = r % len(keys)
                for k in keys[k0:] + keys[:k0]:
                    results[k].append(
                        quiet.measure(lambda: burst(servers[k], args.streams, args.tokens))  # noqa: B023
                    )
                print(
                    f"round {r + 1} ({quiet.retaken} retaken so far): "
                    + ", ".join(
                        f"{k} {results[k][-1].tps:.1f} tok/s, {results[k][-1].pss / 2**20:.0f} MiB PSS "
                        f"({results[k][-1].procs} proc)"
                        for k in keys
                    ),
                    flush=True,
                )
                if args.write:  # each round's table kept: a run stopped later still leaves the rounds it finished
                    batching.write_section(args.write, render(args, keys, results, quiet, kv), heading(args))
        except (KeyboardInterrupt, SystemExit) as e:
            stopped = f"stopped ({e or 'interrupted'}) during round {len(results[keys[-1]]) + 1}"
            print(stopped, flush=True)
    done = min(len(v) for v in results.values())
    if not done:
        sys.exit("no round was finished: nothing to report")
    results = {k: v[:done] for k, v in results.items()}  # complete rounds only, for the per-round ratios
    lines = render(args, keys, results, quiet, kv)
    print("\n".join(lines))
    if args.write:
        batching.write_section(args.write, lines, heading(args))


def revision(checkout: Path) -> str:
    """The checkout's commit, and whether files git tracks were changed in it."""
    git = ["git", "-C", str(checkout)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return f"`{head or '?'}`" + (" + uncommitted edits" if dirty.stdout.strip() else "")


def command(args: argparse.Namespace) -> str:
    shared = "" if args.shared.resolve() == batching.REPO else f"--shared {args.shared} "
    return (
        f"bench/setup_peers.sh && git worktree add --detach {args.before} 9fd7123 && .venv/bin/python bench/lora.py "
        f"--rounds {args.rounds} --tokens {args.tokens} --streams {args.streams} --ctx {args.ctx} "
        f"--scale {args.scale:g} --before {args.before} {shared}--quiet {args.quiet} --retries {args.retries} "
        f"--configs {args.configs} --before-slots {args.before_slots}"
        + (f" --write {args.write}" if args.write else "")
    )


def _ratio(a: list[float], b: list[float]) -> str:
    rs = [x / y for x, y in zip(a, b, strict=True) if y > 0]
    return f"{statistics.median(rs):.2f}" if rs else "-"


def heading(args: argparse.Namespace) -> str:
    """The section's title: a run at another num_ctx or stream count is a section of its own."""
    same = ", four runners of as many slots" if args.before_slots == "same" else ""
    return f"{TITLE}, {args.streams} streams, num_ctx {args.ctx}{same}"


def before_slots(args: argparse.Namespace) -> int:
    """Slots of each of the four runners: ``split``, the streams over the four (the same slots in all as the shared
    runner: the same KV cache); ``same``, the shared runner's CORRAL_NUM_PARALLEL (what a user who runs both with one
    setting gets: four times the KV cache)."""
    return args.streams if args.before_slots == "same" else args.streams // ADAPTERS


def render(
    args: argparse.Namespace, keys: list[str], results: dict[str, list[Burst]], quiet: Any, kv: int
) -> list[str]:
    labels = {
        "before": f"corral before issue 29 ({revision(args.before)}): a runner per model, "
        f"{before_slots(args)} slots each",
        "shared": f"corral with the shared runner ({revision(args.shared)}): {args.streams} slots",
        "llama-server": f"llama-server, `--lora` x{ADAPTERS}, per-request `lora`, `-np {args.streams}`",
    }
    lines = [
        heading(args),
        "",
        f"Command: `{command(args)}`",
        "",
        f"SmolLM2-135M-Instruct Q4_1 and four LoRA adapters written by `tests/models.write_lora_gguf` (rank 4 on "
        f"attn_q/attn_v, seeds 1-4, scale {args.scale:g}); four models `FROM` the base with one `ADAPTER` each. "
        f"{args.streams} simultaneous greedy chat streams (no repeat penalty, {args.tokens} tokens asked, num_ctx "
        f"{args.ctx}), {args.streams // ADAPTERS} on each adapter with four different prompts; CPU only, 2 cores. All "
        f"servers up at once, taking turns in a rotating order, {len(results[keys[0]])} rounds; aggregate tok/s = "
        "completion tokens / wall time of the burst, the median over rounds; ratios are medians of per-round ratios. "
        "Memory: the peak, sampled every second during the bursts, of the summed RSS and PSS of the processes holding "
        "the model (corral's runners, llama-server); PSS counts a page several processes share (the base GGUF mapped "
        "by four runners) once in all, RSS once per process. A burst during which the machine's other processes used "
        f"more than {args.quiet} of a core was taken again (up to {args.retries} times): {quiet.retaken} were taken "
        f"again, {quiet.noisy} kept from a last try that was still disturbed.",
        "",
        "| server | processes | aggregate tok/s | x before (tok/s) | x llama-server (tok/s) | peak RSS MiB "
        "| x before (RSS) | peak PSS MiB | x before (PSS) | same text as before | tok/s each round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    before = results.get("before")
    peer = results.get("llama-server")
    for k in keys:
        rs = results[k]
        tps = [b.tps for b in rs]
        vs_before = _ratio(tps, [b.tps for b in before]) if before and k != "before" else "-"
        vs_peer = _ratio(tps, [b.tps for b in peer]) if peer and k != "llama-server" else "-"
        rss = [float(b.rss) for b in rs]
        pss = [float(b.pss) for b in rs]
        rss_x = _ratio(rss, [float(b.rss) for b in before]) if before and k != "before" else "-"
        pss_x = _ratio(pss, [float(b.pss) for b in before]) if before and k != "before" else "-"
        if before and k != "before":
            pairs = [
                (a.text, b.text)
                for x, y in zip(rs, before, strict=True)
                for a, b in zip(x.answers, y.answers, strict=True)
            ]
            hits = sum(a == b for a, b in pairs)
            same = "yes" if hits == len(pairs) else f"{hits}/{len(pairs)}"
        else:
            same = "-"
        lines.append(
            f"| {labels[k]} | {max(b.procs for b in rs)} | **{statistics.median(tps):.1f}** | **{vs_before}** | "
            f"**{vs_peer}** | {statistics.median(rss) / 2**20:.0f} | {rss_x} | {statistics.median(pss) / 2**20:.0f} | "
            f"**{pss_x}** | {same} | " + ", ".join(f"{x:.1f}" for x in tps) + " |"
        )
    shared = results.get("shared")
    if shared and before:
        goals = [
            ("memory (PSS) x four runners", [float(b.pss) for b in shared], [float(b.pss) for b in before], "<=", 0.35),
            ("memory (RSS) x four runners", [float(b.rss) for b in shared], [float(b.rss) for b in before], "<=", 0.35),
            ("aggregate tok/s x four runners", [b.tps for b in shared], [b.tps for b in before], ">=", 1.0),
        ]
        if peer:
            goals.append(("aggregate tok/s x llama-server", [b.tps for b in shared], [b.tps for b in peer], ">=", 1.0))
        lines += ["", "| goal (issue 29) | shared runner | target | met |", "|---|---|---|---|"]
        for what, mine, theirs, op, target in goals:
            value = float(_ratio(mine, theirs))
            met = value <= target if op == "<=" else value >= target
            lines.append(f"| {what} | {value:.2f} | {op} {target:g} | {'yes' if met else '**no**'} |")
        if args.before_slots == "split":
            less = _ratio([b.pss - kv for b in shared], [b.pss - kv for b in before])
            lines += [
                "",
                f"Both corrals (and llama-server) hold the same KV cache: {args.streams} slots x {args.ctx} positions, "
                f"f16, {kv / 2**20:.0f} MiB in all, which the shared runner cannot share. Less that cache, the shared "
                f"runner's PSS is **{less}x** the four runners' (the base's weights, llama.cpp's buffers and a Python "
                "interpreter held once instead of four times).",
            ]
        else:
            lines += [
                "",
                f"Both corrals run with the same CORRAL_NUM_PARALLEL ({args.streams}): each of the four runners holds "
                f"a KV cache of {args.streams} slots x {args.ctx} positions, as the shared runner does once.",
            ]
    ref = results[keys[0]][-1].answers
    first = plan(args.streams)
    by_prompt: dict[str, set[str]] = {}
    for (_, prompt), a in zip(first, ref, strict=True):
        by_prompt.setdefault(prompt, set()).add(a.text)
    distinct = [len(v) for v in by_prompt.values()]
    lines += [
        "",
        f"The adapters change the text: on `{keys[0]}`, the four adapters' answers to each prompt are "
        f"{', '.join(str(d) for d in distinct)} different texts (of {ADAPTERS}). First answers, prompt 1:",
        "",
    ]
    for (adapter, prompt), a in zip(first, ref, strict=True):
        if prompt == batching.PROMPTS[0]:
            lines.append(f"- adapter {adapter}: {a.text[:160].strip()!r}")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="tokens asked of each stream")
    ap.add_argument("--streams", type=int, default=16, help="simultaneous streams, spread evenly over the adapters")
    ap.add_argument("--ctx", type=int, default=2048, help="num_ctx of each slot")
    ap.add_argument("--scale", type=float, default=0.3, help="write_lora_gguf's scale for the adapters")
    ap.add_argument("--before", type=Path, default=Path("/tmp/corral-before"), help="corral checkout before issue 29")
    ap.add_argument(
        "--shared",
        type=Path,
        default=batching.REPO,
        help="corral checkout with the shared runner (default: this one; a worktree of a commit keeps others' "
        "uncommitted edits out)",
    )
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.3,
        help="take a burst again when other processes used more than this many cores during it",
    )
    ap.add_argument("--retries", type=int, default=3, help="most times one burst is taken again")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument(
        "--before-slots",
        choices=("split", "same"),
        default="split",
        help="each of the four runners' slots: the streams split over them, or as many as the shared runner's",
    )
    ap.add_argument("--write", type=Path, help="replace this section of a markdown file (docs/benchmarks.md)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # the servers are stopped on the way out
    run(args)


if __name__ == "__main__":
    main()
