"""Many LoRA adapters on one loaded base (issue 29), the daemon's side: models that differ only by their ADAPTER
lines share ONE runner of their base (loaded without adapters, ``LoadSpec.adapters == ()``), each request carrying
its model's adapters (``GenerateRequest.adapters``); each adapter counted once in that runner's memory from the first
request that applies it, listed by /api/ps and ``corral ps``; a new model over a loaded base served without a reload;
deleting or replacing a model frees its adapter on the runner (``AdaptersOp``) unless another model still uses it,
while the other streams go on. Greedy output through the daemon is compared with in-process llama.cpp loaded with
that adapter alone (``llama_cpp.Llama(model_path=base, lora_path=adapter)``)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from daemon.runners.base import Event, GenerateRequest, LoadSpec, MemoryUse
from daemon.scheduling.eviction import Budget
from daemon.scheduling.scheduler import Adapter, InsufficientMemory, ModelRef, Scheduler
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.fakes import FakeRunner
from tests.models import smollm2_path, write_lora_gguf, write_tiny_gguf

GB = 10**9
SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")
# words of the tiny model's vocabulary (byte_fallback=False: every token a word, so any output is plain text)
PROMPT = "a bb c dd e ff g hh i"


# -- the scheduler: adapters counted once per runner, seen by its budget checks (fake runners) ----------------------
class AdapterRunner(FakeRunner):
    """A fake runner that loads the adapters its requests name and frees them when asked, once none is in use."""

    def __init__(self, spec: LoadSpec, memory: MemoryUse) -> None:
        super().__init__(spec, memory)
        self.loaded: list[str] = []
        self.in_use: dict[str, int] = {}
        self.asked: list[tuple[str, ...]] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Event]:
        paths = [p for p, _ in req.adapters]
        self.loaded += [p for p in paths if p not in self.loaded]
        for p in paths:
            self.in_use[p] = self.in_use.get(p, 0) + 1
        try:
            async for event in super().generate(req):
                yield event
        finally:
            for p in paths:
                self.in_use[p] -= 1

    async def drop_adapters(self, paths: tuple[str, ...]) -> tuple[str, ...]:
        self.asked.append(paths)
        self.loaded = [p for p in self.loaded if p not in paths or self.in_use.get(p, 0) > 0]
        return tuple(self.loaded)


def _scheduler(budget: int) -> Scheduler:
    FakeRunner.instances = []
    sizes = {"base": GB, "other": GB}
    return Scheduler(
        runner_factory=lambda ref, spec: AdapterRunner(spec, MemoryUse(sizes[ref.key], 0)),
        estimate=lambda ref, spec: MemoryUse(sizes[ref.key], 0),
        budget=lambda: Budget(budget, 0, 0),
    )


def _model(name: str, *adapters: tuple[str, int]) -> ModelRef:
    return ModelRef(
        key="base", name=name, adapters=tuple(Adapter(path=p, digest=p, memory=MemoryUse(n, 0)) for p, n in adapters)
    )


SPEC = LoadSpec(model_path="/base")


@pytest.mark.anyio
async def test_adapters_are_counted_once_per_runner_and_seen_by_the_budget() -> None:
    s = _scheduler(int(2.5 * GB))
    async with await s.acquire(ModelRef(key="other", name="other"), SPEC):
        pass
    async with await s.acquire(_model("base"), SPEC):
        pass
    assert len(FakeRunner.instances) == 2  # both fit: 2 GB of 2.5
    # a model over the base with a 0.4 GB adapter: the same runner, 0.4 GB more, still fits beside "other"
    async with await s.acquire(_model("ft-a", ("/a", GB * 4 // 10)), SPEC) as lease:
        assert lease.runner is FakeRunner.instances[1]
    base = next(item["entry"] for item in s.loaded() if item["entry"].ref.key == "base")
    assert base.memory.ram == GB + GB * 4 // 10
    # the same adapter by another model (a copy) is not counted again
    async with await s.acquire(_model("ft-a-copy", ("/a", GB * 4 // 10)), SPEC):
        pass
    assert base.memory.ram == GB + GB * 4 // 10 and set(base.adapters["/a"].models) == {"ft-a", "ft-a-copy"}
    # a second adapter that no longer fits beside the idle "other": "other" is evicted, the base is not reloaded
    async with await s.acquire(_model("ft-b", ("/b", GB * 3 // 10)), SPEC) as lease:
        assert lease.runner is FakeRunner.instances[1]
    assert [item["entry"].ref.key for item in s.loaded()] == ["base"] and FakeRunner.instances[0].closed
    assert base.memory.ram == GB + GB * 7 // 10
    # an adapter that cannot fit even alone with its base: refused, naming the adapters
    with pytest.raises(InsufficientMemory, match="with its 1 LoRA adapter"):
        await s.acquire(_model("ft-huge", ("/huge", 2 * GB)), SPEC)
    assert len(FakeRunner.instances) == 2 and "/huge" not in base.adapters
    await s.close()


@pytest.mark.anyio
async def test_dropping_an_adapter_frees_its_memory_once_no_sequence_uses_it() -> None:
    s = _scheduler(4 * GB)
    async with await s.acquire(_model("ft-a", ("/a", 100)), SPEC):
        pass
    lease = await s.acquire(_model("ft-b", ("/b", 50)), SPEC)
    runner = lease.runner
    assert isinstance(runner, AdapterRunner)
    stream = runner.generate(GenerateRequest(prompt="x y z", adapters=(("/b", 1.0),)))
    await stream.__anext__()  # "/b" is in use by a running sequence
    base = lease.entry
    assert base.memory.ram == GB + 150
    assert await s.drop_adapters(["/a", "/b", "/unknown"]) == ["/a", "/b"]
    assert runner.asked == [("/a", "/b")]
    assert base.memory.ram == GB + 50 and list(base.adapters) == ["/b"]  # "/a" freed; "/b" still in use
    async for _ in stream:
        pass
    lease.release()  # the runner is idle: the runner freed "/b" when its sequence ended
    assert base.memory.ram == GB and not base.adapters
    await s.close()


def test_an_adapters_memory_is_on_the_devices_of_the_layers_it_patches(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from daemon.generation.inference import Inference
    from daemon.settings import Settings

    blob = tmp_path / ("sha256-" + "c" * 64)
    blob.write_bytes(b"x" * 1000)
    ctx: Any = SimpleNamespace(adapters=(str(blob),), adapter_bytes=(1000,), info=SimpleNamespace(block_count=3))
    settings = Settings.from_env({"CORRAL_MODELS": str(tmp_path / "m")})

    def uses(vram_budget: int, num_gpu: int) -> tuple[Adapter, ...]:
        inf = Inference(None, None, settings, vram_budget=vram_budget)  # type: ignore[arg-type]
        return inf.adapter_uses(ctx, LoadSpec(model_path="/m", num_gpu=num_gpu), ((str(blob), 1.0),))

    (cpu,) = uses(0, 0)
    assert (cpu.digest, cpu.memory) == ("sha256:" + "c" * 64, MemoryUse(1000, 0))
    assert uses(8 * GB, 0)[0].memory == MemoryUse(1000, 0)  # no layer offloaded
    assert uses(8 * GB, 4)[0].memory == MemoryUse(0, 1000)  # every layer (3 blocks and the output) on the GPU
    assert uses(8 * GB, 2)[0].memory == MemoryUse(500, 500)  # half of them
    assert uses(8 * GB, 999)[0].memory == MemoryUse(0, 1000)


# -- a real daemon: a tiny random base and four adapters of it -------------------------------------------------------
@dataclass
class Tiny:
    d: Daemon
    base: Path
    adapters: list[Path]
    tmp: Path
    spare: list[Path] = field(default_factory=list)  # adapters no model uses yet


def _create(d: Daemon, name: str, modelfile: str, tmp: Path) -> None:
    mf = tmp / f"{name}.Modelfile"
    mf.write_text(modelfile)
    made = d.cli("create", name, "-f", str(mf))
    assert made.returncode == 0, made.stdout + made.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    tmp = tmp_path_factory.mktemp("lora-share")
    base = write_tiny_gguf(tmp / "base.gguf", context_length=2048, never_ends=True, byte_fallback=False)
    adapters = [write_lora_gguf(tmp / f"a{i}.gguf", base, seed=i + 1) for i in range(8)]
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_NUM_PARALLEL": "4"})
    try:
        _create(d, "base", f"FROM {base}\nPARAMETER num_ctx 512\n", tmp)
        for i in range(4):
            _create(d, f"ft{i}", f"FROM base\nADAPTER {adapters[i]}\n", tmp)
        yield Tiny(d, base, adapters[:4], tmp, adapters[4:])
    finally:
        stop_daemon(d)


_LLAMAS: dict[tuple[str, str | None, float], Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_llamas() -> Iterator[None]:
    """The in-process references are closed with the module (not left to the interpreter's exit)."""
    yield
    while _LLAMAS:
        _LLAMAS.popitem()[1].close()


def _llama(model: str, lora: str | None, scale: float = 1.0) -> Any:
    """Flash attention on, as the daemon's "auto" loads its runners here: the attention kernels round differently,
    which a random model's near-ties show after a few hundred tokens."""
    import llama_cpp

    key = (model, lora, scale)
    if key not in _LLAMAS:
        _LLAMAS[key] = llama_cpp.Llama(
            model_path=model,
            lora_path=lora,
            lora_scale=scale,
            n_ctx=512,
            n_threads=2,
            verbose=False,
            seed=0,
            flash_attn=True,
        )
    return _LLAMAS[key]


def reference(model: Path, adapter: Path | None, n: int, prompt: str = PROMPT, scale: float = 1.0) -> str:
    """In-process llama.cpp with this adapter alone (or none) at ``scale``: the greedy completion of ``prompt``."""
    llm = _llama(str(model), None if adapter is None else str(adapter), scale)
    out = llm.create_completion(prompt, max_tokens=n, temperature=0.0, repeat_penalty=1.0, top_k=1)
    return str(out["choices"][0]["text"])


def _generate(d: Daemon, model: str, n: int = 24, prompt: str = PROMPT, **options: Any) -> str:
    r = httpx.post(
        d.url + "/api/generate",
        json={
            "model": model,
            "prompt": prompt,
            "raw": True,
            "stream": False,
            "options": {"temperature": 0, "num_predict": n, "repeat_penalty": 1.0, "seed": 0, **options},
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["response"])


def _ps(d: Daemon) -> list[dict[str, Any]]:
    return list(httpx.get(d.url + "/api/ps", timeout=30).json()["models"])


def _runner_pids(d: Daemon) -> list[int]:
    """The daemon's runner processes (``python -m daemon.llama.runner`` children)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == d.proc.pid and b"daemon.llama.runner" in cmdline:
            pids.append(int(entry))
    return pids


def _digest(path: Path) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_four_adapter_models_share_one_runner_and_answer_as_each_adapter_alone(tiny: Tiny) -> None:
    d = tiny.d
    expected_base = reference(tiny.base, None, 24)
    expected = [reference(tiny.base, a, 24) for a in tiny.adapters]
    assert len({expected_base, *expected}) == 5, expected  # each adapter changes the answer
    assert _generate(d, "base") == expected_base  # the base without adapter, as before
    pids = _runner_pids(d)
    assert len(pids) == 1, pids
    for i in range(4):  # each new model over the loaded base: served at once by the same runner (no reload)
        assert _generate(d, f"ft{i}") == expected[i], f"ft{i}"
        assert _runner_pids(d) == pids
    ps = _ps(d)
    assert len(ps) == 1, ps
    (m,) = ps
    assert set(m["names"]) == {"base:latest", *(f"ft{i}:latest" for i in range(4))}
    assert [(a["digest"], a["model"]) for a in m["adapters"]] == [
        (_digest(a), f"ft{i}:latest") for i, a in enumerate(tiny.adapters)
    ]
    # each adapter counted once, its file size (on the CPU: RAM)
    assert [a["size"] for a in m["adapters"]] == [a.stat().st_size for a in tiny.adapters]
    listing = d.cli("ps")
    assert listing.returncode == 0, listing.stderr
    assert "4 LoRA adapters loaded" in listing.stdout and _digest(tiny.adapters[2])[7:19] in listing.stdout
    assert "for ft2:latest" in listing.stdout, listing.stdout
    # the base answers as before with adapters loaded beside it
    assert _generate(d, "base") == expected_base


@pytest.mark.slow
def test_the_four_models_at_once_in_mixed_batches(tiny: Tiny) -> None:
    d = tiny.d
    expected = {f"ft{i}": reference(tiny.base, a, 32) for i, a in enumerate(tiny.adapters)}
    expected["base"] = reference(tiny.base, None, 32)
    names = [*expected, *expected]  # ten requests, four slots: mixed batches of the five adapter sets
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda name: (name, _generate(d, name, 32)), names))
    assert got == [(name, expected[name]) for name in names]
    assert len(_ps(d)) == 1 and len(_runner_pids(d)) == 1


@pytest.mark.slow
def test_a_model_with_two_adapters_and_per_request_scales(tiny: Tiny) -> None:
    d, tmp = tiny.d, tiny.tmp
    a0, a1 = tiny.adapters[0], tiny.adapters[1]
    _create(d, "pair", f"FROM base\nADAPTER {a0}\nADAPTER {a1}\n", tmp)
    # llama-server's override (options.lora): a non-empty list sets every adapter's scale, the others are off
    assert _generate(d, "pair", lora=[{"id": 0, "scale": 1}]) == reference(tiny.base, a0, 24)
    assert _generate(d, "pair", lora=[{"id": 1, "scale": 1}]) == reference(tiny.base, a1, 24)
    assert _generate(d, "pair", lora=[{"id": 0, "scale": 0}]) == reference(tiny.base, None, 24)  # both off
    # a model's default scale (lora_scale), as llama.cpp's --lora-scaled
    assert _generate(d, "ft0", lora_scale=0.5) == reference(tiny.base, a0, 24, scale=0.5)
    r = httpx.post(
        d.url + "/api/generate",
        json={"model": "pair", "prompt": PROMPT, "stream": False, "options": {"lora": [{"id": 2, "scale": 1}]}},
        timeout=60,
    )
    assert r.status_code == 400 and "lora[0].id is 2" in r.json()["error"], r.text
    # the pair's adapters are the ones ft0 and ft1 loaded: one runner, each adapter still counted once
    (m,) = _ps(d)
    held = {a["digest"]: a["models"] for a in m["adapters"]}
    assert "pair:latest" in held[_digest(a0)] and "pair:latest" in held[_digest(a1)], held
    assert len(held) == len(m["adapters"])


def _stream(d: Daemon, model: str, n: int, started: threading.Event, out: dict[str, str]) -> None:
    body = {
        "model": model,
        "prompt": PROMPT,
        "raw": True,
        "options": {"temperature": 0, "num_predict": n, "repeat_penalty": 1.0, "seed": 0},
    }
    text = []
    with httpx.stream("POST", d.url + "/api/generate", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line:
                continue
            chunk = json.loads(line)
            assert "error" not in chunk, chunk
            text.append(chunk.get("response", ""))
            started.set()
    out[model] = "".join(text)


@pytest.mark.slow
def test_deleting_an_adapter_model_frees_it_while_the_others_stream(tiny: Tiny) -> None:
    d, tmp = tiny.d, tiny.tmp
    gone, kept = tiny.spare[0], tiny.spare[1]
    _create(d, "drop-a", f"FROM base\nADAPTER {gone}\n", tmp)
    assert httpx.post(d.url + "/api/copy", json={"source": "drop-a", "destination": "drop-a-copy"}).status_code == 200
    _create(d, "drop-b", f"FROM base\nADAPTER {kept}\n", tmp)
    assert _generate(d, "base", 4)
    before = _ps(d)[0]["size"]
    want_a, want_b = reference(tiny.base, gone, 8), reference(tiny.base, kept, 8)
    assert _generate(d, "drop-a", 8) == want_a
    assert _generate(d, "drop-a-copy", 8) == want_a
    assert _ps(d)[0]["size"] == before + gone.stat().st_size  # counted once for the two models that use it
    pids = _runner_pids(d)

    n = 256  # long enough to be streaming while the models are deleted
    expected = {f"ft{i}": reference(tiny.base, a, n) for i, a in enumerate(tiny.adapters[:3])}
    out: dict[str, str] = {}
    threads = []
    for model in expected:
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(d, model, n, started, out))
        t.start()
        assert started.wait(120), model
        threads.append(t)

    # deleting one of two models that use the adapter keeps it loaded
    assert httpx.request("DELETE", d.url + "/api/delete", json={"model": "drop-a"}, timeout=30).status_code == 200
    m = _ps(d)[0]
    assert _digest(gone) in [a["digest"] for a in m["adapters"]], m["adapters"]
    # deleting the last one frees it (the runner's AdaptersReply no longer lists it): out of /api/ps and its size
    assert httpx.request("DELETE", d.url + "/api/delete", json={"model": "drop-a-copy"}, timeout=30).status_code == 200
    m = _ps(d)[0]
    assert _digest(gone) not in [a["digest"] for a in m["adapters"]], m["adapters"]
    assert "adapter freed model=" in d.log.read_text()
    for t in threads:
        t.join(300)
    assert out == expected  # the other streams finished, each under its own adapter
    assert _runner_pids(d) == pids  # no reload

    # replacing a model by create frees the adapter it no longer uses; its new one loads on its first request
    assert _generate(d, "drop-b", 8) == want_b
    _create(d, "drop-b", f"FROM base\nADAPTER {gone}\n", tmp)
    digests = [a["digest"] for a in _ps(d)[0]["adapters"]]
    assert _digest(kept) not in digests and _digest(gone) not in digests, digests
    assert _generate(d, "drop-b", 8) == want_a
    assert _digest(gone) in [a["digest"] for a in _ps(d)[0]["adapters"]]
    assert _runner_pids(d) == pids


# -- SmolLM2 with a realistic adapter ----------------------------------------------------------------------------
@needs_smol
@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_with_an_adapter_answers_as_llama_cpp_with_it(tmp_path: Path) -> None:
    assert SMOL is not None
    lora = write_lora_gguf(tmp_path / "smol-lora.gguf", SMOL, seed=7, scale=0.3)
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_NUM_PARALLEL": "2"})
    try:
        _create(d, "smol", f"FROM {SMOL}\nPARAMETER num_ctx 512\n", tmp_path)
        _create(d, "smol-tuned", f"FROM smol\nADAPTER {lora}\n", tmp_path)
        prompt = "The three primary colours are"
        plain, tuned = reference(SMOL, None, 24, prompt), reference(SMOL, lora, 24, prompt)
        assert plain != tuned
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda m: _generate(d, m, 24, prompt), ["smol", "smol-tuned"]))
        assert got == [plain, tuned]
        assert len(_ps(d)) == 1 and len(_runner_pids(d)) == 1
    finally:
        stop_daemon(d)
