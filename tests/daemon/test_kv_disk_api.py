"""The prompt cache on disk, the daemon's side (issue 27): CORRAL_KV_DISK and CORRAL_KV_DISK_DIR, what the load spec
carries to the runner, /api/info, /api/ps and `corral ps`, `corral prune` removing the caches of models that are
gone; and, end to end with real llama.cpp runners, a long prompt restored from disk after an unload, after the
runner was killed and after a daemon restart giving the tokens a cold run gives."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from daemon.generation.inference import Inference
from daemon.settings import KV_DISK_MAX_DEFAULT, GiB, Settings, SettingsError
from tests.conftest import REPO, Daemon, free_port, start_daemon, stop_daemon
from tests.models import smollm2_path, write_tiny_gguf


# -- settings ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "want"),
    [("10GB", 10 * 1000**3), ("512MiB", 512 * 1024**2), ("123456", 123456), ("0", 0), (' "2GiB" ', 2 * GiB)],
)
def test_kv_disk_sizes(raw: str, want: int, tmp_path: Path) -> None:
    s = Settings.from_env({"CORRAL_KV_DISK": raw, "CORRAL_MODELS": str(tmp_path / "m")})
    assert s.kv_disk == want


def test_kv_disk_default_is_a_share_of_the_free_disk(tmp_path: Path) -> None:
    where = tmp_path / "not" / "yet" / "kv"  # measured on the nearest directory that exists
    s = Settings.from_env({"CORRAL_KV_DISK_DIR": str(where), "CORRAL_MODELS": str(tmp_path / "m")})
    assert s.kv_disk_dir == where
    want = min(shutil.disk_usage(tmp_path).free // 10, KV_DISK_MAX_DEFAULT)
    assert s.kv_disk == pytest.approx(want, rel=0.01)
    assert 0 < s.kv_disk <= 64 * GiB


def test_kv_disk_dir_default_is_the_user_cache_dir(tmp_path: Path) -> None:
    import platformdirs

    s = Settings.from_env({"CORRAL_MODELS": str(tmp_path / "m")})
    assert s.kv_disk_dir == Path(platformdirs.user_cache_dir("corral", appauthor=False)) / "kv"
    assert (Settings().kv_disk, Settings().kv_disk_dir) == (0, None)  # one built in code keeps none unless asked


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"CORRAL_KV_DISK": "lots"}, 'CORRAL_KV_DISK="lots" is not a size'),
        ({"CORRAL_KV_DISK": "-1GB"}, 'CORRAL_KV_DISK="-1GB" is not a size'),
        ({"CORRAL_KV_DISK_DIR": "{models}/kv"}, "is inside the model store"),
        ({"CORRAL_KV_DISK_DIR": "{models}"}, "is inside the model store"),
        ({"CORRAL_KV_DISK_DIR": "{tmp}"}, "holds the model store"),
    ],
)
def test_kv_disk_bad_values_are_refused(env: dict[str, str], says: str, tmp_path: Path) -> None:
    models = tmp_path / "models"
    env = {k: v.format(models=models, tmp=tmp_path) for k, v in env.items()}
    with pytest.raises(SettingsError, match=says):
        Settings.from_env({"CORRAL_MODELS": str(models), **env})


def test_serve_refuses_a_bad_kv_disk_at_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
    env.update(
        CORRAL_HOST=f"127.0.0.1:{free_port()}",
        CORRAL_MODELS=str(tmp_path / "models"),
        PYTHONPATH=str(REPO),
        CORRAL_KV_DISK="ten gigs",
    )
    r = subprocess.run(
        [sys.executable, "-m", "cli", "serve"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("Error: ") and 'CORRAL_KV_DISK="ten gigs" is not a size' in first, r.stderr


# -- the load spec -----------------------------------------------------------------------------------------------------
def _ctx(path: Path, adapters: tuple[str, ...] = (), projector: Path | None = None) -> Any:
    from registry.gguf import read_gguf_file

    return SimpleNamespace(
        params={},
        info=read_gguf_file(str(path)),
        model_path=path,
        adapters=adapters,
        projector_path=projector,
        stored=SimpleNamespace(manifest=SimpleNamespace(first=lambda *media: projector)),
    )


def test_load_spec_carries_the_cache_and_its_key(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    model = write_tiny_gguf(blobs / ("sha256-" + "a" * 64), context_length=1024)
    adapter = blobs / ("sha256-" + "b" * 64)
    settings = Settings.from_env(
        {"CORRAL_KV_DISK": "3GiB", "CORRAL_KV_DISK_DIR": str(tmp_path / "kv"), "CORRAL_MODELS": str(tmp_path / "m")}
    )
    inf = Inference(None, None, settings, default_num_ctx=512, ram_budget=1 << 34)  # type: ignore[arg-type]
    ctx = _ctx(model, (str(adapter),))
    spec = inf.load_spec(ctx, inf.options(ctx, {}))
    assert (spec.kv_disk_dir, spec.kv_disk_bytes) == (str(tmp_path / "kv"), 3 * GiB)
    key = json.loads(spec.kv_key)
    # the base's key: a generation runner serves every model over its base and keeps KV computed under an adapter
    # out of the disk cache (issue 29), so the model's adapters are not part of it
    assert key["model"] == "sha256:" + "a" * 64 and key["adapters"] == []
    assert spec.adapters == ()  # loaded with the base alone; the adapters come with each request
    assert (key["projector"], key["kv_type"], key["flash_attn"]) == ("", "f16", "auto")
    assert key["rope"]["llama.context_length"] == 1024
    assert spec.kv_key == json.dumps(key, sort_keys=True, separators=(",", ":"))  # canonical

    # another KV cache type is another key; an embedding runner keeps no cache
    q8 = Inference(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Settings.from_env(
            {"CORRAL_KV_DISK": "3GiB", "CORRAL_KV_CACHE_TYPE": "q8_0", "CORRAL_MODELS": str(tmp_path / "m")}
        ),
        default_num_ctx=512,
        ram_budget=1 << 34,
    ).load_spec(ctx, inf.options(ctx, {}))
    assert json.loads(q8.kv_key)["kv_type"] == "q8_0" and q8.kv_key != spec.kv_key
    emb = inf.load_spec(ctx, inf.options(ctx, {}), embedding=True)
    assert (emb.kv_disk_dir, emb.kv_disk_bytes, emb.kv_key) == ("", 0, "")

    off = Settings.from_env({"CORRAL_KV_DISK": "0", "CORRAL_MODELS": str(tmp_path / "m")})
    inf_off = Inference(None, None, off, default_num_ctx=512, ram_budget=1 << 34)  # type: ignore[arg-type]
    spec_off = inf_off.load_spec(ctx, inf_off.options(ctx, {}))
    assert (spec_off.kv_disk_dir, spec_off.kv_disk_bytes, spec_off.kv_key) == ("", 0, "")


# -- /api/info, /api/ps and corral ps ----------------------------------------------------------------------------------
def test_info_shows_the_location_and_the_bound(tmp_path: Path) -> None:
    kv = tmp_path / "kv-elsewhere"
    d = start_daemon(
        tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_KV_DISK": "2GiB", "CORRAL_KV_DISK_DIR": str(kv)}
    )
    try:
        info = httpx.get(d.url + "/api/info", timeout=30).json()
        assert info["settings"]["kv_disk"] == 2 * GiB and info["settings"]["kv_disk_dir"] == str(kv)
        out = d.cli("info")
        assert out.returncode == 0, out.stderr
        rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
        assert "2.1 GB" in rows["CORRAL_KV_DISK"] and str(kv) in rows["CORRAL_KV_DISK_DIR"], out.stdout
    finally:
        stop_daemon(d)
    kv_info = info["kv_disk"]
    assert kv_info == {"enabled": True, "dir": str(kv), "limit_bytes": 2 * GiB, "bytes": 0}


def test_ps_shows_the_cache_per_model() -> None:
    from cli.commands.ps import notes
    from daemon.api.routes.ps import kv_disk_json
    from daemon.runners.protocol import KVDiskInfo

    assert kv_disk_json(None) is None and kv_disk_json(KVDiskInfo()) is None  # the daemon gave it no cache
    on = KVDiskInfo("/kv", GiB, entries=3, bytes=3_000_000, hits=3, misses=1, restored_tokens=768, enabled=True)
    shown = kv_disk_json(on)
    assert shown == {
        "enabled": True,
        "entries": 3,
        "bytes": 3_000_000,
        "hits": 3,
        "misses": 1,
        "hit_rate": 0.75,
        "restored_tokens": 768,
    }
    off = kv_disk_json(KVDiskInfo(reason="its KV cache is not a standard one"))
    assert off == {"enabled": False, "reason": "its KV cache is not a standard one"}
    lines = notes([{"name": "a:latest", "kv_disk": shown}, {"name": "b:latest", "kv_disk": off}])
    assert "a:latest prompt cache on disk: 3 blocks, 3 MB, hits 75% of 4 lookups, 768 tokens restored" in lines
    assert "b:latest keeps no prompt cache on disk (its KV cache is not a standard one)" in lines
    empty = kv_disk_json(KVDiskInfo("/kv", GiB, enabled=True))
    assert empty is not None and notes([{"name": "c:latest", "kv_disk": empty}]) == []


# -- corral prune ------------------------------------------------------------------------------------------------------
def _cache_of(root: Path, model_digest: str, seed: int) -> Path:
    """A real cache directory (``kvstore.KVStore``) holding one block for ``model_digest``."""
    from daemon.runners.kvstore import BLOCK_TOKENS, KVStore, chain_hashes

    key = hashlib.sha256(f"{model_digest} {seed}".encode()).hexdigest()
    store = KVStore(root, key, GiB, {"model": model_digest})
    tokens = list(range(seed, seed + BLOCK_TOKENS))
    assert store.save(0, chain_hashes(key, tokens), tokens, os.urandom(4096))
    assert (root / key / "meta.json").is_file()
    return root / key


def test_prune_removes_the_caches_of_models_that_are_gone(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    env = {"CORRAL_KV_DISK": "1GiB", "CORRAL_KV_DISK_DIR": str(kv)}
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", env)
    try:
        digests = {}
        for name, seed in (("keep", 0), ("gone", 1)):
            gguf = write_tiny_gguf(tmp_path / f"{name}.gguf", seed=seed)
            digests[name] = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
            ok = d.cli("create", name, "-f", str(_modelfile(tmp_path, gguf)))
            assert ok.returncode == 0, ok.stderr
        kept, gone = _cache_of(kv, digests["keep"], 0), _cache_of(kv, digests["gone"], 1)
        stranger = _cache_of(kv, "sha256:" + "c" * 64, 2)  # a model this store never had
        assert d.cli("rm", "gone").returncode == 0
        assert kept.is_dir() and gone.is_dir()  # rm leaves the cache: prune removes it

        dry = httpx.post(d.url + "/api/prune", json={"dry_run": True}, timeout=60).json()
        assert "kv_disk_bytes_freed" not in dry and gone.is_dir()
        r = httpx.post(d.url + "/api/prune", json={}, timeout=60).json()
        assert r["kv_disk_bytes_freed"] >= 2 * 4096, r
        assert kept.is_dir() and not gone.exists() and not stranger.exists()
    finally:
        stop_daemon(d)

    # at start, too (unless CORRAL_NOPRUNE): a cache left by a model removed while the daemon was down
    late = _cache_of(kv, "sha256:" + "d" * 64, 3)
    d = start_daemon(tmp_path / "models", tmp_path / "daemon2.log", env)
    try:
        assert not late.exists() and kept.is_dir()
        assert "prompt caches on disk of models that are gone" in d.log.read_text()
    finally:
        stop_daemon(d)


def _modelfile(tmp: Path, gguf: Path) -> Path:
    mf = tmp / f"{gguf.stem}.Modelfile"
    mf.write_text(f"FROM {gguf}\n")
    return mf


# -- end to end: a long prompt restored from disk ---------------------------------------------------------------------
SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
GREEDY = {"temperature": 0, "seed": 42, "max_tokens": 16}
OPTIONS = {"num_ctx": 2048}  # through the model's PARAMETER: OpenAI's API has no num_ctx


def _system(topic: str) -> str:
    """A system prompt of about 870 tokens (three full blocks and more), different from its first line per topic."""
    facts = [
        f"Rule {i}: when asked about {topic} number {i}, answer with the colour of item {i * 7 % 13}."
        for i in range(40)
    ]
    return f"You are a careful assistant for {topic}.\n" + "\n".join(facts)


def _ask(d: Daemon, topic: str) -> tuple[str, int, int]:
    """The greedy answer to a question after the long system prompt; prompt tokens and how many were cached."""
    r = httpx.post(
        d.url + "/v1/chat/completions",
        timeout=300,
        json={
            "model": "smol",
            "messages": [{"role": "system", "content": _system(topic)}, {"role": "user", "content": "Rule 5?"}],
            **GREEDY,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    return (
        body["choices"][0]["message"]["content"],
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )


def _unload(d: Daemon) -> None:
    r = httpx.post(d.url + "/api/generate", json={"model": "smol", "keep_alive": 0}, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while httpx.get(d.url + "/api/ps", timeout=30).json()["models"]:
        assert time.monotonic() < deadline, "the model was not unloaded"
        time.sleep(0.2)


def _blocks_on_disk(d: Daemon, want: int) -> dict[str, Any]:
    """Wait (the runner writes on its own thread) until /api/ps shows ``want`` blocks on disk; the model's entry."""
    deadline = time.monotonic() + 60
    while True:
        models = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
        kv = models[0].get("kv_disk") if models else None
        if kv and kv.get("entries", 0) >= want:
            return dict(kv)
        assert time.monotonic() < deadline, f"no {want} blocks on disk: {models}"
        time.sleep(0.2)


def _files_on_disk(root: Path, want: int) -> None:
    """Wait until ``want`` block files are on disk under ``root``."""
    deadline = time.monotonic() + 60
    while len(list(root.rglob("*.kvb"))) < want:
        assert time.monotonic() < deadline, f"fewer than {want} blocks in {root}: {list(root.rglob('*'))}"
        time.sleep(0.2)


def _runner_pid(d: Daemon) -> int:
    import psutil

    children = psutil.Process(d.proc.pid).children(recursive=True)
    assert len(children) == 1, children
    return int(children[0].pid)


@needs_smol
def test_restored_after_unload_kill_and_restart_gives_the_cold_answer(tmp_path: Path) -> None:
    assert SMOL is not None
    env = {"CORRAL_KV_DISK": "1GiB", "CORRAL_NUM_PARALLEL": "1"}
    mf = tmp_path / "Modelfile"
    mf.write_text(f"FROM {SMOL}\nPARAMETER num_ctx {OPTIONS['num_ctx']}\n")
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", env)
    try:
        made = d.cli("create", "smol", "-f", str(mf))
        assert made.returncode == 0, made.stderr
        cold, n_prompt, cached = _ask(d, "gardening")
        assert n_prompt > 2 * 256 and cached == 0 and cold
        blocks = (n_prompt - 1) // 256  # full blocks before the last token
        kv = _blocks_on_disk(d, blocks)
        assert kv["enabled"] is True and kv["bytes"] > 0

        # after an unload: the next runner restores the prefix from disk
        _unload(d)
        again, _, cached = _ask(d, "gardening")
        assert again == cold and cached >= blocks * 256, (again, cold, cached)
        kv = _blocks_on_disk(d, blocks)
        assert kv["hits"] >= 1 and kv["restored_tokens"] >= blocks * 256

        # after kill -9 of the runner: what a finished request wrote is on disk already
        cold_b, n_b, cached_b = _ask(d, "astronomy")
        assert cached_b < 256  # the slot's few tokens in common with gardening's prompt, no block from disk
        blocks_b = (n_b - 1) // 256
        _files_on_disk(tmp_path / "kv-models", blocks + blocks_b)  # the two prompts share no block
        import psutil

        runner = psutil.Process(_runner_pid(d))
        runner.send_signal(signal.SIGKILL)
        runner.wait(30)
        again_b, _, cached_b = _ask(d, "astronomy")
        assert again_b == cold_b and cached_b >= blocks_b * 256, (again_b, cold_b, cached_b)
    finally:
        stop_daemon(d)

    # after a daemon restart
    d = start_daemon(tmp_path / "models", tmp_path / "daemon2.log", env)
    try:
        again, _, cached = _ask(d, "gardening")
        assert again == cold and cached >= blocks * 256, (again, cold, cached)
        ps = d.cli("ps")
        assert ps.returncode == 0 and "prompt cache on disk:" in ps.stdout, ps.stdout + ps.stderr
        # /metrics counts the restored tokens as cached
        metrics = httpx.get(d.url + "/metrics", timeout=30).text
        counted = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("corral_prompt_cached_tokens_total{")
        )
        assert counted >= blocks * 256, metrics
    finally:
        stop_daemon(d)
