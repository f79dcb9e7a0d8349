"""Issue 17 (points 2, 3, 12): numbers from outside are range-checked where they enter, a hostile GGUF header cannot
freeze the daemon or inflate it, and a runner's native stderr never reaches a client.

Through a real daemon: a GGUF declaring a huge ``block_count`` (created, and planted in the store as if created
by an older corral) while another client polls ``/api/version``; ``context`` token ids out of the vocabulary or
out of int32 while another user's stream runs on the same model; bad option values from the API, from ``/api/create``
and from a Modelfile through the CLI; a runner killed by SIGSEGV mid-stream and models llama.cpp refuses to load.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import (
    huge_block_count_gguf,
    smollm2_path,
    write_gguf_missing_tensor,
    write_gguf_with_architecture,
    write_tiny_gguf,
)
from tests.steps import steps
from tests.watch import Watch

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
MB = 1 << 20


def upload(h: httpx.Client, data: bytes) -> str:
    import hashlib

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = h.post(f"/api/blobs/{digest}", content=data)
    assert r.status_code in (200, 201), r.text
    return digest


def create(h: httpx.Client, name: str, data: bytes, **extra: Any) -> httpx.Response:
    digest = upload(h, data)
    body = {"model": name, "files": {f"{name}.gguf": digest}, "stream": False, **extra}
    return h.post("/api/create", content=json.dumps(body), headers={"Content-Type": "application/json"})


def post_json(h: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """``body`` as Python's json writes it: NaN and Infinity as bare words, as a hostile client sends them."""
    return h.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})


def runner_pids(d: Daemon) -> list[int]:
    return [p.pid for p in psutil.Process(d.proc.pid).children(recursive=True)]


# -- 2: a hostile block_count ------------------------------------------------------------------------------------


def plant(models: Path, name: str, gguf: bytes) -> None:
    """Put a model in the store the way an older corral (without the header checks) would have created it."""
    from registry.manifest import CONFIG_MEDIA_TYPE, MEDIA_MODEL, Layer, Manifest
    from registry.names import ModelName
    from registry.store import Store

    store = Store(models)
    digest = store.put_bytes(gguf)
    config = json.dumps(
        {"model_format": "gguf", "model_family": "llama", "rootfs": {"type": "layers", "diff_ids": [str(digest)]}}
    ).encode()
    cdigest = store.put_bytes(config)
    manifest = Manifest.build(Layer(CONFIG_MEDIA_TYPE, cdigest, len(config)), [Layer(MEDIA_MODEL, digest, len(gguf))])
    store.write_manifest(store.canonical(ModelName.parse(name)), manifest)


def test_huge_block_count_is_refused_without_freezing_or_inflating_the_daemon(tmp_path: Path) -> None:
    hostile = huge_block_count_gguf(30_000_000)
    assert len(hostile) < 256
    models = tmp_path / "models"
    plant(models, "planted", hostile)
    d = start_daemon(models, tmp_path / "daemon.log")
    try:
        watch = Watch(d)
        watch.start()
        time.sleep(0.3)
        with httpx.Client(base_url=d.url, timeout=180) as h:
            created = create(h, "hostile", hostile)
            asked = h.post("/api/generate", json={"model": "hostile", "prompt": "hi", "stream": False})
            planted = h.post("/api/generate", json={"model": "planted", "prompt": "hi", "stream": False})
            chat = h.post(
                "/api/chat", json={"model": "planted", "stream": False, "messages": [{"role": "user", "content": "hi"}]}
            )
        time.sleep(0.3)
        watch.stop()
        grown = (watch.peak_rss - watch.base_rss) / MB
        numbers = (
            f"create={created.status_code} {created.text[:200]!r} generate={asked.status_code} "
            f"planted={planted.status_code} {planted.text[:200]!r} chat={chat.status_code} "
            f"worst_version_poll={watch.worst:.2f}s polls={watch.polls} "
            f"failures={watch.failures[:3]} rss_growth={grown:.0f}MB"
        )
        print(numbers)
        # refused by the header check itself, before anything sized by the layer count (an estimate, a load) ran:
        # what makes this quick is shown by where it was refused, not timed
        refused = '"llama.block_count" declares 30000000 layers; llama.cpp supports at most 512'
        assert 400 <= created.status_code < 500 and refused in created.json()["error"], numbers
        assert 400 <= asked.status_code < 500, numbers  # it was never created
        for r in (planted, chat):
            assert r.status_code == 400 and refused in r.json()["error"], numbers
        assert watch.worst < 2.0 and not watch.failures, numbers
        assert grown < 200, numbers
        assert httpx.get(d.url + "/api/tags").status_code == 200
    finally:
        stop_daemon(d)


def test_estimate_costs_the_tensors_not_the_declared_block_count() -> None:
    """A header that did not come through the reader (which refuses more than llama.cpp's 512 layers) still cannot
    make the estimate or the layer split allocate or loop per declared layer."""
    import tracemalloc

    from daemon.scheduling.memory import choose_gpu_layers, estimate
    from registry.gguf import GGUFInfo

    info = GGUFInfo(
        version=3,
        metadata={
            "general.architecture": "llama",
            "llama.block_count": 100_000_000,
            "llama.embedding_length": 64,
            "llama.attention.head_count": 2,
        },
        tensors=(),
        data_offset=0,
        file_size=0,
    )
    tracemalloc.start()
    try:
        with steps(budget=20_000) as taken:  # stops a loop per declared layer at once (100M layers: minutes)
            est = estimate(info, num_ctx=512)
            layers = choose_gpu_layers(info, num_ctx=512, vram_budget=1 << 40)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert taken.lines < 20_000 and peak < 8 * MB, (taken.lines, peak)  # ~1,400 lines and a few KiB today
    assert est.ram > 0 and 0 <= layers <= 513


def _brute_force_layers(info: Any, budget: int, **kw: Any) -> int:
    """The old search: an estimate for every layer count from the top."""
    from daemon.scheduling.memory import estimate

    for n in range(info.block_count + 1, -1, -1):  # llama.cpp's count: the output layer is one more
        if estimate(info, n_gpu_layers=n, **kw).vram <= budget:
            return n
    return 0


@needs_smol
def test_choose_gpu_layers_is_the_same_split_as_trying_every_count(tmp_path: Path) -> None:
    from daemon.scheduling.memory import choose_gpu_layers
    from registry.gguf import read_gguf_file

    assert SMOL is not None
    for info in (read_gguf_file(SMOL), read_gguf_file(write_tiny_gguf(tmp_path / "t.gguf", n_layer=5))):
        for kw in ({"num_ctx": 512}, {"num_ctx": 4096, "num_parallel": 3, "kv_type": "q8_0"}):
            for budget in [1, *range(1_000_000, 400_000_000, 3_000_000)]:
                assert choose_gpu_layers(info, vram_budget=budget, **kw) == _brute_force_layers(info, budget, **kw)


# -- 3: context token ids --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_parallel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    assert SMOL is not None
    tmp = tmp_path_factory.mktemp("smol-parallel")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_NUM_PARALLEL": "2"})
    try:
        with httpx.Client(base_url=d.url, timeout=120) as h:
            r = create(h, "smol", SMOL.read_bytes())
            assert r.status_code == 200, r.text
        yield d
    finally:
        stop_daemon(d)


class Stream(threading.Thread):
    """A normal streaming generation; ``first`` is set once its first token arrived."""

    def __init__(self, d: Daemon, num_predict: int) -> None:
        super().__init__(daemon=True)
        self.url = d.url + "/api/generate"
        self.body = {
            "model": "smol",
            "prompt": "Count from one to one hundred in words:",
            "stream": True,
            "options": {"temperature": 0, "num_predict": num_predict, "num_ctx": 512},
        }
        self.first = threading.Event()
        self.lines: list[dict[str, Any]] = []
        self.status = 0
        self.ended = 0.0

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=180) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.strip():
                        self.lines.append(json.loads(line))
                        self.first.set()
        finally:
            self.ended = time.monotonic()
            self.first.set()


@needs_smol
@pytest.mark.real_model
def test_bad_context_ids_fail_only_their_request(smol_parallel: Daemon) -> None:
    d = smol_parallel
    with httpx.Client(base_url=d.url, timeout=120) as h:
        warm = h.post(
            "/api/generate",
            json={"model": "smol", "prompt": "Hi", "stream": False, "options": {"num_predict": 2, "num_ctx": 512}},
        )
        assert warm.status_code == 200, warm.text
        good_context = warm.json()["context"]
        stream = Stream(d, num_predict=120)
        stream.start()
        assert stream.first.wait(60) and stream.lines and "error" not in stream.lines[0], stream.lines[:1]
        answers: dict[str, httpx.Response] = {}
        for label, ids, expect in [
            ("vocab", [1, 2, 49152], "49152"),  # SmolLM2's vocabulary is ids 0..49151
            ("vocab-big", good_context + [10_000_000], "10000000"),
            ("negative", [1, -1], "context"),
            ("int32", [1, 2**31], "context"),
            ("u32-wrap", [1, 2**32 + 5], "context"),
            ("u64", [2**64 + 1], "context"),
        ]:
            for streamed in (False, True):
                r = h.post(
                    "/api/generate",
                    json={
                        "model": "smol",
                        "prompt": "and",
                        "context": ids,
                        "stream": streamed,
                        "options": {"num_predict": 4, "num_ctx": 512},
                    },
                )
                answers[f"{label}/{streamed}"] = r
                assert r.status_code == 400, (label, streamed, r.status_code, r.text)
                assert expect in r.json()["error"], (label, r.text)
        bad_done = time.monotonic()
        stream.join(180)
        assert stream.status == 200
        assert not any("error" in line for line in stream.lines), [x for x in stream.lines if "error" in x]
        assert stream.lines[-1].get("done") is True, stream.lines[-1]
        assert stream.ended > bad_done, "the stream ended before the bad requests: they did not overlap"
        after = h.post(
            "/api/generate",
            json={
                "model": "smol",
                "prompt": " and then",
                "context": good_context,
                "stream": False,
                "options": {"num_predict": 4, "num_ctx": 512},
            },
        )
        assert after.status_code == 200 and after.json()["done"] is True, after.text


# -- 12: option values -------------------------------------------------------------------------------------------

BAD_OPTIONS: list[tuple[str, Any]] = [
    ("mirostat", 7),
    ("mirostat", -1),
    ("mirostat_tau", math.nan),
    ("mirostat_eta", 0),
    ("repeat_penalty", 0),
    ("repeat_penalty", -1),
    ("num_thread", -1),
    ("temperature", math.inf),
    ("top_p", math.nan),
]
# the Modelfile text of each (PARAMETER <name> <text>)
BAD_PARAMETERS: list[tuple[str, str]] = [
    ("mirostat", "7"),
    ("mirostat_tau", "NaN"),
    ("mirostat_eta", "inf"),
    ("repeat_penalty", "0"),
    ("repeat_penalty", "-1"),
    ("num_thread", "-1"),
    ("temperature", "inf"),
]


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("tiny-options")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    try:
        with httpx.Client(base_url=d.url, timeout=120) as h:
            r = create(h, "tiny", write_tiny_gguf(tmp / "tiny.gguf").read_bytes())
            assert r.status_code == 200, r.text
        yield d
    finally:
        stop_daemon(d)


def test_bad_option_values_are_refused_naming_the_option(tiny_daemon: Daemon) -> None:
    d = tiny_daemon
    assert (os.cpu_count() or 1) * 4 < 1024
    accepted = []
    weights = write_tiny_gguf(d.models.parent / "t.gguf").read_bytes()
    with httpx.Client(base_url=d.url, timeout=120) as h:
        for name, value in BAD_OPTIONS:
            for path, body in [
                ("/api/generate", {"model": "tiny", "prompt": "a", "stream": False}),
                ("/api/chat", {"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "a"}]}),
            ]:
                r = post_json(h, path, {**body, "options": {name: value, "num_predict": 2}})
                if r.status_code != 400 or name not in r.json().get("error", ""):
                    accepted.append((path, name, value, r.status_code, r.text[:160]))
            r = create(h, "bad", weights, parameters={name: value})
            if r.status_code != 400 or name not in r.json().get("error", ""):
                accepted.append(("/api/create", name, value, r.status_code, r.text[:160]))
        assert not accepted, accepted
        err = post_json(h, "/api/generate", {"model": "tiny", "prompt": "a", "options": {"num_thread": -1}})
        assert "logical" in err.json()["error"], err.text  # what the machine has, the error says
        # in range, the same options work (the deprecated ones validated and ignored)
        ok = post_json(
            h,
            "/api/generate",
            {
                "model": "tiny",
                "prompt": "a",
                "stream": False,
                "options": {
                    "mirostat": 2,
                    "mirostat_tau": 5.0,
                    "mirostat_eta": 0.1,
                    "repeat_penalty": 1.2,
                    "num_thread": 2,
                    "temperature": 0.5,
                    "num_predict": 2,
                },
            },
        )
        assert ok.status_code == 200, ok.text


def test_bad_modelfile_parameters_are_refused_at_create(tiny_daemon: Daemon, tmp_path: Path) -> None:
    d = tiny_daemon
    write_tiny_gguf(tmp_path / "tiny.gguf")
    accepted = []
    for name, text in BAD_PARAMETERS:
        mf = tmp_path / "Modelfile"
        mf.write_text(f"FROM ./tiny.gguf\nPARAMETER {name} {text}\n")
        out = d.cli("create", "from-modelfile", "-f", str(mf))
        said = out.stdout + out.stderr
        if out.returncode == 0 or name not in said:
            accepted.append((name, text, out.returncode, said[-300:]))
    assert not accepted, accepted
    assert httpx.post(d.url + "/api/show", json={"model": "from-modelfile"}).status_code == 404


# -- 12: runner crashes and refused models -----------------------------------------------------------------------

NATIVE = (
    "llama_model_load",
    "Traceback",
    'File "',
    "Failed to load model from file",
    "print_info",
    "load_tensors",
    "llama_",
    "ggml_",
)


def clean(error: str) -> bool:
    return "/" not in error and "\\" not in error and not any(word in error for word in NATIVE)


@needs_smol
@pytest.mark.real_model
def test_runner_crash_tells_the_client_plainly_and_the_log_has_stderr(tmp_path: Path) -> None:
    assert SMOL is not None
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log")
    try:
        with httpx.Client(base_url=d.url, timeout=180) as h:
            assert create(h, "smol", SMOL.read_bytes()).status_code == 200
            stream = Stream(d, num_predict=400)
            stream.body["model"] = "smol"
            stream.start()
            assert stream.first.wait(90) and stream.lines and "error" not in stream.lines[0], stream.lines[:1]
            pids = runner_pids(d)
            assert len(pids) == 1
            os.kill(pids[0], signal.SIGSEGV)
            stream.join(60)
            errors = [line["error"] for line in stream.lines if "error" in line]
            assert len(errors) == 1, stream.lines[-3:]
            assert "killed by SIGSEGV" in errors[0] and "loaded again" in errors[0], errors[0]
            assert clean(errors[0]), errors[0]
            log = d.log.read_text()
            assert (
                f"runner pid={pids[0]}" in log
                and "stderr: " in log.split(f"runner pid={pids[0]}", 1)[1]
                and "llama_" in log.split(f"runner pid={pids[0]}", 1)[1]
            ), "the runner's stderr is not in the daemon log"
            again = h.post(
                "/api/generate",
                json={"model": "smol", "prompt": "Hi", "stream": False, "options": {"num_predict": 2, "num_ctx": 512}},
            )
            assert again.status_code == 200, again.text

            # models llama.cpp refuses to load: a clear message, the native text in the log only
            odd = write_gguf_with_architecture(tmp_path / "odd.gguf", "xyzzy").read_bytes()
            holey = write_gguf_missing_tensor(tmp_path / "holey.gguf").read_bytes()
            assert create(h, "odd", odd).status_code == 200
            assert create(h, "holey", holey).status_code == 200
            for name, known in [
                ("odd", "unknown model architecture: 'xyzzy'"),
                ("holey", "'blk.1.ffn_down.weight'"),
            ]:  # "missing tensor" or "not found"
                for streamed in (False, True):
                    r = h.post("/api/generate", json={"model": name, "prompt": "hi", "stream": streamed})
                    error = r.json()["error"]
                    assert r.status_code == 500, r.text
                    assert "llama.cpp could not load the model" in error, error
                    assert clean(error), error
                    assert known in error, error  # a known, path-free llama.cpp message is kept
            log = d.log.read_text()
            assert "error loading model" in log and "unknown model architecture" in log, log[-3000:]
            assert "Failed to load model from file" in log and "Traceback" in log  # the runner's stderr
    finally:
        stop_daemon(d)
