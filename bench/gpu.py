"""GPU checks through the real daemon: offload, a VRAM budget, flash attention, batching, and the prompt cache on
disk, on an 8B-shaped random-weight model (Llama-3-8B's layer shapes, Q4_0), against llama-cpp-python in-process.

Usage, on a machine with an NVIDIA GPU, a CUDA build of llama-cpp-python on PYTHONPATH and corral's dependencies:
    python3 bench/gpu.py --out DIR [--layers 32 --embd 4096 --ff 14336 --vocab 32000] [--budget 330]
(docs/benchmarks.md, "On a GPU", says how the device machine was set up; ``--layers 2 --embd 256 --ff 512`` runs
the same script on a CPU in a minute, to check the script, not the numbers.)

Sections, each skipped when less of ``--budget`` seconds is left than it needs, each writing its numbers to
DIR/gpu.json as soon as it has them:
- offload: /api/ps size and size_vram after a load with everything automatic, /api/info's devices;
- decode: 1, 4 and 16 streams of 128 greedy tokens through /api/generate (raw), aggregate tokens/s and time to
  first token, interleaved with llama-cpp-python's own ``Llama`` (the same build, the same file, every layer on the
  GPU) at one stream;
- kv_disk: a 16,000-token prompt (and a 4,000-token one) then a question: time to first token cold, warm, after an
  unload and after a daemon restart (restored from CORRAL_KV_DISK_DIR);
- budget: CORRAL_VRAM_BUDGET=2GiB: how many layers the daemon offloads and what decoding costs then;
- flash: CORRAL_FLASH_ATTENTION false against true: an 8,000-token prefill and decoding after it;
- spec: speculative decoding at 1 and 4 streams: no draft, a one-layer draft model that agrees with the model (the
  model's layers add nothing to the residual stream, see write_model) and prompt lookup; tokens/s and acceptance;
- lora: four LoRA adapters served by one runner, 16 streams in mixed batches against 16 streams of the base.
The model's text is noise (random weights); its timing and memory are what a real model of that shape costs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
LETTERS = "abcdefghijklmnopqrstuvwxyz"
T0 = time.monotonic()


def log(*a: Any) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s]", *a, flush=True)


# -- the model ---------------------------------------------------------------------------------------------------------
def words(n: int) -> list[str]:
    out: list[str] = []
    for i in range(n):
        word, j = "", i
        while True:
            word = LETTERS[j % 26] + word
            j = j // 26 - 1
            if j < 0:
                break
        out.append(word)
    return out


def write_model(path: Path, n_layer: int, n_embd: int, n_ff: int, n_vocab: int, ctx: int) -> None:
    """A llama GGUF with Q4_0 random weights written as raw blocks (fast: no quantizing), SentencePiece-style words
    with byte fallback, and an output row of zeros for </s> so that greedy decoding never ends by itself.

    Each layer's attention output and FFN down projections are zero blocks: every matrix is still multiplied (the
    cost is a real model's), but nothing is added to the residual stream, so the next token is a function of the
    last one alone (norm(embedding) x output). A model of the same vocabulary and width with any number of layers
    (the draft: one) computes the same function: the speculative section's draft agrees with the target as a
    perfect draft model would, which bounds what speculation can gain on this card."""
    import gguf

    n_head, n_head_kv = max(1, n_embd // 128), max(1, n_embd // 512)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("gpu-check-llama")
    w.add_context_length(ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_tokenizer_model("llama")
    byte_tokens = [f"<0x{b:02X}>".encode() for b in range(256)]
    uniq = [("\u2581" + x).encode() for x in words(n_vocab - 3 - 256)]
    tokens = [b"<unk>", b"<s>", b"</s>"] + byte_tokens + uniq
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(uniq))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(uniq))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    noise = rng.integers(0, 256, size=1 << 24, dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)

    def q4(rows: int, cols: int, zero_row: int | None = None) -> np.ndarray:
        blocks = rows * (cols // 32)
        qs = np.empty(blocks * 16, np.uint8)
        for start in range(0, qs.size, noise.size):
            part = qs[start : start + noise.size]
            part[:] = np.roll(noise, start // 7)[: part.size]
        a = np.empty((blocks, 18), np.uint8)
        a[:, :2] = scale
        a[:, 2:] = qs.reshape(blocks, 16)  # (a[:, 2:].reshape(-1) would be a copy: the blocks' bytes left unset)
        a = a.reshape(rows, (cols // 32) * 18)
        if zero_row is not None:
            a[zero_row] = 0
        return a

    def zero_q4(rows: int, cols: int) -> np.ndarray:
        return np.zeros((rows, (cols // 32) * 18), np.uint8)

    Q4 = gguf.GGMLQuantizationType.Q4_0
    vocab = len(tokens)
    w.add_tensor("token_embd.weight", q4(vocab, n_embd), raw_dtype=Q4)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", q4(vocab, n_embd, zero_row=2), raw_dtype=Q4)
    kv = n_head_kv * (n_embd // n_head)
    shared = {
        "attn_q": q4(n_embd, n_embd),
        "attn_k": q4(kv, n_embd),
        "attn_v": q4(kv, n_embd),
        "attn_output": zero_q4(n_embd, n_embd),
        "ffn_gate": q4(n_ff, n_embd),
        "ffn_up": q4(n_ff, n_embd),
        "ffn_down": zero_q4(n_embd, n_ff),
    }
    ones = np.ones(n_embd, np.float32)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for name, arr in shared.items():
            w.add_tensor(f"blk.{i}.{name}.weight", arr, raw_dtype=Q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def text_of(n_words: int, seed: int, vocab_words: list[str]) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(vocab_words) for _ in range(n_words))


# -- the daemon --------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, work: Path, name: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"daemon-{name}.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
        base.update(
            CORRAL_HOST=f"127.0.0.1:{self.port}",
            CORRAL_MODELS=str(work / "models"),
            CORRAL_KV_DISK_DIR=str(work / "kv"),
            CORRAL_KV_DISK="40GiB",
            CORRAL_KEEP_ALIVE="-1",
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        )
        base.update(env)
        self.env = base
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve"],
            env=base,
            cwd=REPO,
            stdout=open(self.log_path, "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/api/version", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("daemon did not start")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cli", *args], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=600
        )

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=60).json()

    def generate(
        self, prompt: str, options: dict[str, Any], keep_alive: Any = None, model: str = "big"
    ) -> dict[str, Any]:
        """Streamed raw /api/generate: time to the first chunk with text, and the final chunk's counts."""
        body: dict[str, Any] = {"model": model, "prompt": prompt, "raw": True, "stream": True, "options": options}
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        t0 = time.perf_counter()
        first = None
        final: dict[str, Any] = {}
        text: list[str] = []
        with httpx.stream("POST", self.url + "/api/generate", json=body, timeout=900) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.read().decode()[:500]}")
            for line in r.iter_lines():
                if not line:
                    continue
                chunk = json.loads(line)
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if first is None:  # the first chunk, text or not: a random model's first tokens are often bytes
                    first = time.perf_counter() - t0  # of no UTF-8 text yet
                text.append(chunk.get("response", ""))
                if chunk.get("done"):
                    final = chunk
        end = time.perf_counter() - t0
        return {
            "ttft": first or end,
            "wall": end,
            "eval_count": final.get("eval_count", 0),
            "prompt_eval_count": final.get("prompt_eval_count", 0),
            "eval_duration": final.get("eval_duration", 0) / 1e9,
            "prompt_eval_duration": final.get("prompt_eval_duration", 0) / 1e9,
            "draft_n": final.get("draft_n", 0),
            "draft_n_accepted": final.get("draft_n_accepted", 0),
            "text": "".join(text),
        }

    def unload(self) -> None:
        httpx.post(self.url + "/api/generate", json={"model": "big", "keep_alive": 0}, timeout=120)
        for _ in range(300):
            if not self.get("/api/ps").get("models"):
                return
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# -- the peer: llama-cpp-python in a process of its own ----------------------------------------------------------------
PEER = r"""
import json, sys, time
import llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_gpu_layers=-1, n_ctx=int(sys.argv[2]), n_batch=512, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.perf_counter(); first = None; n = 0
    for _ in llm.create_completion(req["prompt"], max_tokens=req["tokens"], temperature=0.0, stream=True):
        n += 1
        if first is None:
            first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    llm.reset()
    print(json.dumps({"ttft": first, "wall": wall, "eval_count": n}), flush=True)
"""


class Peer:
    def __init__(self, model: Path, ctx: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(model), str(ctx)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        json.loads(self.proc.stdout.readline())

    def run(self, prompt: str, tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# -- the checks --------------------------------------------------------------------------------------------------------
class Results:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        (self.out / "gpu.json").write_text(json.dumps(self.data, indent=1, default=str))
        log(key, json.dumps(value, default=str)[:1500])


def left(args: argparse.Namespace) -> float:
    return args.budget - (time.monotonic() - T0)


def gpu_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def decode_round(d: Daemon, streams: int, tokens: int, ctx: int, nonce: int) -> dict[str, float]:
    def one(i: int) -> dict[str, Any]:
        return d.generate(
            f"Story number {nonce}-{i}: Once upon a time", {"num_predict": tokens, "temperature": 0, "num_ctx": ctx}
        )

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as pool:
        got = list(pool.map(one, range(streams)))
    wall = time.perf_counter() - t0
    return {
        "tok_s": sum(g["eval_count"] for g in got) / wall,
        "ttft_p50": statistics.median(g["ttft"] for g in got),
        # the runner's own time per decoding step (eval_duration / eval_count), the daemon and HTTP left out
        "ms_per_step": statistics.median(1000 * g["eval_duration"] / max(g["eval_count"], 1) for g in got),
    }


def kv_disk(d: Daemon, args: argparse.Namespace, res: Results, vocab_words: list[str]) -> Daemon:
    """Cold, warm, after an unload and after a restart, for a long prompt and a quarter of it; returns the daemon
    running at the end (the restart replaces it)."""
    kv: dict[str, Any] = {}
    big_ctx = max(4096, int(args.long * 1.5) + 512)
    opts = {"num_ctx": big_ctx, "num_predict": 4, "temperature": 0}
    for n_words in (args.long, args.long // 4):
        if left(args) < 60:
            break
        prefix = text_of(n_words, n_words, vocab_words)
        row: dict[str, Any] = {}
        d.generate("", {**opts, "num_predict": 1})  # loaded at this context: the load is not timed below
        row["cold"] = d.generate(prefix + " question one", opts)
        row["warm"] = d.generate(prefix + " question two", opts)
        # wait for the writer thread to finish the blocks (bytes on disk stop growing)
        t = time.monotonic()
        last = -1
        while time.monotonic() - t < 60:
            m = d.get("/api/ps").get("models") or [{}]
            size = (m[0].get("kv_disk") or {}).get("bytes", 0)
            if size == last and size > 0:
                break
            last = size
            time.sleep(1.0)
        row["disk_bytes"] = last
        row["persist_wait_s"] = round(time.monotonic() - t, 1)
        d.unload()
        d.generate("", {**opts, "num_predict": 1})
        row["after_unload"] = d.generate(prefix + " question three", opts)
        d.stop()
        d = Daemon(args.work, "kv", {"CORRAL_NUM_PARALLEL": "1"})
        d.generate("", {**opts, "num_predict": 1})
        row["after_restart"] = d.generate(prefix + " question four", opts)
        row["ratio_restart_to_cold"] = round(row["after_restart"]["ttft"] / row["cold"]["ttft"], 3)
        row["ratio_unload_to_cold"] = round(row["after_unload"]["ttft"] / row["cold"]["ttft"], 3)
        kv[str(n_words)] = row
        res.put("kv_disk", kv)
    return d


def spec(args: argparse.Namespace, res: Results, gguf_path: Path, ctx: int) -> None:
    """Speculative decoding on the memory-bound model: no draft, a one-layer draft model that agrees with it (the
    bound of what a draft can gain), and prompt lookup (draft_ngram 3), at 1 and 4 streams, interleaved rounds;
    greedy text must be the same with and without drafts."""
    draft_path = args.work / "draft.gguf"
    write_model(draft_path, 1, args.embd, args.ff, args.vocab, ctx=32768)
    d = Daemon(args.work, "spec", {"CORRAL_NUM_PARALLEL": "4"})
    try:
        for name, text in (
            ("big", f"FROM {gguf_path}\n"),
            ("tiny", f"FROM {draft_path}\n"),
            # p_min 0: a random model is never confident (its top token has ~0.3% of the probability), so the
            # default 0.75 would stop every draft at its first token; this draft is right, whatever it believes
            ("big-drafted", "FROM big\nPARAMETER draft_model tiny\nPARAMETER draft_p_min 0\n"),
        ):
            mf = args.work / f"Modelfile.{name}"
            mf.write_text(text)
            made = d.cli("create", name, "-f", str(mf))
            if made.returncode:
                res.put("spec", {"create": name, "err": made.stderr[-800:]})
                return
        kinds: dict[str, tuple[str, dict[str, Any]]] = {
            "none": ("big", {}),
            "draft": ("big-drafted", {}),
            "lookup": ("big", {"draft_ngram": 3}),
        }
        rows: dict[str, list[dict[str, Any]]] = {}
        same: dict[str, bool] = {}
        for rnd in range(args.rounds):
            for streams in (1, 4):
                order = list(kinds) if rnd % 2 == 0 else list(reversed(kinds))
                texts: dict[str, list[str]] = {}
                for kind in order:
                    model, extra = kinds[kind]

                    def one(
                        i: int, model: str = model, extra: dict[str, Any] = extra, rnd: int = rnd
                    ) -> dict[str, Any]:
                        opts = {"num_predict": args.tokens, "temperature": 0, "num_ctx": ctx, **extra}
                        return d.generate(f"Story number {rnd}-{i}: Once upon a time", opts, model=model)

                    one(0)  # loaded (the draft model with it) before the timed round
                    t0 = time.perf_counter()
                    with cf.ThreadPoolExecutor(streams) as pool:
                        got = list(pool.map(one, range(streams)))
                    wall = time.perf_counter() - t0
                    texts[kind] = [g["text"] for g in got]
                    rows.setdefault(f"{kind}@{streams}", []).append(
                        {
                            "tok_s": sum(g["eval_count"] for g in got) / wall,
                            "ms_per_token": statistics.median(
                                1000 * g["eval_duration"] / max(g["eval_count"], 1) for g in got
                            ),
                            "draft_n": sum(g["draft_n"] for g in got),
                            "accepted": sum(g["draft_n_accepted"] for g in got),
                        }
                    )
                for kind in ("draft", "lookup"):
                    key = f"{kind}@{streams}"
                    same[key] = same.get(key, True) and texts[kind] == texts["none"]
            if left(args) < 60:
                break
        table = {k: {m: round(statistics.median(x[m] for x in v), 3) for m in v[0]} for k, v in rows.items()}
        for k, v in table.items():
            base = table.get("none@" + k.split("@")[1])
            if base and not k.startswith("none"):
                v["x_none"] = round(v["tok_s"] / base["tok_s"], 3)
        res.put("spec", table | {"same_text_as_no_draft": same, "rounds": len(rows.get("none@1", []))})
        res.put("spec_ps", d.get("/api/ps"))
    finally:
        d.stop()


def lora(args: argparse.Namespace, res: Results, gguf_path: Path, ctx: int) -> None:
    """Four LoRA adapters (rank 8 on attn_q and attn_v) on the model, four models over them served by one runner:
    16 streams spread over the four (every step a mixed batch) against 16 streams of the base alone, interleaved."""
    sys.path.insert(0, str(REPO))
    from tests.models import write_lora_gguf

    d = Daemon(args.work, "lora", {"CORRAL_NUM_PARALLEL": "16"})
    try:
        names = []  # "big" is in the store already (the main daemon created it)
        for i in range(4):
            path = write_lora_gguf(args.work / f"lora{i}.gguf", gguf_path, rank=8, seed=i)
            mf = args.work / f"Modelfile.lora{i}"
            mf.write_text(f"FROM big\nADAPTER {path}\n")
            made = d.cli("create", f"big-lora{i}", "-f", str(mf))
            if made.returncode:
                res.put("lora", {"create": i, "err": made.stderr[-800:]})
                return
            names.append(f"big-lora{i}")
        opts = {"num_predict": args.tokens, "temperature": 0, "num_ctx": ctx}
        for name in ["big", *names]:
            d.generate("warm", {**opts, "num_predict": 2}, model=name)
        ps = d.get("/api/ps").get("models", [])
        rows: dict[str, list[dict[str, float]]] = {}
        for rnd in range(args.rounds):
            for kind in ["base", "mixed"] if rnd % 2 == 0 else ["mixed", "base"]:
                models = ["big"] * 16 if kind == "base" else [names[i % 4] for i in range(16)]

                def one(i: int, models: list[str] = models, rnd: int = rnd) -> dict[str, Any]:
                    return d.generate(f"Story number {rnd}-{i}: Once upon a time", opts, model=models[i])

                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(16) as pool:
                    got = list(pool.map(one, range(16)))
                wall = time.perf_counter() - t0
                rows.setdefault(kind, []).append(
                    {
                        "tok_s": sum(g["eval_count"] for g in got) / wall,
                        "ms_per_step": statistics.median(
                            1000 * g["eval_duration"] / max(g["eval_count"], 1) for g in got
                        ),
                    }
                )
            if left(args) < 40:
                break
        table = {k: {m: round(statistics.median(x[m] for x in v), 3) for m in v[0]} for k, v in rows.items()}
        if "base" in table and "mixed" in table:
            table["mixed_x_base"] = round(table["mixed"]["tok_s"] / table["base"]["tok_s"], 3)
        res.put(
            "lora",
            table
            | {
                "runners": len(ps),
                "ps": [{k: m.get(k) for k in ("name", "size", "size_vram", "adapters")} for m in ps],
                "rounds": len(rows.get("base", [])),
            },
        )
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--long", type=int, default=16000, help="words in the long prompt (about one token each)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=330)
    ap.add_argument("--only", default="offload,decode,kv_disk,budget,flash,spec,lora")
    ap.add_argument("--model", type=Path, help="a model file write_model wrote beforehand with these shapes")
    ap.add_argument("--write-model", type=Path, help="only write the model to this path, and exit")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.write_model:
        write_model(args.write_model, args.layers, args.embd, args.ff, args.vocab, ctx=32768)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    res = Results(args.out)
    try:
        import llama_cpp

        res.put(
            "env",
            {
                "llama_cpp": llama_cpp.__version__,
                "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
                "nvidia_smi": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
                if shutil.which("nvidia-smi")
                else "none",
                "shape": [args.layers, args.embd, args.ff, args.vocab],
            },
        )
    except Exception as e:  # noqa: BLE001 - a report, not a program
        res.put("env", {"error": repr(e)})
    t = time.monotonic()
    gguf_path = args.work / "big.gguf"
    if args.model:  # written beforehand (beside a build, say) by write_model with these shapes
        gguf_path.symlink_to(args.model.resolve())
    else:
        write_model(gguf_path, args.layers, args.embd, args.ff, args.vocab, ctx=32768)
    res.put("model", {"bytes": gguf_path.stat().st_size, "write_s": round(time.monotonic() - t, 1)})
    vocab_words = [w for w in words(args.vocab - 259) if len(w) <= 2]
    ctx = 4096

    d = Daemon(args.work, "main", {"CORRAL_NUM_PARALLEL": "16"})
    try:
        mf = args.work / "Modelfile"
        mf.write_text(f"FROM {gguf_path}\n")
        t = time.monotonic()
        made = d.cli("create", "big", "-f", str(mf))
        res.put("create", {"rc": made.returncode, "s": round(time.monotonic() - t, 1), "err": made.stderr[-500:]})
        before = gpu_mib()
        t = time.monotonic()
        d.generate("", {"num_ctx": ctx, "num_predict": 1})
        ps = d.get("/api/ps")
        if "offload" in only:
            info = d.get("/api/info")
            res.put(
                "offload",
                {
                    "load_s": round(time.monotonic() - t, 1),
                    "ps": [
                        {k: m.get(k) for k in ("name", "size", "size_vram", "context_length", "details")}
                        for m in ps.get("models", [])
                    ],
                    "nvidia_smi_mib_delta": (gpu_mib() or 0) - (before or 0),
                    "info_hardware": {k: v for k, v in info.items() if k in ("hardware", "devices", "gpus", "memory")}
                    or info,
                },
            )
        if "decode" in only and left(args) > 60:
            peer = Peer(gguf_path, ctx)
            rows: dict[str, list[dict[str, float]]] = {}
            try:
                for rnd in range(args.rounds):
                    order = [1, 4, 16, "peer"] if rnd % 2 == 0 else ["peer", 16, 4, 1]
                    for what in order:
                        if what == "peer":
                            g = peer.run(f"Story number {rnd}-p: Once upon a time", args.tokens)
                            r = {
                                "tok_s": g["eval_count"] / g["wall"],
                                "ttft_p50": g["ttft"],
                                "ms_per_step": 1000 * (g["wall"] - g["ttft"]) / max(g["eval_count"] - 1, 1),
                            }
                        else:
                            r = decode_round(d, int(what), args.tokens, ctx, rnd)
                        rows.setdefault(str(what), []).append(r)
                    if left(args) < 40:
                        break
            finally:
                peer.close()
            res.put(
                "decode",
                {k: {m: round(statistics.median(x[m] for x in v), 4) for m in v[0]} for k, v in rows.items()}
                | {"rounds": len(rows.get("1", []))},
            )
    finally:
        d.stop()

    if "spec" in only and left(args) > 60:
        spec(args, res, gguf_path, ctx)

    if "lora" in only and left(args) > 60:
        lora(args, res, gguf_path, ctx)

    if "kv_disk" in only and left(args) > 90:
        d = Daemon(args.work, "kv", {"CORRAL_NUM_PARALLEL": "1"})
        try:
            d = kv_disk(d, args, res, vocab_words)
        finally:
            d.stop()

    if "budget" in only and left(args) > 60:
        d = Daemon(args.work, "budget", {"CORRAL_VRAM_BUDGET": "2GiB", "CORRAL_NUM_PARALLEL": "1"})
        try:
            t = time.monotonic()
            d.generate("", {"num_ctx": ctx, "num_predict": 1})
            ps = d.get("/api/ps").get("models", [])
            g = d.generate(
                "Story number b: Once upon a time", {"num_ctx": ctx, "num_predict": args.tokens, "temperature": 0}
            )
            res.put(
                "budget",
                {
                    "load_s": round(time.monotonic() - t, 1),
                    "ps": [{k: m.get(k) for k in ("size", "size_vram")} for m in ps],
                    "decode_tok_s": round(g["eval_count"] / max(g["eval_duration"], 1e-9), 2),
                },
            )
        finally:
            d.stop()

    if "flash" in only and left(args) > 60:
        flash: dict[str, Any] = {}
        prefix = text_of(8000, 7, vocab_words)
        for setting in ("false", "true"):
            if left(args) < 30:
                break
            d = Daemon(
                args.work,
                f"flash-{setting}",
                {"CORRAL_FLASH_ATTENTION": setting, "CORRAL_NUM_PARALLEL": "1", "CORRAL_KV_DISK": "0"},
            )
            try:
                opts = {"num_ctx": 12288, "num_predict": args.tokens, "temperature": 0}
                d.generate("", {**opts, "num_predict": 1})
                g = d.generate(prefix, opts)
                flash[setting] = {
                    "prefill_tok_s": round(g["prompt_eval_count"] / max(g["prompt_eval_duration"], 1e-9), 1),
                    "decode_tok_s_at_8k": round(g["eval_count"] / max(g["eval_duration"], 1e-9), 2),
                    "ttft": round(g["ttft"], 3),
                }
                res.put("flash", flash)
            finally:
                d.stop()
    res.put("done", {"s": round(time.monotonic() - T0, 1)})


if __name__ == "__main__":
    main()
