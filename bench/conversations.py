"""Many conversations with one system prompt, more of them than slots: how much of each turn's prompt corral reuses,
and how long a turn takes, corral against itself at an earlier commit (the slot choice changed in between).

Usage: git worktree add --detach /tmp/corral-pick-before f1db2bc &&
       .venv/bin/python bench/conversations.py [--before /tmp/corral-pick-before] [--rounds 3]
       [--write docs/benchmarks.md]

Both daemons load SmolLM2-135M-Instruct (scripts/fetch_smollm2.py) with ``--slots`` parallel sequences and the same
num_ctx, and take turns: each round runs every daemon in an order that rotates, so the drifts of a shared 2-core
machine hit both alike. In a round, ``--conversations`` conversations (one system prompt of ~400 tokens, each its
own user messages) run ``--turns`` turns each over ``--threads`` client threads, greedy, ``--tokens`` tokens an
answer, through /v1/chat/completions. Measured per round: prompt tokens evaluated (OpenAI's prompt_tokens less
cached_tokens, summed), the share of prompt tokens served from the cache, the median and p95 of a turn's time, and
the wall time of the round. The tables show medians over the rounds.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import batching
from bench.lora import revision

SYSTEM = " ".join(
    f"Rule {i}: answer in plain words, keep to the facts you are sure of, and say so when you do not know."
    for i in range(1, 21)
)  # ~400 tokens: an app's system prompt, the same for every user


@dataclass
class Round:
    evaluated: int
    prompt: int
    turn_s: list[float]
    wall: float


def run_round(d: batching.Corral, args: argparse.Namespace, tag: str) -> Round:
    totals = {"evaluated": 0, "prompt": 0}
    turn_s: list[float] = []

    def talk(i: int) -> None:
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        with httpx.Client(timeout=600) as client:
            for n in range(args.turns):
                messages.append({"role": "user", "content": f"{tag} user {i} asks question {n}: what is {i * n + 7}?"})
                body: dict[str, Any] = {
                    "model": "bench",
                    "messages": messages,
                    "max_tokens": args.tokens,
                    "temperature": 0,
                }
                started = time.perf_counter()
                r = client.post(d.url + "/v1/chat/completions", json=body)
                turn_s.append(time.perf_counter() - started)
                r.raise_for_status()
                out = r.json()
                usage = out["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                totals["prompt"] += usage["prompt_tokens"]
                totals["evaluated"] += usage["prompt_tokens"] - cached
                messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})

    started = time.perf_counter()
    with cf.ThreadPoolExecutor(args.threads) as pool:
        list(pool.map(talk, range(args.conversations)))
    return Round(totals["evaluated"], totals["prompt"], turn_s, time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, default=Path("/tmp/corral-pick-before"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    model = batching.smollm2_path()
    if model is None:
        sys.exit("SmolLM2 is not cached: run scripts/fetch_smollm2.py")
    if not (args.before / "daemon").is_dir():
        sys.exit(f"{args.before} is not a corral checkout: git worktree add --detach {args.before} f1db2bc")
    work = Path(tempfile.mkdtemp(prefix="corral-conversations-"))
    daemons: dict[str, batching.Corral] = {}
    try:  # each loaded, outside the rounds
        daemons["before"] = batching.Corral(model, args.ctx, work / "before", args.slots, args.before.resolve())
        daemons["corral"] = batching.Corral(model, args.ctx, work / "corral", args.slots)
        results: dict[str, list[Round]] = {k: [] for k in daemons}
        names = list(daemons)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for k in order:
                res = run_round(daemons[k], args, f"round {r} {k}")
                results[k].append(res)
                print(
                    f"round {r} {k}: evaluated {res.evaluated} of {res.prompt} prompt tokens, "
                    f"turn median {statistics.median(res.turn_s):.3f}s, wall {res.wall:.1f}s",
                    flush=True,
                )
    finally:
        for d in daemons.values():
            d.close()
    table = report(results, args)
    print(table)
    if args.write:
        with args.write.open("a") as f:
            f.write("\n" + table)


def report(results: dict[str, list[Round]], args: argparse.Namespace) -> str:
    def med(k: str, f: Any) -> float:
        return statistics.median(f(x) for x in results[k])

    labels = {"before": f"corral {revision(args.before)} (before)", "corral": "corral (this commit)"}
    lines = [
        f"## Many conversations, one system prompt, more than the slots ({args.conversations} conversations, "
        f"{args.slots} slots, {args.threads} at once)",
        "",
        f"`.venv/bin/python bench/conversations.py --rounds {args.rounds} --conversations {args.conversations} "
        f"--threads {args.threads} --turns {args.turns} --tokens {args.tokens} --slots {args.slots}` "
        f"({time.strftime('%Y-%m-%d')}, SmolLM2-135M, {os.cpu_count()} CPUs; medians over {args.rounds} rounds)",
        "",
        "| daemon | prompt tokens evaluated | share cached | turn p50 s | turn p95 s | wall s | wall / before |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in results:
        wall = med(k, lambda x: x.wall)
        vs = "-" if k == "before" else f"{wall / med('before', lambda x: x.wall):.2f}x"
        lines.append(
            f"| {labels[k]} | {med(k, lambda x: x.evaluated):.0f} | "
            f"{med(k, lambda x: 1 - x.evaluated / max(1, x.prompt)):.1%} | "
            f"{med(k, lambda x: statistics.median(x.turn_s)):.3f} | "
            f"{med(k, lambda x: statistics.quantiles(x.turn_s, n=20)[18]):.3f} | {wall:.1f} | {vs} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
