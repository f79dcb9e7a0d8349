"""``corral run`` (one-shot, piped, interactive REPL through a real pseudo-terminal), ``ps``, ``stop`` and
``info`` against a real daemon with SmolLM2 and the tiny fixture model."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from cli.chat import Printer, Wrapper, go_duration, stats_lines
from cli.client import DaemonClient
from cli.commands.ps import processor, rows, until
from cli.commands.run import think_value
from cli.interactive import Repl, Session
from errors import InvalidRequest
from tests.compat.conftest import THINK_TEMPLATE
from tests.conftest import REPO, Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path, write_tiny_gguf

SMOL = smollm2_path()
needs_smol = pytest.mark.skipif(SMOL is None, reason="SmolLM2 is not cached (run scripts/fetch_smollm2.py)")


# -- pure pieces ----------------------------------------------------------------------------------------------
def test_go_duration() -> None:
    assert go_duration(0) == "0s"
    assert go_duration(999) == "999ns"
    assert go_duration(1_500) == "1.5µs"
    assert go_duration(12_500_000) == "12.5ms"
    assert go_duration(1_234_567_891) == "1.234567891s"
    assert go_duration(2_000_000_000) == "2s"
    assert go_duration(62_500_000_000) == "1m2.5s"
    assert go_duration(3_723_000_000_000) == "1h2m3s"


def test_stats_lines() -> None:
    lines = stats_lines(
        {
            "total_duration": 2_000_000_000,
            "load_duration": 1_000_000,
            "prompt_eval_count": 10,
            "prompt_eval_duration": 500_000_000,
            "eval_count": 20,
            "eval_duration": 1_000_000_000,
        }
    )
    assert lines[0] == "total duration:       2s"
    assert "prompt eval rate:     20.00 tokens/s" in lines
    assert lines[-1] == "eval rate:            20.00 tokens/s"


def test_wrapper_breaks_at_words() -> None:
    buf = io.StringIO()
    w = Wrapper(buf, 10)
    for piece in ["The quick", " brown fox ", "jumps over", " the lazy dog\nend"]:
        w.write(piece)
    w.finish()
    lines = buf.getvalue().split("\n")
    assert all(len(line.rstrip()) <= 10 for line in lines)
    assert " ".join(buf.getvalue().split()) == "The quick brown fox jumps over the lazy dog end"


def test_processor_and_until() -> None:
    assert processor(100, 0) == "100% CPU"
    assert processor(100, 100) == "100% GPU"
    assert processor(100, 52) == "48%/52% CPU/GPU"
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert until((now + timedelta(minutes=4, seconds=30)).isoformat(), now) == "4 minutes from now"
    assert until((now - timedelta(seconds=1)).isoformat(), now) == "Stopping..."
    assert until("2318-01-01T00:00:00Z", now) == "Forever"
    row = rows(
        [
            {
                "name": "a:latest",
                "digest": "sha256:" + "ab" * 32,
                "size": 223_000_000,
                "size_vram": 0,
                "context_length": 1024,
                "expires_at": (now + timedelta(minutes=5)).isoformat(),
            }
        ],
        now=now,
    )[0]
    assert row == ("a:latest", "ab" * 6, "223 MB", "100% CPU", "1024", "5 minutes from now")


def test_think_values() -> None:
    assert think_value(None) is None
    assert think_value("true") is True and think_value("False") is False
    assert think_value("high") == "high"
    with pytest.raises(InvalidRequest, match='invalid value for --think: "x"'):
        think_value("x")


def test_printer_thinking_and_tool_calls() -> None:
    out, err = io.StringIO(), io.StringIO()
    chunks = iter(
        [
            {"message": {"thinking": "hmm"}, "done": False},
            {"message": {"content": "Hi"}, "done": False},
            {
                "message": {"content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                "done": False,
            },
            {"message": {"content": ""}, "done": True, "eval_count": 1, "eval_duration": 1_000_000},
        ]
    )
    ans = Printer(out=out, err=err, verbose=True).stream(chunks, key="message")
    text = out.getvalue()
    assert text.startswith("Thinking...\nhmm\n...done thinking.\n\nHi")
    assert "Model called a non-existent function 'f()' with arguments: {\"a\": 1}" in text
    assert ans.content == "Hi" and ans.thinking == "hmm" and "eval count:           1 token(s)" in err.getvalue()
    hidden = io.StringIO()
    Printer(out=hidden, err=io.StringIO(), hide_thinking=True).stream(
        iter([{"message": {"thinking": "secret"}}, {"message": {"content": "ok"}, "done": True}]), key="message"
    )
    assert "secret" not in hidden.getvalue() and "ok" in hidden.getvalue()


# -- against a real daemon ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon_with_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("run")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_HISTORY": str(tmp / "history")})
    tiny = write_tiny_gguf(tmp / "tiny.gguf", context_length=8192, never_ends=True)
    (tmp / "Tinyfile").write_text(
        f"FROM {tiny}\nPARAMETER num_ctx 8192\nPARAMETER num_predict 100000\n"
        "PARAMETER temperature 0\nPARAMETER repeat_penalty 1\n"
        'TEMPLATE "{{ .Prompt }}"\n'
    )
    assert d.cli("create", "tiny", "-f", str(tmp / "Tinyfile")).returncode == 0
    if SMOL is not None:
        (tmp / "Smolfile").write_text(
            f"FROM {SMOL}\nPARAMETER temperature 0\nPARAMETER num_ctx 1024\n"
            "PARAMETER num_predict 160\nSYSTEM Answer in one short sentence.\n"
            "MESSAGE user Hi!\nMESSAGE assistant Hello! How can I help?\n"
        )
        r = d.cli("create", "smol", "-f", str(tmp / "Smolfile"))
        assert r.returncode == 0, r.stderr
        (tmp / "Thinkfile").write_text(
            f"FROM {SMOL}\nPARAMETER temperature 0\nPARAMETER num_ctx 1024\nPARAMETER num_predict 24\n"
            'PARAMETER stop "<|im_end|>"\n'
            f'TEMPLATE """{THINK_TEMPLATE}"""\n'
        )
        r = d.cli("create", "smol-think", "-f", str(tmp / "Thinkfile"))
        assert r.returncode == 0, r.stderr
    try:
        yield d
    finally:
        stop_daemon(d)


def ok(r: object) -> object:
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"  # type: ignore[attr-defined]
    return r


@needs_smol
def test_run_prompt_matches_the_api_and_prints_stats(daemon_with_models: Daemon) -> None:
    d = daemon_with_models
    r = ok(d.cli("run", "smol", "What", "is", "the", "capital", "of", "France?", "--verbose"))
    api = httpx.post(
        d.url + "/api/generate",
        json={"model": "smol", "prompt": "What is the capital of France?", "stream": False},
        timeout=120,
    ).json()
    assert r.stdout.strip() == api["response"].strip() and "Paris" in r.stdout  # type: ignore[attr-defined]
    assert r.stdout.endswith("\n\n")  # type: ignore[attr-defined]
    for label in ("total duration:", "load duration:", "prompt eval count:", "eval count:", "eval rate:"):
        assert label in r.stderr  # type: ignore[attr-defined]


@needs_smol
def test_run_reads_piped_stdin_before_the_prompt(daemon_with_models: Daemon) -> None:
    d = daemon_with_models
    r = ok(d.cli("run", "smol", "Answer:", input="Name the largest planet in the solar system."))
    api = httpx.post(
        d.url + "/api/generate",
        json={"model": "smol", "prompt": "Name the largest planet in the solar system. Answer:", "stream": False},
        timeout=120,
    ).json()
    assert r.stdout.strip() == api["response"].strip()  # type: ignore[attr-defined]


@needs_smol
def test_run_format_json(daemon_with_models: Daemon) -> None:
    r = ok(
        daemon_with_models.cli(
            "run", "smol", "--format", "json", 'Give me a JSON object with two keys, "name" and "color", for a cat.'
        )
    )
    assert isinstance(json.loads(r.stdout), dict)  # type: ignore[attr-defined]
    bad = daemon_with_models.cli("run", "smol", "--format", "xml", "hi")
    assert bad.returncode == 1 and 'invalid format "xml"' in bad.stderr


@needs_smol
def test_run_shows_or_hides_thinking(daemon_with_models: Daemon) -> None:
    d = daemon_with_models
    api = httpx.post(
        d.url + "/api/generate",
        json={"model": "smol-think", "prompt": "What is 3+3?", "stream": False, "think": True},
        timeout=120,
    ).json()
    assert api["thinking"] and not api["response"]  # this model thinks and never closes its <think> unprompted
    shown = ok(d.cli("run", "smol-think", "What is 3+3?"))
    assert "Thinking..." in shown.stdout and api["thinking"].split()[0] in shown.stdout  # type: ignore[attr-defined]
    hidden = ok(d.cli("run", "smol-think", "--hidethinking", "What is 3+3?"))
    assert "Thinking..." not in hidden.stdout and api["thinking"].strip() not in hidden.stdout  # type: ignore[attr-defined]
    off = ok(d.cli("run", "smol-think", "--think=false", "What is 3+3?"))
    assert "Thinking..." not in off.stdout and off.stdout.strip()  # type: ignore[attr-defined]
    no = d.cli("run", "smol", "--think=true", "hi")
    assert no.returncode == 1 and "does not support thinking" in no.stderr


def test_run_errors(daemon_with_models: Daemon) -> None:
    d = daemon_with_models
    bad = d.cli("run", "tiny", "--think=maybe", "hi")
    assert bad.returncode == 1
    assert 'invalid value for --think: "maybe" (must be true, false, high, medium, low, or max)' in bad.stderr
    ka = d.cli("run", "tiny", "--keepalive", "soon", "hi")
    assert ka.returncode == 1 and "keep_alive" in ka.stderr


def test_ps_stop_and_info(daemon_with_models: Daemon) -> None:
    d = daemon_with_models
    httpx.post(d.url + "/api/generate", json={"model": "tiny", "keep_alive": "10m"}, timeout=60).raise_for_status()
    lines = ok(d.cli("ps")).stdout.splitlines()  # type: ignore[attr-defined]
    assert lines[0].split() == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    row = next(line for line in lines[1:] if line.startswith("tiny:latest"))
    assert "100% CPU" in row and "8192" in row and ("9 minutes from now" in row or "10 minutes from now" in row)
    assert "tiny" not in ok(d.cli("ps", "smol")).stdout  # type: ignore[attr-defined]
    ok(d.cli("stop", "tiny"))
    assert not any(line.startswith("tiny") for line in ok(d.cli("ps")).stdout.splitlines())  # type: ignore[attr-defined]
    missing = d.cli("stop", "nope")
    assert missing.returncode == 1 and 'couldn\'t find model "nope" to stop' in missing.stderr
    info = ok(d.cli("info")).stdout  # type: ignore[attr-defined]
    assert "physical cores" in info and "RAM budget" in info and "GPU offload" in info
    assert "hardware" in json.loads(ok(d.cli("info", "--json")).stdout)  # type: ignore[attr-defined]


def test_run_missing_model_is_a_clear_error(daemon_with_models: Daemon) -> None:
    r = daemon_with_models.cli("run", "no-such-model-here", "hi")
    assert r.returncode == 1 and "model 'no-such-model-here' is not here" in r.stderr


# -- the REPL, driven line by line ----------------------------------------------------------------------------
def scripted(lines: list[str]) -> object:
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


@needs_smol
def test_repl_commands_and_history(daemon_with_models: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    d = daemon_with_models
    sent: list[dict[str, object]] = []
    client = DaemonClient(d.url, timeout=None)
    real_stream = client.stream

    def spy(method: str, path: str, json: object = None) -> Iterator[dict[str, object]]:
        if path == "/api/chat":
            sent.append(json)  # type: ignore[arg-type]
        return real_stream(method, path, json)

    monkeypatch.setattr(client, "stream", spy)
    out = io.StringIO()
    session = Session(model="smol", info=client.show("smol"))
    Repl(
        client,
        session,
        read=scripted(
            [  # type: ignore[arg-type]
                "/?",
                "/set parameter seed 7",
                "/set parameter stop a b",
                "/set parameter bogus 1",
                "/set parameter temperature hot",
                "/set system You are a pirate.",
                "What is 2+2?",
                '"""Tell me',
                'a joke"""',
                "/show parameters",
                "/show system",
                "/show info",
                "/set format json",
                "/set noformat",
                "/set verbose",
                "/set quiet",
                "/frobnicate",
                "/load no-such-model",
                "/save bad name!",
                "/save smol-pirate",
                "/clear",
                "/bye",
                "never sent",
            ]
        ),
        out=out,
    ).run()
    text = out.getvalue()
    assert text.startswith(">>> Hi!\nHello! How can I help?\n")  # the model's MESSAGE history
    assert "Available Commands:" in text
    assert "Set parameter 'seed' to '7'" in text and "Set parameter 'stop' to 'a, b'" in text
    assert 'Couldn\'t set parameter: "unknown parameter "bogus"' in text
    assert "Couldn't set parameter" in text and "needs" in text  # temperature hot
    assert "Set system message." in text
    assert "User defined parameters:" in text and "You are a pirate." in text
    assert "Unknown command '/frobnicate'. Type /? for help" in text
    assert "Couldn't find model 'no-such-model'" in text
    assert "error: The model name 'bad' is invalid" in text or "Usage:" in text
    assert "Created new model 'smol-pirate'" in text and "Cleared session context" in text
    assert len(sent) == 2
    assert sent[0]["messages"] == [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert sent[0]["options"] == {"seed": 7, "stop": ["a", "b"]}
    second = sent[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]  # type: ignore[index]
    assert second[3]["content"] == "Tell me\na joke"  # type: ignore[index]
    saved = client.show("smol-pirate")
    assert saved["system"] == "You are a pirate." and "seed" in saved["parameters"]
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    client.close()


# -- the real terminal: `corral run MODEL` under a pseudo-terminal ---------------------------------------------
class Terminal:
    def __init__(self, d: Daemon, *args: str, sigint: Any = signal.SIG_DFL) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become `corral run`
            os.chdir(REPO)
            # what `corral run` is started with, whatever pytest was (a background job's SIGINT is ignored)
            signal.signal(signal.SIGINT, sigint)
            os.execvpe(sys.executable, [sys.executable, "-m", "cli", "run", *args], d.env)
        self.seen = b""

    def until(self, marker: bytes, timeout: float = 60) -> bytes:
        start = len(self.seen)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker in self.seen[start:]:
                return self.seen[start:]
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                self.seen += chunk
        raise AssertionError(f"did not see {marker!r}; got {self.seen[start:]!r}")

    def send(self, data: bytes) -> None:
        time.sleep(0.3)  # let readline finish drawing the prompt and wait for input (keys typed mid-redraw race)
        os.write(self.fd, data)

    def wait(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            try:
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.seen += os.read(self.fd, 4096)
            except OSError:
                time.sleep(0.1)
        os.kill(self.pid, 9)
        raise AssertionError(f"corral run did not exit; its terminal's last output: {self.seen[-600:]!r}")


@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "started-ignoring-sigint"])
def test_interactive_terminal_ctrl_c_and_ctrl_d(daemon_with_models: Daemon, sigint: Any) -> None:
    """Ctrl-C stops the answer, also when corral was started with SIGINT ignored (a background job of a
    non-interactive shell, nohup): the REPL takes it back, as Ollama's does."""
    term = Terminal(daemon_with_models, "tiny", sigint=sigint)
    term.until(b">>> ")
    term.send(b"go on forever\r")  # greedy, this tiny model never ends by itself
    term.until(b"go on forever\r\n")
    time.sleep(1.0)
    term.send(b"\x03")  # Ctrl-C stops this answer only
    after = term.until(b">>> ", timeout=30)
    assert b"Use Ctrl + d" not in after  # it was the answer that stopped, not a prompt that was interrupted
    ps = httpx.get(daemon_with_models.url + "/api/ps").json()["models"]
    assert any(m["name"] == "tiny:latest" for m in ps)  # still loaded, the REPL goes on
    term.send(b"\x03")  # at an empty prompt: a reminder
    term.until(b"Use Ctrl + d or /bye to exit.")
    term.send(b"/set parameter num_predict 5\r")
    term.until(b"Set parameter 'num_predict' to '5'")
    term.send(b"short\r")
    term.until(b">>> ")
    term.send(b"\x04")  # Ctrl-D leaves
    assert term.wait() == 0
