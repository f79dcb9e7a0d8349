"""LoRA adapters at create and per request (issue 29), the API side: an ADAPTER that does not fit its base (another
architecture, tensors the base does not have or of other shapes) is a 400 at create; several ADAPTER lines make one
model; ``PARAMETER lora_scale`` gives each adapter's default scale; llama-server's ``lora`` field
(``[{"id": N, "scale": S}]``) on /v1/chat/completions, /v1/completions and /v1/responses and ``options.lora`` on
/api/generate and /api/chat is checked (an unknown id or a bad scale is a 400 naming it) and resolved into the
request's (adapter path, scale) pairs (``daemon.generation.lora``)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from daemon.generation import lora
from daemon.models.create import adapter_misfit
from modelfile import ParameterError, coerce_parameter, parse, validate_options
from registry.gguf import GGUFInfo, read_gguf_file
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path, write_lora_gguf, write_tiny_gguf

A, B, C = "/blobs/sha256-a", "/blobs/sha256-b", "/blobs/sha256-c"


# -- the option table: lora_scale (a model's defaults) and lora (a request's override) ---------------------------------
def test_lora_scale_is_one_parameter_line_per_adapter() -> None:
    mf = parse(
        "FROM base\nADAPTER a.gguf\nADAPTER b.gguf\nPARAMETER lora_scale 0.5\nPARAMETER lora_scale 0\n"
        "PARAMETER temperature 0.1\n"
    )
    assert mf.parameters == {"lora_scale": [0.5, 0.0], "temperature": 0.1}
    assert coerce_parameter("lora_scale", "-1.5") == -1.5
    with pytest.raises(ParameterError, match='parameter "lora_scale" needs a number'):
        coerce_parameter("lora_scale", "half")
    with pytest.raises(ParameterError, match="one PARAMETER lora_scale line per ADAPTER"):
        coerce_parameter("lora", '[{"id": 0, "scale": 1}]')


def test_lora_scale_from_json() -> None:
    assert validate_options({"lora_scale": [1, 0.25]}) == {"lora_scale": [1.0, 0.25]}
    assert validate_options({"lora_scale": 0.5}) == {"lora_scale": [0.5]}
    for bad in ("1", [1, "x"], [True], [math.inf], [1e39]):
        with pytest.raises(ParameterError, match='option "lora_scale" must be a number or an array of numbers'):
            validate_options({"lora_scale": bad})


def test_lora_option_shape() -> None:
    got = validate_options({"lora": [{"id": 1, "scale": 0.5}, {"id": 0, "scale": -1, "name": "ignored"}]})
    assert got == {"lora": [{"id": 1, "scale": 0.5}, {"id": 0, "scale": -1.0}]}
    assert validate_options({"lora": []}) == {"lora": []}
    # every other option still validates as before next to it
    assert validate_options({"lora": [], "stop": "x", "seed": 3}) == {"lora": [], "stop": ["x"], "seed": 3}
    cases = [
        ({"id": 0, "scale": 1}, 'option "lora": lora must be an array of objects'),
        (["x"], r"lora\[0\] must be an object"),
        ([{"scale": 1}], r"lora\[0\]\.id must be an adapter's index .* got nothing"),
        ([{"id": -1, "scale": 1}], r"lora\[0\]\.id must be .* got -1"),
        ([{"id": "0", "scale": 1}], r"lora\[0\]\.id must be"),
        ([{"id": True, "scale": 1}], r"lora\[0\]\.id must be"),
        ([{"id": 0}], r"lora\[0\]\.scale must be a finite number .* got nothing"),
        ([{"id": 0, "scale": "1"}], r"lora\[0\]\.scale must be a finite number"),
        ([{"id": 0, "scale": math.nan}], r"lora\[0\]\.scale must be a finite number"),
        ([{"id": 0, "scale": 1}, {"id": 0, "scale": 2}], r"lora\[1\]\.id 0 was already given in lora\[0\]"),
    ]
    for value, message in cases:
        with pytest.raises(ParameterError, match=message):
            validate_options({"lora": value})


# -- daemon.generation.lora: parse, defaults, resolve --------------------------------------------------------------
def test_parse_lora_checks_ids_against_the_model() -> None:
    assert lora.parse_lora(None, 2) is None
    assert lora.parse_lora([], 0) == {}
    assert lora.parse_lora([{"id": 1, "scale": 0.5}], 2) == {1: 0.5}
    with pytest.raises(ParameterError, match=r"lora\[0\]\.id is 2, but model 'm' has 2 LoRA adapters: ids 0 to 1"):
        lora.parse_lora([{"id": 2, "scale": 0.5}], 2, model="m")
    with pytest.raises(ParameterError, match=r"options\.lora\[0\]\.id is 0, but the model has no LoRA adapters"):
        lora.parse_lora([{"id": 0, "scale": 1}], 0, "options.lora")
    with pytest.raises(ParameterError, match=r"lora\[0\]\.scale must be a finite number") as info:
        lora.parse_lora([{"id": 0, "scale": "x"}], 1)
    assert info.value.name == "lora"


def test_default_scales() -> None:
    assert lora.default_scales((A, B, C), {}) == ((A, 1.0), (B, 1.0), (C, 1.0))
    assert lora.default_scales((A, B, C), {"lora_scale": [0.5, 0.0]}) == ((A, 0.5), (B, 0.0), (C, 1.0))
    with pytest.raises(ParameterError, match="lora_scale gives 2 scales, but model 'm' has 1 LoRA adapter;") as info:
        lora.default_scales((A,), {"lora_scale": [0.5, 1.0]}, model="m")
    assert info.value.name == "lora_scale"


def test_resolve_overrides_as_llama_server_does() -> None:
    defaults = ((A, 1.0), (B, 0.5), (C, 0.0))
    assert lora.resolve(defaults, None) == ((A, 1.0), (B, 0.5))  # scale 0 left out
    assert lora.resolve(defaults, {}) == ((A, 1.0), (B, 0.5))  # an empty list keeps the defaults
    # a non-empty list sets every scale: the adapters it does not name are off
    assert lora.resolve(defaults, {2: 0.25}) == ((C, 0.25),)
    assert lora.resolve(defaults, {1: 2.0, 0: -0.5}) == ((A, -0.5), (B, 2.0))  # ADAPTER order, whatever the list's
    assert lora.resolve(defaults, {0: 0.0}) == ()  # the base model alone
    assert lora.resolve((), None) == ()
    with pytest.raises(ValueError, match="out of range"):
        lora.resolve(defaults, {3: 1.0})


def test_request_adapters() -> None:
    opts = {"lora_scale": [0.5], "lora": [{"id": 1, "scale": 0.3}]}
    assert lora.request_adapters((A, B), opts) == ((B, 0.3),)
    assert lora.request_adapters((A, B), {"lora_scale": [0.5]}) == ((A, 0.5), (B, 1.0))
    assert lora.request_adapters((), {}) == ()
    with pytest.raises(ParameterError, match="has no LoRA adapters"):
        lora.request_adapters((), {"lora": [{"id": 0, "scale": 1.0}]}, model="plain")


# -- the create-time check, on headers (llama.cpp's llama_adapter_lora_init rules) -----------------------------------
def _adapter(path: Path, tensors: Mapping[str, tuple[int, ...]], **kv: str) -> GGUFInfo:
    """An adapter GGUF with zero tensors of these numpy shapes (ggml's order reversed), read back as a header."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), kv.pop("arch", "llama"))
    w.add_type(kv.pop("general_type", "adapter"))
    w.add_string("adapter.type", kv.pop("adapter_type", "lora"))
    for name, shape in tensors.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return read_gguf_file(path)


def test_adapter_misfit_rules(tmp_path: Path) -> None:
    base = read_gguf_file(write_tiny_gguf(tmp_path / "base.gguf"))  # n_embd 64, n_vocab 300
    q = "blk.0.attn_q.weight"
    good = {f"{q}.lora_a": (4, 64), f"{q}.lora_b": (64, 4), "blk.0.attn_norm.weight": (64,)}
    assert adapter_misfit(base, _adapter(tmp_path / "good.gguf", good)) == ""
    embd = {"token_embd.weight.lora_a": (300, 4), "token_embd.weight.lora_b": (64, 4)}  # A and B the other way
    assert adapter_misfit(base, _adapter(tmp_path / "embd.gguf", embd)) == ""
    cases = [
        (good, {"general_type": "model"}, 'it is not an adapter GGUF (its general.type is "model"'),
        (good, {"adapter_type": "control_vector"}, 'it is not a LoRA adapter (its adapter.type is "control_vector"'),
        ({f"{q}.lora_a": (4, 64)}, {}, f'its tensor pair for "{q}" has no {q}.lora_b'),
        ({**good, f"{q}.lora_c": (4, 64)}, {}, f'its tensor "{q}.lora_c" is neither'),
        (
            {f"{q}.lora_a": (64, 4), f"{q}.lora_b": (4, 64)},
            {},
            f'"{q}" is [64, 64] in the model, but its lora_a is [4, 64]',
        ),
        ({}, {}, "it has no LoRA tensors"),
    ]
    for i, (tensors, kv, message) in enumerate(cases):
        got = adapter_misfit(base, _adapter(tmp_path / f"bad{i}.gguf", cast(Mapping[str, Any], tensors), **kv))
        assert got.startswith(message), (message, got)


def test_adapter_misfit_agrees_with_llama_cpp(tmp_path: Path) -> None:
    """Each adapter the check passes loads in llama.cpp (llama_adapter_lora_init), each it refuses does not (but one
    without any LoRA tensor, which llama.cpp loads as a no-op and corral refuses as a mistake)."""
    import llama_cpp

    base_path = write_tiny_gguf(tmp_path / "base.gguf")
    base = read_gguf_file(base_path)
    q = "blk.0.attn_q.weight"
    pair = {f"{q}.lora_a": (4, 64), f"{q}.lora_b": (64, 4)}
    cases: list[tuple[Mapping[str, tuple[int, ...]], dict[str, str]]] = [
        ({**pair, "blk.0.attn_norm.weight": (64,)}, {}),
        ({"token_embd.weight.lora_a": (300, 4), "token_embd.weight.lora_b": (64, 4)}, {}),
        ({"token_embd.weight.lora_a": (4, 300), "token_embd.weight.lora_b": (64, 4)}, {}),
        ({f"{q}.lora_a": (4, 64)}, {}),
        ({**pair, f"{q}.lora_c": (4, 64)}, {}),
        ({f"{q}.lora_a": (64, 4), f"{q}.lora_b": (4, 64)}, {}),
        ({"blk.5.attn_q.weight.lora_a": (4, 64), "blk.5.attn_q.weight.lora_b": (64, 4)}, {}),
        (pair, {"arch": "qwen2"}),
        (pair, {"adapter_type": "control_vector"}),
    ]
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(base_path).encode(), llama_cpp.llama_model_default_params())
    assert model
    try:
        verdicts = []
        for i, (tensors, kv) in enumerate(cases):
            path = tmp_path / f"a{i}.gguf"
            ours = adapter_misfit(base, _adapter(path, tensors, **kv)) == ""
            adapter = llama_cpp.llama_adapter_lora_init(model, str(path).encode())
            if adapter:
                llama_cpp.llama_adapter_lora_free(adapter)
            verdicts.append((i, ours, bool(adapter)))
        assert all(ours == loads for _, ours, loads in verdicts), verdicts
        assert [ours for _, ours, _ in verdicts] == [True, True] + [False] * 7
    finally:
        llama_cpp.llama_model_free(model)


# -- a daemon with a tiny base model and adapters written for it (and for others) --------------------------------------
@dataclass
class Store:
    d: Daemon
    tmp: Path
    base: Path  # the tiny llama GGUF every good adapter is written for


def _create(s: Store, name: str, modelfile: str) -> subprocess.CompletedProcess[str]:
    mf = s.tmp / f"{name}.Modelfile"
    mf.write_text(modelfile)
    return s.d.cli("create", name, "-f", str(mf))


def _post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    tmp = tmp_path_factory.mktemp("lora")
    d = start_daemon(tmp / "models", tmp / "daemon.log")
    try:
        s = Store(d, tmp, write_tiny_gguf(tmp / "base.gguf"))
        made = _create(s, "base", f"FROM {s.base}\n")
        assert made.returncode == 0, made.stdout + made.stderr
        yield s
    finally:
        stop_daemon(d)


def test_several_adapters_make_one_model_with_their_scales(store: Store) -> None:
    a = write_lora_gguf(store.tmp / "a.gguf", store.base, seed=1)
    b = write_lora_gguf(store.tmp / "b.gguf", store.base, seed=2, targets=("attn_k", "ffn_up"))
    made = _create(store, "two", f"FROM base\nADAPTER {a}\nADAPTER {b}\nPARAMETER lora_scale 0.5\n")
    assert made.returncode == 0, made.stdout + made.stderr
    shown = _post(store.d, "/api/show", {"model": "two"}).json()
    assert shown["modelfile"].count("\nADAPTER ") == 2, shown["modelfile"]
    assert "PARAMETER lora_scale 0.5" in shown["modelfile"], shown["modelfile"]
    assert "lora_scale" in shown["parameters"], shown["parameters"]
    # the same file under two names is one adapter given twice
    twin = store.tmp / "a-again.gguf"
    shutil.copyfile(a, twin)
    made = _create(store, "twice", f"FROM base\nADAPTER {a}\nADAPTER {twin}\n")
    assert made.returncode != 0 and "is the same file as ADAPTER" in made.stderr, made.stdout + made.stderr
    # more scales than adapters; lora as a model parameter
    r = _post(store.d, "/api/create", {"model": "x", "from": "two", "parameters": {"lora_scale": [1, 1, 1]}})
    assert r.status_code == 400 and "lora_scale is given 3 times, but the model has 2 ADAPTERs" in r.text, r.text
    r = _post(store.d, "/api/create", {"model": "x", "from": "two", "parameters": {"lora": []}})
    assert r.status_code == 400 and 'parameter "lora" is a per-request option' in r.json()["error"], r.text
    # a model made FROM it with new adapters does not keep its scales (they were for its own adapters)
    made = _create(store, "one", f"FROM two\nADAPTER {b}\n")
    assert made.returncode == 0, made.stdout + made.stderr
    shown = _post(store.d, "/api/show", {"model": "one"}).json()
    assert shown["modelfile"].count("\nADAPTER ") == 1 and "lora_scale" not in shown["modelfile"], shown


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda s: write_lora_gguf(s.tmp / "qwen.gguf", s.base, architecture="qwen2"),
            'it was made for the architecture "qwen2", and the model is "llama"',
        ),
        (  # another model of the same architecture, of another width
            lambda s: write_lora_gguf(s.tmp / "narrow.gguf", write_tiny_gguf(s.tmp / "narrow-base.gguf", n_embd=32)),
            '"blk.0.attn_q.weight" is [64, 64] in the model, but its lora_a is [32, 4] and lora_b [4, 32]',
        ),
        (  # a deeper model: tensors this one does not have
            lambda s: write_lora_gguf(s.tmp / "deep.gguf", write_tiny_gguf(s.tmp / "deep-base.gguf", n_layer=3)),
            'it has tensors for "blk.2.attn_q.weight", which the model does not have',
        ),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_at_create(
    store: Store, make: Callable[[Store], Path], message: str
) -> None:
    adapter = make(store)
    made = _create(store, "misfit", f"FROM base\nADAPTER {adapter}\n")
    assert made.returncode != 0, made.stdout
    assert f'ADAPTER "{adapter.name}" does not fit the model: {message}' in made.stderr, made.stderr
    assert _post(store.d, "/api/show", {"model": "misfit"}).status_code == 404  # nothing was written


BAD_LORAS = [
    ({"id": 0, "scale": 1}, "lora must be an array of objects"),
    ([{"id": -1, "scale": 1}], "lora[0].id must be an adapter's index"),
    ([{"id": 0, "scale": "big"}], "lora[0].scale must be a finite number"),
    ([{"id": 0, "scale": 1}, {"id": 0, "scale": 1}], "lora[1].id 0 was already given in lora[0]"),
]


@pytest.mark.parametrize(("value", "message"), BAD_LORAS)
def test_a_bad_lora_is_refused_on_every_route(store: Store, value: Any, message: str) -> None:
    d = store.d
    user = [{"role": "user", "content": "hi"}]
    for path, body in (
        ("/v1/chat/completions", {"messages": user, "max_tokens": 2, "lora": value}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "lora": value}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "lora": value}),
    ):
        r = _post(d, path, {"model": "base", **body})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == "lora", (path, error)
    for path, body in (
        ("/api/generate", {"prompt": "hi", "stream": False}),
        ("/api/chat", {"messages": user, "stream": False}),
    ):
        r = _post(d, path, {"model": "base", **body, "options": {"num_predict": 2, "lora": value}})
        assert r.status_code == 400, (path, r.text)
        assert message in r.json()["error"], (path, r.text)


def test_lora_adapters_lists_a_models_adapters_by_digest(store: Store) -> None:
    a = write_lora_gguf(store.tmp / "la.gguf", store.base, seed=3)
    b = write_lora_gguf(store.tmp / "lb.gguf", store.base, seed=4)
    made = _create(store, "listed", f"FROM base\nADAPTER {a}\nADAPTER {b}\nPARAMETER lora_scale 0.25\n")
    assert made.returncode == 0, made.stdout + made.stderr
    r = httpx.get(store.d.url + "/lora-adapters", params={"model": "listed"})
    assert r.status_code == 200, r.text
    digests = [layer["digest"] for layer in _manifest_layers(store, "listed") if layer["mediaType"].endswith("adapter")]
    assert r.json() == [{"id": 0, "path": digests[0], "scale": 0.25}, {"id": 1, "path": digests[1], "scale": 1.0}]
    assert "/" not in r.text  # no path of this machine
    assert httpx.get(store.d.url + "/lora-adapters", params={"model": "base"}).json() == []
    r = httpx.get(store.d.url + "/lora-adapters")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = httpx.get(store.d.url + "/lora-adapters", params={"model": "nope"})
    assert r.status_code == 404, r.text
    r = httpx.post(store.d.url + "/lora-adapters", json=[{"id": 0, "scale": 0.5}])
    assert r.status_code == 400 and '"lora": [{"id": N, "scale": S}]' in r.json()["error"]["message"], r.text


def _manifest_layers(store: Store, name: str) -> list[dict[str, Any]]:
    path = store.d.models / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    layers: list[dict[str, Any]] = json.loads(path.read_text())["layers"]
    return layers


def test_a_model_without_adapters_refuses_lora_ids(store: Store) -> None:
    d = store.d
    r = _post(
        d,
        "/api/generate",
        {
            "model": "base",
            "prompt": "hi",
            "stream": False,
            "options": {"num_predict": 2, "lora": [{"id": 0, "scale": 1}]},
        },
    )
    assert r.status_code == 400 and "lora[0].id is 0, but model 'base' has no LoRA adapters" in r.json()["error"], (
        r.text
    )
    r = _post(d, "/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 2, "lora": [{"id": 0, "scale": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
    # an empty list asks for nothing: fine
    r = _post(d, "/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 2, "lora": []})
    assert r.status_code == 200, r.text


# -- SmolLM2 with a real adapter: the scales reach llama.cpp ----------------------------------------------------------
SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    assert SMOL is not None
    tmp = tmp_path_factory.mktemp("lora-smol")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_NUM_PARALLEL": "2"})
    try:
        s = Store(d, tmp, SMOL)
        adapter = write_lora_gguf(tmp / "smol-a.gguf", SMOL, seed=7)
        for name, text in (
            ("smol", f"FROM {SMOL}\nPARAMETER num_ctx 512\n"),
            ("smol-a", f"FROM smol\nADAPTER {adapter}\nPARAMETER lora_scale 0.3\n"),
        ):
            made = _create(s, name, text)
            assert made.returncode == 0, made.stdout + made.stderr
        yield s
    finally:
        stop_daemon(d)


def _greedy(d: Daemon, model: str, lora_value: Any = None) -> str:
    options: dict[str, Any] = {"temperature": 0, "seed": 1, "num_predict": 16}
    if lora_value is not None:
        options["lora"] = lora_value
    r = _post(
        d, "/api/generate", {"model": model, "prompt": "Name three colours.", "stream": False, "options": options}
    )
    assert r.status_code == 200, r.text
    text: str = r.json()["response"]
    return text


@needs_smol
@pytest.mark.real_model
@pytest.mark.slow
def test_per_request_scales_reach_the_runner(smol: Store) -> None:
    d = smol.d
    base = _greedy(d, "smol")
    adapted = _greedy(d, "smol-a")  # lora_scale 0.3
    assert adapted != base, "the adapter at its default scale changes nothing"
    assert _greedy(d, "smol-a", [{"id": 0, "scale": 0}]) == base  # scale 0: the base model alone
    assert _greedy(d, "smol-a", []) == adapted  # an empty list keeps the model's scales
    stronger = _greedy(d, "smol-a", [{"id": 0, "scale": 1.0}])
    assert stronger not in (base, adapted)
    # the same on /v1, with llama-server's top-level lora
    chat = {"model": "smol-a", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16}
    chat |= {"temperature": 0, "seed": 1}
    off = _post(d, "/v1/chat/completions", {**chat, "lora": [{"id": 0, "scale": 0}]})
    plain = _post(d, "/v1/chat/completions", {**chat, "model": "smol"})
    assert off.status_code == plain.status_code == 200, off.text + plain.text
    assert off.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    r = _post(d, "/v1/chat/completions", {**chat, "lora": [{"id": 1, "scale": 1}]})
    assert r.status_code == 400 and "lora[0].id is 1, but model 'smol-a' has 1 LoRA adapter: ids 0 to 0" in r.text, (
        r.text
    )
