from __future__ import annotations

import pytest

from errors import InvalidDigest, InvalidModelName
from registry.digest import Digest
from registry.names import ModelName


@pytest.mark.parametrize(
    ("raw", "parts", "short"),
    [
        ("llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest"), "llama3.2:latest"),
        ("llama3.2:1b", ("registry.ollama.ai", "library", "llama3.2", "1b"), "llama3.2:1b"),
        ("jmorgan/mario", ("registry.ollama.ai", "jmorgan", "mario", "latest"), "jmorgan/mario:latest"),
        ("h/n/m:t", ("h", "n", "m", "t"), "h/n/m:t"),
        ("_why/_the/_lucky:_stiff", ("_why", "_the", "_lucky", "_stiff"), "_why/_the/_lucky:_stiff"),
        (
            "host:https/namespace/model:tag",
            ("host:https", "namespace", "model", "tag"),
            "host:https/namespace/model:tag",
        ),
        ("localhost:5000/ns/m", ("localhost:5000", "ns", "m", "latest"), "localhost:5000/ns/m:latest"),
        ("http://localhost:5000/ns/m:v1", ("localhost:5000", "ns", "m", "v1"), "localhost:5000/ns/m:v1"),
        ("REGISTRY.OLLAMA.AI/Library/M:T", ("REGISTRY.OLLAMA.AI", "Library", "M", "T"), "M:T"),
        ("hf.co/user/repo:Q4_K_M", ("hf.co", "user", "repo", "Q4_K_M"), "hf.co/user/repo:Q4_K_M"),
    ],
)
def test_valid_names(raw: str, parts: tuple[str, ...], short: str) -> None:
    name = ModelName.parse(raw)
    assert name.parts() == parts
    assert name.short() == short


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "../x",
        "..",
        "x/../y",
        "a/b/c/d:e",
        "a" * 300,
        "m\x00",
        "-hh/nn/mm:tt",
        "host/name:space/model:tag",
        "^",
        "mm:",
        "//",
        "@",
        "m@sha256:abc",
        "/ns/m",
        "h//m",
        "ns/",
        "a b",
        "m:t/x",
        "ftp://h/n/m",
        "h/n/" + "m" * 81,
        "h/" + "n" * 81 + "/m",
        "m:" + "t" * 81,
        "h/ns.dot/m",
        "..:x",
        "m/..",
        "./m",
    ],
)
def test_invalid_names(raw: str) -> None:
    with pytest.raises(InvalidModelName):
        ModelName.parse(raw)


def test_case_insensitive_identity() -> None:
    assert ModelName.parse("LLAMA3.2:LATEST").same_model(ModelName.parse("llama3.2"))


@pytest.mark.parametrize(
    "raw",
    [
        "sha256:" + "A" * 64,
        "sha256:" + "a" * 63,
        "sha512:" + "a" * 128,
        "sha256:../../etc/passwd",
        "sha256-" + "a" * 64,
        "sha256:" + "a" * 65,
        "",
        "sha256:" + "g" * 64,
    ],
)
def test_invalid_digests(raw: str) -> None:
    with pytest.raises(InvalidDigest):
        Digest.parse(raw)


def test_digest_forms() -> None:
    d = Digest.parse("sha256:" + "ab" * 32)
    assert d.filename == "sha256-" + "ab" * 32
    assert Digest.parse_param("sha256-" + "ab" * 32) == d
    with pytest.raises(InvalidDigest):
        Digest.parse_param("sha256:" + "AB" * 32)
    assert Digest.from_filename("sha256-tmp-x") is None
