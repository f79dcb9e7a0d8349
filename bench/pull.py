"""Pull throughput: corral pulling a large blob from a local registry, against curl fetching the same blob.

Starts Debian's docker-registry (CNCF distribution) on 127.0.0.1 with a temporary storage directory, pushes one
model whose layer is ``--size-mib`` MiB of random bytes, and starts a daemon. Each round then times, in
alternating order:

* ``curl -o <file>``: one GET of the blob into a file on the models directory's filesystem;
* corral: ``POST /api/pull`` (``stream: false``), from the request to the answer, so it includes the manifest,
  the parallel ranged download, the sha256 check and the rename; then the model is deleted
  (which deletes the blob) for the next round.

Before each timed run, ``sync`` waits for the previous run's data to reach the disk, so neither side pays for
the other's writeback (curl's file and corral's blob are both written back by the kernel after their runs; corral
fsyncs its blob right after the pull answers). Both read the registry's copy from the page cache. Reported:
median MB/s of each side and
their ratio (the target is corral/curl ≥ 0.9).

Usage: .venv/bin/python bench/pull.py [--size-mib 1024] [--rounds 5] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import start_daemon, stop_daemon
from tests.registry_pull.conftest import start_registry, stop_registry

SECTION = "\n## Pull: corral vs curl from a local registry (issue 5)\n"


def write_random(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 16 * 1024 * 1024))
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return "sha256:" + h.hexdigest()


def upload(base: str, repo: str, path: Path, digest: str) -> None:
    with httpx.Client(base_url=base, timeout=600) as c:
        loc = httpx.URL(c.post(f"/v2/{repo}/blobs/uploads/").headers["location"])
        with open(path, "rb") as f:
            r = c.put(
                loc.copy_merge_params({"digest": digest}),
                content=f,
                headers={"Content-Type": "application/octet-stream", "Content-Length": str(path.stat().st_size)},
            )
        r.raise_for_status()


def push_model(base: str, repo: str, layer: Path, digest: str) -> None:
    upload(base, repo, layer, digest)
    with tempfile.NamedTemporaryFile(delete=False) as config:
        config.write(b'{"model_format":"gguf","architecture":"amd64","os":"linux"}')
    cpath = Path(config.name)
    cdigest = "sha256:" + hashlib.sha256(cpath.read_bytes()).hexdigest()
    upload(base, repo, cpath, cdigest)
    doc = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": cdigest,
            "size": cpath.stat().st_size,
        },
        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": layer.stat().st_size}],
    }
    cpath.unlink()
    r = httpx.put(
        f"{base}/v2/{repo}/manifests/latest",
        content=json.dumps(doc).encode(),
        headers={"Content-Type": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    r.raise_for_status()


def time_curl(url: str, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["curl", "-sSf", "-o", str(out), url], check=True)
    elapsed = time.perf_counter() - started
    out.unlink()
    return elapsed


def time_corral(daemon_url: str, name: str) -> float:
    with httpx.Client(base_url=daemon_url, timeout=600) as c:
        started = time.perf_counter()
        r = c.post("/api/pull", json={"model": name, "insecure": True, "stream": False})
        elapsed = time.perf_counter() - started
        if r.status_code != 200 or r.json() != {"status": "success"}:
            raise RuntimeError(f"pull failed: {r.status_code} {r.text}")
        c.request("DELETE", "/api/delete", json={"model": name}).raise_for_status()
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    size = args.size_mib * 1024 * 1024
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-pull-"))
    registry = start_registry(tmp / "registry")
    daemon = start_daemon(tmp / "models", tmp / "daemon.log")
    try:
        layer = tmp / "layer.bin"
        digest = write_random(layer, size)
        push_model(registry.url, "bench/big", layer, digest)
        layer.unlink()
        blob_url = f"{registry.url}/v2/bench/big/blobs/{digest}"
        name = f"{registry.host}/bench/big:latest"
        curl_times, corral_times = [], []
        for i in range(args.rounds):
            sides = [
                ("curl", lambda: time_curl(blob_url, tmp / "models" / "curl.out")),
                ("corral", lambda: time_corral(daemon.url, name)),
            ]
            for side, run in sides if i % 2 == 0 else reversed(sides):
                os.sync()  # the previous run's writeback must not land in this one
                time.sleep(1)
                elapsed = run()
                (curl_times if side == "curl" else corral_times).append(elapsed)
                print(f"round {i + 1} {side}: {size / elapsed / 1e6:.0f} MB/s ({elapsed:.2f} s)", file=sys.stderr)
    finally:
        stop_daemon(daemon)
        stop_registry(registry)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    curl_mbs = size / statistics.median(curl_times) / 1e6
    corral_mbs = size / statistics.median(corral_times) / 1e6
    # each round's two runs are back to back, so their ratio is the least disturbed by other load on the machine
    ratios = [c / o for c, o in zip(curl_times, corral_times, strict=True)]
    pair_ratio = statistics.median(ratios)
    table = "\n".join(
        [
            "| side | median MB/s | median seconds | runs |",
            "|---|---|---|---|",
            f"| curl (one GET into a file) | {curl_mbs:.0f} | {statistics.median(curl_times):.2f} |"
            f" {len(curl_times)} |",
            f"| corral pull (8 ranged GETs, sha256) | {corral_mbs:.0f} | {statistics.median(corral_times):.2f} |"
            f" {len(corral_times)} |",
            "",
            f"corral / curl: **{pair_ratio:.2f}×** (median of the rounds' ratios; ratio of the medians "
            f"{corral_mbs / curl_mbs:.2f}×; per round: {', '.join(f'{r:.2f}' for r in ratios)})",
        ]
    )
    print(table)
    if args.write:
        section = (
            SECTION + "\n"
            f"Command: `.venv/bin/python bench/pull.py --size-mib {args.size_mib} --rounds {args.rounds} "
            "--write docs/benchmarks.md`\n\n"
            f"One {args.size_mib} MiB blob of random bytes in Debian's docker-registry (CNCF distribution "
            f"2.8, filesystem storage) on 127.0.0.1, plain HTTP; {os.cpu_count()} cores, shared with other work. "
            "curl does one GET into a file; corral's time is the whole `POST /api/pull` through the daemon "
            "(manifest, 8 parallel ranged GETs moved into the file with `splice` on plain HTTP, the sha256 "
            "computed while the parts arrive, rename, manifest; the blob's fsync follows the answer, as curl's "
            "file is written back after it exits). The model is deleted between rounds; sides alternate, each "
            "after a `sync`. corral keeps both cores busy (one of them hashing) where curl needs one, so other load "
            "on the machine lowers corral's side more: rerun on a quiet machine.\n\n" + table + "\n"
        )
        text = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
        if SECTION in text:
            head, _, rest = text.partition(SECTION)
            nxt = rest.find("\n## ")
            text = head + section + (rest[nxt:] if nxt >= 0 else "")
        else:
            text = text.rstrip("\n") + "\n" + section
        args.write.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
