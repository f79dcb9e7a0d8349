"""A draft model for a model (issue 28, speculative decoding), the daemon's side: ``PARAMETER draft_model`` checked
at create (the model exists, shares the vocabulary), shown by /api/show and ``corral show --modelfile``;
``options.draft_model`` per request; the draft resolved to its blob in the load spec with its GPU layers, counted in
the memory estimate, and listed by /api/ps and ``corral ps``."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from daemon.models.draft import Vocab, mismatch, vocab_of
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path, write_tiny_gguf

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")


# -- the vocabulary rule (llama.cpp's common_speculative_are_compatible) -----------------------------------------------
def _vocab(**kw: Any) -> Vocab:
    base: dict[str, Any] = dict(
        model="gpt2", add_bos=False, bos=1, add_eos=False, eos=2, tokens=tuple(f"t{i}" for i in range(300))
    )
    base.update(kw)
    return Vocab(**base)


def test_the_vocabulary_rule() -> None:
    same = _vocab()
    assert mismatch(same, _vocab()) is None
    assert "tokenizers differ" in str(mismatch(same, _vocab(model="llama")))
    # BOS: the flag always, the id only when BOS is added (likewise EOS)
    assert mismatch(same, _vocab(bos=7)) is None
    assert "BOS tokens differ" in str(mismatch(same, _vocab(add_bos=True)))
    assert "BOS tokens differ" in str(mismatch(_vocab(add_bos=True), _vocab(add_bos=True, bos=7)))
    assert "EOS tokens differ" in str(mismatch(_vocab(add_eos=True), _vocab(add_eos=True, eos=9)))
    # sizes at most 128 apart (padding), texts compared over the common part from id 5 on
    padded = same.tokens + tuple(f"<pad{i}>" for i in range(128))
    assert mismatch(same, _vocab(tokens=padded)) is None
    assert "differ in size (300 and 429 tokens" in str(mismatch(same, _vocab(tokens=padded + ("x",))))
    renumbered = ("<s>", "</s>", "<unk>", "<pad>", "<x>") + same.tokens[5:]
    assert mismatch(same, _vocab(tokens=renumbered)) is None
    changed = same.tokens[:42] + ("other",) + same.tokens[43:]
    assert "differ at token 42 ('t42' and 'other')" in str(mismatch(same, _vocab(tokens=changed)))


def test_vocab_of_reads_the_token_list_and_llama_cpps_defaults(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", n_vocab=300)
    v = vocab_of(str(tiny))
    assert v.model == "llama" and len(v.tokens) == 300
    assert (v.add_bos, v.add_eos) == (True, False)  # SentencePiece's defaults where the file says nothing
    other = write_tiny_gguf(tmp_path / "other.gguf", n_vocab=300, byte_fallback=False)
    assert "vocabularies differ at token" in str(mismatch(v, vocab_of(str(other))))


# -- the options to the runner, and the crash fallbacks ------------------------------------------------------------
def test_sample_params_carry_the_draft_options() -> None:
    from daemon.generation.inference import Inference
    from modelfile.params import DEFAULT_OPTIONS

    merged = {**DEFAULT_OPTIONS, "num_ctx": 512, "draft_max": 8, "draft_min": 2, "draft_p_min": 0.5, "draft_ngram": 3}
    p = Inference.sample_params(merged)
    assert (p.draft_max, p.draft_min, p.draft_p_min, p.draft_ngram) == (8, 2, 0.5, 3)
    p = Inference.sample_params({**DEFAULT_OPTIONS, "num_ctx": 512})
    assert (p.draft_max, p.draft_min, p.draft_p_min, p.draft_ngram) == (16, 0, 0.75, 0)  # llama-server's defaults


def test_a_crash_steps_the_draft_down_with_the_model() -> None:
    from daemon.runners.base import LoadSpec
    from daemon.scheduling.fallback import _Overrides, safer

    spec = LoadSpec(model_path="m", num_gpu=31, draft_num_gpu=31, extra_bufts=False)
    steps = []
    while (step := safer(spec)) is not None:
        spec = step[0]
        steps.append((spec.num_gpu, spec.draft_num_gpu))
    assert steps == [(15, 15), (7, 7), (3, 3), (1, 1), (0, 0)]
    # the model on the CPU already, its draft on the GPU: the draft comes off too
    step = safer(LoadSpec(model_path="m", num_gpu=0, draft_num_gpu=31, extra_bufts=False))
    assert step is not None and (step[0].num_gpu, step[0].draft_num_gpu, step[1]) == (0, 0, "no GPU layers")
    # a model remembered to run on the CPU only runs its draft there too
    remembered = _Overrides(max_gpu_layers=0).apply(LoadSpec(model_path="m", num_gpu=-1, draft_num_gpu=31))
    assert (remembered.num_gpu, remembered.draft_num_gpu) == (0, 0)


# -- a daemon with SmolLM2, a draft of it, and a tiny model of another vocabulary -----------------------------------
@dataclass
class Models:
    d: Daemon
    draft_file: Path


def _twin(src: Path, dst: Path) -> Path:
    """A copy of SmolLM2 with another general.name: another blob, the same weights and vocabulary (a stand-in for a
    quantized copy, which a Q4_1 file cannot be made into)."""
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        head = f.read(1 << 16)
        at = head.index(b"Smollm2 135M")
        f.seek(at)
        f.write(b"Draftlm2 135")
    return dst


def _create(d: Daemon, name: str, modelfile: str, tmp: Path) -> None:
    mf = tmp / f"{name}.Modelfile"
    mf.write_text(modelfile)
    made = d.cli("create", name, "-f", str(mf))
    assert made.returncode == 0, made.stdout + made.stderr


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    assert SMOL is not None
    tmp = tmp_path_factory.mktemp("draft")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_NUM_PARALLEL": "1"})
    try:
        draft_file = _twin(SMOL, tmp / "smol-draft.gguf")
        _create(d, "smol", f"FROM {SMOL}\nPARAMETER num_ctx 1024\n", tmp)
        _create(d, "smol-draft", f"FROM {draft_file}\n", tmp)
        _create(d, "tiny", f"FROM {write_tiny_gguf(tmp / 'tiny.gguf')}\n", tmp)
        _create(d, "smol-drafted", "FROM smol\nPARAMETER draft_model smol-draft\n", tmp)
        yield Models(d, draft_file)
    finally:
        stop_daemon(d)


def _post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=300)


def _generate(d: Daemon, model: str, **options: Any) -> httpx.Response:
    return _post(
        d,
        "/api/generate",
        {
            "model": model,
            "prompt": "Write a short poem about the sea.",
            "stream": False,
            "options": {"temperature": 0, "seed": 1, "num_predict": 24, **options},
        },
    )


@needs_smol
@pytest.mark.real_model
def test_create_with_a_draft_and_show_it(models: Models, tmp_path: Path) -> None:
    d = models.d
    shown = _post(d, "/api/show", {"model": "smol-drafted"}).json()
    assert "draft_model" in shown["parameters"] and "smol-draft" in shown["parameters"], shown["parameters"]
    mf = d.cli("show", "smol-drafted", "--modelfile")
    assert mf.returncode == 0 and "PARAMETER draft_model smol-draft" in mf.stdout, mf.stdout + mf.stderr
    # the model itself as its own draft is pointless but valid; "" means no draft
    for draft in ("smol", ""):
        r = _post(
            d, "/api/create", {"model": f"smol-self-{len(draft)}", "from": "smol", "parameters": {"draft_model": draft}}
        )
        assert r.status_code == 200 and '"success"' in r.text, r.text


@needs_smol
@pytest.mark.real_model
def test_create_refuses_an_unknown_draft_and_another_vocabulary(models: Models) -> None:
    d = models.d
    r = _post(
        d, "/api/create", {"model": "bad", "from": "smol", "parameters": {"draft_model": "nope"}, "stream": False}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "draft model 'nope' not found" in error and "pull it or create it first" in error, error
    r = _post(
        d, "/api/create", {"model": "bad", "from": "smol", "parameters": {"draft_model": "tiny"}, "stream": False}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "draft model 'tiny' cannot draft for 'bad'" in error and "tokenizers differ" in error, error
    assert "share its target's vocabulary" in error
    assert _post(d, "/api/show", {"model": "bad"}).status_code == 404  # nothing was written


@needs_smol
@pytest.mark.real_model
def test_a_request_draft_is_checked_before_a_runner_starts(models: Models) -> None:
    d = models.d
    r = _generate(d, "smol", draft_model="tiny")
    assert r.status_code == 400 and "draft model 'tiny' cannot draft for 'smol'" in r.json()["error"], r.text
    r = _generate(d, "smol", draft_model="nope")
    assert r.status_code == 400 and "draft model 'nope' not found" in r.json()["error"], r.text
    r = _post(
        d,
        "/v1/chat/completions",
        {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "draft_model": "tiny"},
    )
    assert r.status_code == 400 and "draft model 'tiny'" in r.text, r.text


@needs_smol
@pytest.mark.real_model
def test_a_draft_removed_or_replaced_after_create_is_checked_at_load(models: Models, tmp_path: Path) -> None:
    d = models.d
    _create(d, "later-draft", f"FROM {models.draft_file}\n", tmp_path)
    _create(d, "smol-later", "FROM smol\nPARAMETER draft_model later-draft\n", tmp_path)
    r = _generate(d, "smol-later", num_predict=1)  # run once: the daemon remembers the draft and its verdict
    assert r.status_code == 200, r.text
    # replaced by a model of another vocabulary
    _create(d, "later-draft", f"FROM {write_tiny_gguf(tmp_path / 'other.gguf', seed=3)}\n", tmp_path)
    r = _generate(d, "smol-later")
    assert r.status_code == 400, r.text
    assert "draft model 'later-draft' cannot draft for 'smol-later'" in r.json()["error"], r.text
    # removed
    assert httpx.request("DELETE", d.url + "/api/delete", json={"model": "later-draft"}, timeout=30).status_code == 200
    r = _generate(d, "smol-later")
    assert r.status_code == 400 and "draft model 'later-draft' not found" in r.json()["error"], r.text
    # the model runs without it when the request says so
    assert _generate(d, "smol-later", draft_model="", num_predict=2).status_code == 200


@needs_smol
@pytest.mark.real_model
def test_ps_lists_the_draft_with_the_model(models: Models) -> None:
    d = models.d
    plain = _generate(d, "smol")
    assert plain.status_code == 200, plain.text
    ps = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
    assert len(ps) == 1 and "draft_model" not in ps[0], ps
    alone = ps[0]["size"]

    drafted = _generate(d, "smol-drafted")
    assert drafted.status_code == 200, drafted.text
    assert drafted.json()["response"] == plain.json()["response"]  # speculation never changes greedy output
    # the engine drafts only where it pays (a draft as large as the model never does, but now and then it tries):
    # the counts are there, whatever they are (tests/runners/test_speculative.py forces drafts to check them)
    assert 0 <= drafted.json()["draft_n_accepted"] <= drafted.json()["draft_n"], drafted.text
    ps = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
    assert len(ps) == 1 and ps[0]["draft_model"] == "smol-draft:latest", ps
    # the draft's memory (as llama.cpp reported it loading both) is in the model's size: its weights and more
    assert ps[0]["size"] - alone > models.draft_file.stat().st_size, (ps[0]["size"], alone)
    listing = d.cli("ps")
    assert listing.returncode == 0 and "drafts with smol-draft" in listing.stdout, listing.stdout + listing.stderr

    # a request's draft_model overrides the model's: "" loads it without one
    again = _generate(d, "smol-drafted", draft_model="")
    assert again.status_code == 200 and again.json()["response"] == plain.json()["response"]
    ps = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
    assert len(ps) == 1 and "draft_model" not in ps[0], ps


@needs_smol
@pytest.mark.real_model
def test_the_scheduler_refuses_a_model_whose_draft_does_not_fit(tmp_path: Path) -> None:
    assert SMOL is not None
    # a RAM budget that holds SmolLM2 (about 250 MB estimated at num_ctx 1024) but not a second copy beside it
    d = start_daemon(
        tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_NUM_PARALLEL": "1", "CORRAL_RAM_BUDGET": "380MB"}
    )
    try:
        _create(d, "smol", f"FROM {SMOL}\nPARAMETER num_ctx 1024\n", tmp_path)
        _create(d, "smol-draft", f"FROM {_twin(SMOL, tmp_path / 'draft.gguf')}\n", tmp_path)
        r = _generate(d, "smol", draft_model="smol-draft", num_predict=2)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert "model 'smol:latest' with its draft model 'smol-draft:latest' needs" in error, error
        assert 'run it without its draft model (options.draft_model "")' in error, error
        assert httpx.get(d.url + "/api/ps", timeout=30).json()["models"] == []
        assert _generate(d, "smol", num_predict=2).status_code == 200  # alone, it fits
    finally:
        stop_daemon(d)


# -- the load spec and the memory estimate -----------------------------------------------------------------------------
def _inference(d: Daemon, parallel: int = 0, **kw: Any) -> Any:
    from daemon.generation.inference import Inference
    from daemon.models.catalog import Catalog
    from daemon.settings import Settings
    from registry.store import Store

    settings = Settings.from_env({"CORRAL_MODELS": str(d.models), "CORRAL_NUM_PARALLEL": str(parallel)})
    return Inference(Catalog(Store(d.models)), None, settings, default_num_ctx=1024, **kw)  # type: ignore[arg-type]


@needs_smol
@pytest.mark.real_model
def test_load_spec_carries_the_draft_and_the_estimate_counts_it(models: Models) -> None:
    from daemon.api.app import default_estimator
    from daemon.scheduling.memory import draft_header, draft_memory

    d = models.d
    inf = _inference(d, vram_budget=1 << 34, ram_budget=1 << 36)
    ctx = inf.model("smol-drafted")
    spec = inf.load_spec(ctx, inf.options(ctx, {}))
    draft_blob = inf.model("smol-draft").model_path
    assert spec.draft_path == str(draft_blob) and spec.draft_path != spec.model_path
    n_layer = ctx.info.block_count
    assert spec.num_gpu == spec.draft_num_gpu == n_layer + 1  # all of both fit: all on the GPU
    assert inf.draft_name(spec.draft_path) == "smol-draft:latest"

    # no GPU: none of the draft's layers either; an embedding runner never gets a draft
    cpu = _inference(d, ram_budget=1 << 36)
    spec_cpu = cpu.load_spec(ctx, cpu.options(ctx, {}))
    assert spec_cpu.draft_path == spec.draft_path and spec_cpu.draft_num_gpu == 0
    assert cpu.load_spec(ctx, cpu.options(ctx, {}), embedding=True).draft_path == ""
    # the request's option over the model's parameter
    assert cpu.load_spec(ctx, cpu.options(ctx, {"draft_model": ""})).draft_path == ""
    smol = cpu.model("smol")
    assert cpu.load_spec(smol, cpu.options(smol, {"draft_model": "smol-draft"})).draft_path == spec.draft_path

    # the scheduler's estimate: the target's and the draft's weights, KV cache and buffer
    estimate = default_estimator(inf.catalog)
    with_draft = estimate(ctx.ref, spec_cpu)
    without = estimate(ctx.ref, replace(spec_cpu, draft_path=""))
    ram, vram = draft_memory(
        draft_header(spec_cpu.draft_path),
        num_ctx=spec_cpu.num_ctx,
        num_parallel=spec_cpu.num_parallel,
        num_batch=spec_cpu.num_batch,
        n_gpu_layers=0,
        kv_type=spec_cpu.kv_cache_type,
    )
    assert (with_draft.ram - without.ram, with_draft.vram - without.vram) == (ram, vram)
    assert ram > draft_blob.stat().st_size  # its weights and more
    on_gpu = estimate(ctx.ref, spec)
    assert on_gpu.vram - estimate(ctx.ref, replace(spec, draft_path="")).vram > draft_blob.stat().st_size


@needs_smol
@pytest.mark.real_model
def test_the_draft_takes_its_share_of_the_budgets(models: Models) -> None:
    d = models.d
    probe = _inference(d, ram_budget=1 << 36)
    ctx = probe.model("smol-drafted")
    # a RAM budget that holds four slots of the model alone, but not with its draft beside it
    spec = probe.load_spec(ctx, probe.options(ctx, {"draft_model": ""}))
    assert spec.num_parallel == 4
    est = probe._estimate(ctx, spec.num_ctx, spec.num_batch, 4, 0, spec.kv_cache_type)
    tight = _inference(d, ram_budget=est.ram + (1 << 20))
    assert tight.load_spec(ctx, tight.options(ctx, {"draft_model": ""})).num_parallel == 4
    assert tight.load_spec(ctx, tight.options(ctx, {})).num_parallel < 4
    # VRAM: the target first, the draft gets what is left
    full = probe._estimate(ctx, spec.num_ctx, spec.num_batch, 1, ctx.info.block_count + 1, spec.kv_cache_type)
    gpu = _inference(d, parallel=1, ram_budget=1 << 36, vram_budget=full.vram + (1 << 20))
    s = gpu.load_spec(ctx, gpu.options(ctx, {}))
    assert s.num_gpu == ctx.info.block_count + 1 and 0 <= s.draft_num_gpu < s.num_gpu


@needs_smol
@pytest.mark.real_model
def test_a_modelfile_draft_line_says_what_to_use(models: Models, tmp_path: Path) -> None:
    d = models.d
    mf = tmp_path / "Modelfile"
    mf.write_text(f"FROM smol\nDRAFT {models.draft_file}\n")
    made = d.cli("create", "smol-draft-line", "-f", str(mf))
    assert made.returncode == 0, made.stderr
    assert "DRAFT (a draft model's files) is not supported" in made.stderr
    assert "PARAMETER draft_model NAME" in made.stderr
