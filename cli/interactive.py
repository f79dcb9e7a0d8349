"""The ``corral run`` REPL: chat with a model, with Ollama's slash commands.

:class:`Session` is the conversation's state; :class:`Repl` reads lines (``input()`` with readline history by
default; tests pass their own reader), runs commands, and sends messages with the whole history through
``/api/chat``. Ctrl-C while the model answers stops that answer; Ctrl-C at an empty prompt reminds how to
leave; Ctrl-D or ``/bye`` leaves. With a vision model, the image files a message names are attached to it.

A Ctrl-C at any moment after a line is typed (before the answer starts, while it streams, while it is printed
or put away, during a slash command) ends that turn only: the REPL goes back to its prompt, and the history keeps
no half of the turn. See :mod:`cli.chat` for how the answer itself is stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from cli.chat import Printer, chat_stream, extract_images
from cli.client import DaemonClient
from cli.output import table
from errors import CorralError, InvalidModelName, ModelNotFound, NotFound

PROMPT = ">>> "
CONTINUE = "... "
COMMON_PARAMETERS = [
    ("seed", "<int>", "Random number seed"),
    ("num_predict", "<int>", "Max number of tokens to predict"),
    ("top_k", "<int>", "Pick from top k num of tokens"),
    ("top_p", "<float>", "Pick token based on sum of probabilities"),
    ("min_p", "<float>", "Pick token based on top token probability * min_p"),
    ("num_ctx", "<int>", "Set the context size"),
    ("temperature", "<float>", "Set creativity level"),
    ("repeat_penalty", "<float>", "How strongly to penalize repetitions"),
    ("repeat_last_n", "<int>", "Set how far back to look for repetitions"),
    ("num_gpu", "<int>", "The number of layers to send to the GPU"),
    ("stop", "<string> <string> ...", "Set the stop parameters"),
]

HELP = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /list           List the models you have
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use \"\"\" to begin a multi-line message."""

HELP_SET = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set wordwrap          Enable wordwrap
  /set nowordwrap        Disable wordwrap
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think [level]     Enable thinking
  /set nothink           Disable thinking"""

HELP_SHOW = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template"""

HELP_SHORTCUTS = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor
  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit corral (/bye)"""


@dataclass
class Session:
    """One conversation: the model, the messages typed so far and the settings changed with /set."""

    model: str
    info: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    think: bool | str | None = None
    keep_alive: str | None = None
    wordwrap: bool = True
    verbose: bool = False
    hide_thinking: bool = False
    history: bool = field(default_factory=lambda: not nohistory_env())  # save the prompt history (/set nohistory)

    def chat_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": list(self.messages)}
        if self.format:
            body["format"] = self.format
        if self.options:
            body["options"] = dict(self.options)
        if self.think is not None:
            body["think"] = self.think
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        return body


def history_path() -> Path:
    from platformdirs import user_data_dir

    return Path(os.environ.get("CORRAL_HISTORY") or Path(user_data_dir("corral")) / "history")


def nohistory_env() -> bool:
    """``CORRAL_NOHISTORY`` (as ``OLLAMA_NOHISTORY``): start with history saving off."""
    return os.environ.get("CORRAL_NOHISTORY", "").strip().lower() in ("1", "t", "true", "yes", "on")


class LineInterrupted(KeyboardInterrupt):
    """Ctrl-C after a line was typed but before it was handed back (while the history was being saved): a turn
    stopped before it started, not a Ctrl-C at the prompt."""


def readline_reader(saving: Callable[[], bool] = lambda: True) -> Callable[[str], str]:
    """``input()`` with line editing and a persistent history when readline is available. ``saving()`` says
    whether the history file is written now (``/set nohistory`` and ``CORRAL_NOHISTORY`` turn it off: lines are
    still recalled with the arrow keys in this session, as in Ollama, but never reach the file)."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline
        return input
    path = history_path()
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def read(prompt: str) -> str:
        line = input(prompt)
        try:
            if saving():
                path.parent.mkdir(parents=True, exist_ok=True)
                readline.write_history_file(path)
        except OSError:
            pass
        except KeyboardInterrupt:
            raise LineInterrupted from None
        return line

    return read


@contextlib.contextmanager
def ctrl_c_interrupts() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the REPL even when corral was started with SIGINT ignored (a background
    job of a non-interactive shell, nohup): in a REPL Ctrl-C means "stop this answer", as in Ollama (Go's
    signal.Notify takes an ignored SIGINT back too). The handler in force before is put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class Repl:
    """The read-eval-print loop over one :class:`DaemonClient`."""

    def __init__(
        self,
        client: DaemonClient,
        session: Session,
        *,
        read: Callable[[str], str] | None = None,
        out: TextIO | None = None,
    ) -> None:
        self.client, self.session = client, session
        self.read = read or readline_reader(lambda: self.session.history)
        self.out = out or sys.stdout

    # -- output --------------------------------------------------------------------------------------------
    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def printer(self) -> Printer:
        s = self.session
        return Printer(out=self.out, wordwrap=s.wordwrap, hide_thinking=s.hide_thinking, verbose=s.verbose)

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> None:
        with ctrl_c_interrupts():
            self._run()

    def _run(self) -> None:
        self.preload()
        self.print_model_history()
        while True:
            try:
                self._loop()
                return
            except KeyboardInterrupt:
                # between two steps of the loop (a turn undoes its own half): back to the prompt
                with contextlib.suppress(KeyboardInterrupt):
                    self.say()

    def _loop(self) -> None:
        while True:
            try:
                line = self.read_message()
            except EOFError:
                self.say()
                return
            except LineInterrupted:
                self.say()
                continue
            except KeyboardInterrupt:
                self.say("\nUse Ctrl + d or /bye to exit.")
                continue
            if self.turn(line) == "exit":
                return

    def turn(self, line: str | None) -> str | None:
        """Run one typed line (a command or a message); "exit" to leave. A Ctrl-C anywhere in it ends the turn:
        the history is put back as it was before the turn (a command that replaces it, /load, keeps its own)."""
        history = self.session.messages
        kept = len(history)
        try:
            if line is None:
                return None
            if line.startswith("/") and not line.startswith("//"):
                return self.command(line)
            if line.strip():
                self.send(line)
            return None
        except KeyboardInterrupt:
            while True:  # a second Ctrl-C while putting things back does not leave them half done
                try:
                    del history[kept:]
                    self.say()
                    return None
                except KeyboardInterrupt:
                    continue

    def read_message(self) -> str | None:
        """One message: a line, or a ``\"\"\"`` block across lines (``None`` when there is nothing to do)."""
        line = self.read(PROMPT)
        stripped = line.strip()
        if not stripped.startswith('"""') and not stripped.startswith('/set system """'):
            return line
        opener = '/set system """' if stripped.startswith("/set system") else '"""'
        body = stripped[len(opener) :]
        if body.endswith('"""') and len(body) >= 3:
            return opener.removesuffix('"""') + body[:-3]
        parts = [body]
        while True:
            nxt = self.read(CONTINUE)
            if nxt.rstrip().endswith('"""'):
                parts.append(nxt.rstrip()[:-3])
                break
            parts.append(nxt)
        text = "\n".join(parts).strip("\n")
        return opener.removesuffix('"""') + text

    def preload(self) -> None:
        body: dict[str, Any] = {"model": self.session.model}
        if self.session.keep_alive is not None:
            body["keep_alive"] = self.session.keep_alive
        self.client.request("POST", "/api/generate", json_body={**body, "stream": False})

    def print_model_history(self) -> None:
        for m in self.session.info.get("messages") or []:
            if m.get("role") == "user":
                self.say(f">>> {m.get('content', '')}")
            elif m.get("role") == "assistant":
                self.say(str(m.get("content", "")))
                self.say()

    def send(self, text: str) -> None:
        s = self.session
        message: dict[str, Any] = {"role": "user", "content": text}
        if "vision" in (s.info.get("capabilities") or []):
            try:
                message["content"], images = extract_images(text, say=self.say)
            except CorralError as exc:
                self.say(f"Error: {exc}")
                return
            if images:
                message["images"] = images
        s.messages.append(message)
        try:
            answer = self.printer().stream(chat_stream(self.client, s.chat_body()), key="message")
        except CorralError as exc:
            s.messages.pop()
            self.say(f"Error: {exc}")
            return
        if answer.interrupted:  # the half answer is not kept, nor the question it did not answer
            s.messages.pop()
            return
        reply: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            reply["tool_calls"] = answer.tool_calls
        s.messages.append(reply)

    # -- slash commands ------------------------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        words = line.split()
        name = words[0].lower()
        if name in ("/bye", "/exit"):
            return "exit"
        if name in ("/?", "/help"):
            topic = words[1].lower() if len(words) > 1 else ""
            self.say(
                {"set": HELP_SET, "show": HELP_SHOW, "shortcut": HELP_SHORTCUTS, "shortcuts": HELP_SHORTCUTS}.get(
                    topic, HELP
                )
            )
        elif name == "/clear":
            self.session.messages = [m for m in self.session.messages if m["role"] == "system"]
            self.say("Cleared session context")
        elif name == "/list":
            from cli.commands.listing import HEADER, rows

            for row in table([HEADER, *rows(self.client.tags())]):
                self.say(row)
        elif name == "/load":
            self.load(words[1:])
        elif name == "/save":
            self.save(words[1:])
        elif name == "/set":
            self.set(line.split(None, 2)[1:] if len(words) > 1 else [])
        elif name == "/show":
            self.show(words[1:])
        else:
            self.say(f"Unknown command '{words[0]}'. Type /? for help")
        return None

    def load(self, args: list[str]) -> None:
        if len(args) != 1:
            self.say("Usage:\n  /load <modelname>")
            return
        try:
            info = self.client.show(args[0])
        except (ModelNotFound, NotFound, InvalidModelName):
            self.say(f"Couldn't find model '{args[0]}'")
            return
        self.say(f"Loading model '{args[0]}'")
        self.session.model, self.session.info, self.session.messages = args[0], info, []
        self.preload()
        self.print_model_history()

    def save(self, args: list[str]) -> None:
        if len(args) != 1:
            self.say("Usage:\n  /save <modelname>")
            return
        s = self.session
        body: dict[str, Any] = {"model": args[0], "from": s.model, "stream": False}
        if s.system is not None:
            body["system"] = s.system
        if s.options:
            body["parameters"] = dict(s.options)
        # the model's own MESSAGE history first (a "messages" field replaces it), then this session's turns
        history = [m for m in [*(s.info.get("messages") or []), *s.messages] if m.get("role") != "system"]
        if history:
            body["messages"] = [{"role": m["role"], "content": m["content"]} for m in history]
        try:
            self.client.request("POST", "/api/create", json_body=body)
        except InvalidModelName:
            self.say(f"error: The model name '{args[0]}' is invalid")
            return
        except CorralError as exc:
            self.say(f"error: {exc}")
            return
        self.say(f"Created new model '{args[0]}'")

    def set(self, args: list[str]) -> None:
        s = self.session
        if not args:
            self.say(HELP_SET)
            return
        what, rest = args[0].lower(), (args[1] if len(args) > 1 else "")
        toggles: dict[str, tuple[str, Any, str]] = {
            "history": ("history", True, "Set 'history' mode."),
            "nohistory": ("history", False, "Set 'nohistory' mode."),
            "wordwrap": ("wordwrap", True, "Set 'wordwrap' mode."),
            "nowordwrap": ("wordwrap", False, "Set 'nowordwrap' mode."),
            "verbose": ("verbose", True, "Set 'verbose' mode."),
            "quiet": ("verbose", False, "Set 'quiet' mode."),
            "noformat": ("format", None, "Disabled format."),
            "nothink": ("think", False, "Set 'nothink' mode."),
        }
        if what in toggles:
            attr, value, message = toggles[what]
            setattr(s, attr, value)
            self.say(message)
        elif what == "format":
            if rest.strip().lower() != "json":
                self.say("Invalid or missing format. For 'json' mode use '/set format json'")
                return
            s.format = "json"
            self.say("Set format to 'json' mode.")
        elif what == "think":
            level = rest.strip().lower() or "true"
            if level not in ("true", "high", "medium", "low", "max"):
                self.say(f'Invalid think level "{rest.strip()}": use true, high, medium, low or max')
                return
            if "thinking" not in (s.info.get("capabilities") or []):
                self.say(f"warning: model '{s.model}' does not support thinking output")
            s.think = True if level == "true" else level
            self.say("Set 'think' mode.")
        elif what == "system":
            self.set_system(rest)
        elif what == "parameter":
            self.set_parameter(rest.split())
        else:
            self.say(f"Unknown command '/set {args[0]}'. Type /? for help")

    def set_system(self, text: str) -> None:
        text = text.strip()
        if text.startswith('"') and text.endswith('"') and len(text) >= 2:
            text = text[1:-1]
        s = self.session
        s.system = text
        if s.messages and s.messages[-1]["role"] == "system":
            s.messages[-1] = {"role": "system", "content": text}
        else:
            s.messages.append({"role": "system", "content": text})
        self.say("Set system message.")

    def set_parameter(self, args: list[str]) -> None:
        from modelfile.params import coerce_parameter

        if len(args) < 2:
            self.say("Available Parameters:")
            for line in table([[f"  {n}", t, d] for n, t, d in COMMON_PARAMETERS]):
                self.say(line)
            return
        name, values = args[0], args[1:]
        try:
            if name == "stop":
                value: Any = [str(coerce_parameter("stop", v)) for v in values]
            else:
                value = coerce_parameter(name, " ".join(values))
        except CorralError as exc:
            self.say(f'Couldn\'t set parameter: "{exc}"')
            return
        self.session.options[name] = value
        self.say(f"Set parameter '{name}' to '{', '.join(values)}'")

    def show(self, args: list[str]) -> None:
        from cli.commands.show import summary

        if not args:
            self.say(HELP_SHOW)
            return
        what = args[0].lower()
        try:
            info = self.client.show(self.session.model)
        except CorralError as exc:
            self.say(f"error: {exc}")
            return
        s = self.session
        if what == "info":
            for line in summary(info):
                self.say(line)
        elif what == "license":
            self.say(str(info.get("license") or "No license was specified for this model."))
        elif what == "modelfile":
            self.say(str(info.get("modelfile") or ""))
        elif what == "parameters":
            self.say("Model defined parameters:")
            self.say(str(info.get("parameters") or "No additional parameters were specified for this model."))
            if s.options:
                self.say("User defined parameters:")
                for line in table([[k, str(v)] for k, v in s.options.items()]):
                    self.say(line)
        elif what == "system":
            self.say(s.system or str(info.get("system") or "No system message was specified for this model."))
        elif what == "template":
            self.say(str(info.get("template") or "No prompt template was specified for this model."))
        else:
            self.say(f"Unknown command '/show {args[0]}'. Type /? for help")
