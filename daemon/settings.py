"""corral's settings: read from the environment once, at startup, and passed down.

Nothing in corral reads ``os.environ`` at import time. Each variable means what its ``OLLAMA_*`` namesake means.
This module is light (no FastAPI, no llama_cpp) so the CLI can share it.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from errors import CorralError


class SettingsError(CorralError):
    """An environment variable has a value corral cannot use."""


DEFAULT_PORT = 11434

# name: (meaning, default shown in help)
ENV_DOCS: dict[str, tuple[str, str]] = {
    "CORRAL_HOST": ("address to listen on (and for the CLI, to connect to): [scheme://]host[:port]", "127.0.0.1:11434"),
    "CORRAL_MODELS": ("directory of the model store (Ollama's layout)", "<user data dir>/corral/models"),
    "CORRAL_KEEP_ALIVE": ("how long an idle model stays loaded: 5m, 1h30m, seconds; negative = forever", "5m"),
    "CORRAL_MAX_LOADED_MODELS": ("most models loaded at once; 0 = as many as fit the budgets", "0"),
    "CORRAL_NUM_PARALLEL": ("parallel requests per model; 0 = automatic", "0"),
    "CORRAL_MAX_QUEUE": ("most requests waiting for a model before 503 server busy", "512"),
    "CORRAL_ORIGINS": ("extra browser origins allowed, comma-separated (wildcards allowed)", ""),
    "CORRAL_NOPRUNE": ("do not prune unused blobs at startup", "false"),
    "CORRAL_DEBUG": ("log level: 0 info, 1 debug, 2 trace", "0"),
    "CORRAL_LOG_PROMPTS": ("log each request's prompt (off: prompts are private)", "false"),
    "CORRAL_API_KEY": ("require this key (Authorization: Bearer or x-api-key) on every request", ""),
    "CORRAL_API_KEY_FILE": ("read the API key from this file instead (first line)", ""),
    "CORRAL_REGISTRY_AUTH": (
        "registry credentials file (docker config.json format) for login, pull and push",
        "<user config dir>/corral/auth.json, then ~/.docker/config.json",
    ),
    "CORRAL_RAM_BUDGET": ("bytes of RAM loaded models may use, e.g. 8GiB", "free RAM less a reserve"),
    "CORRAL_VRAM_BUDGET": ("bytes of VRAM loaded models may use, e.g. 20GiB", "free VRAM less a reserve"),
    "CORRAL_CONTEXT_LENGTH": (
        "default num_ctx when neither the request nor the Modelfile sets one; 0 = automatic "
        "(4096, 32768 with 23 GiB of VRAM, 262144 with 47 GiB)",
        "0",
    ),
    "CORRAL_FLASH_ATTENTION": (
        "flash attention: true or false; unset = llama.cpp decides (on with a quantized KV cache)",
        "auto",
    ),
    "CORRAL_KV_CACHE_TYPE": (
        "KV cache type: f16, q8_0 (about half the memory) or q4_0 (about a quarter); "
        "quantized types need flash attention",
        "f16",
    ),
    "CORRAL_LOAD_TIMEOUT": (
        "a model load fails after this long without progress: 5m, 30s, seconds; 0 or negative = wait forever",
        "5m",
    ),
    "CORRAL_PRELOAD": ("models to load in the background at startup, comma-separated", ""),
    "CORRAL_PRELOAD_PULL": (
        "pull each CORRAL_PRELOAD model the store lacks from its registry, then load it (http:// names: plain HTTP)",
        "false",
    ),
    "CORRAL_INSTANCE": ("this replica's name in /api/info, /metrics, log lines and X-Corral-Instance", "the hostname"),
    "CORRAL_DRAIN_TIMEOUT": (
        "on SIGTERM, how long to wait for requests in flight (readiness false first); 0 = stop at once",
        "25s",
    ),
    "CORRAL_PULL_BANDWIDTH": ("most bytes per second all pulls together may download, e.g. 10MB; 0 = no limit", "0"),
    "CORRAL_KV_DISK": (
        "bytes of disk the prompt cache (KV state kept across unloads and restarts) may use, e.g. 10GB; 0 = off",
        "10% of the free space of its directory's disk, at most 64GiB",
    ),
    "CORRAL_KV_DISK_DIR": (
        "directory of the prompt cache on disk (never inside CORRAL_MODELS)",
        "<user cache dir>/corral/kv",
    ),
    "CORRAL_RPC_SERVERS": (
        "llama.cpp rpc-servers (host:port, comma-separated) that runners offload layers to, budgeted by the memory "
        "each reports; one that does not answer at load is left out (scripts/build-rpc.sh builds rpc-server)",
        "",
    ),
    "CORRAL_LLAMA_LIB_PATH": (
        "directory of RPC-enabled libllama/libggml for runners when llama-cpp-python has no RPC backend",
        "scripts/build-rpc.sh's ~/.cache/corral-rpc/<version>/lib",
    ),
}

KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")
MAX_CONTEXT_LENGTH = 1 << 24  # as the num_ctx option's range
GiB = 1 << 30
KV_DISK_SHARE = 0.10  # CORRAL_KV_DISK unset: this share of the free space of the cache directory's disk ...
KV_DISK_MAX_DEFAULT = 64 * GiB  # ... but at most this


@dataclass(frozen=True)
class Host:
    scheme: str
    host: str
    port: int
    path: str = ""

    @property
    def bind_host(self) -> str:
        return self.host or "0.0.0.0"

    @property
    def is_loopback(self) -> bool:
        h = self.host.strip("[]")
        if h == "localhost":
            return True
        try:
            return ipaddress.ip_address(h).is_loopback
        except ValueError:
            return False

    def url(self) -> str:
        """URL a client connects to (unspecified addresses become loopback)."""
        h = self.host
        if h in ("", "0.0.0.0"):
            h = "127.0.0.1"
        elif h in ("::", "[::]"):
            h = "[::1]"
        elif ":" in h and not h.startswith("["):
            h = f"[{h}]"
        return f"{self.scheme}://{h}:{self.port}{self.path}"

    def __str__(self) -> str:
        h = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{h}:{self.port}"


def parse_host(raw: str | None) -> Host:
    """Parse like OLLAMA_HOST: optional scheme, host, port (11434, or 80/443 by scheme), optional path."""
    s = (raw or "").strip().strip("\"'").strip()
    scheme, default_port = "http", DEFAULT_PORT
    if "://" in s:
        scheme, s = s.split("://", 1)
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise SettingsError(f'CORRAL_HOST has an unsupported scheme "{scheme}"; use http or https')
        default_port = 443 if scheme == "https" else 80
    path = ""
    if "/" in s:
        s, rest = s.split("/", 1)
        path = "/" + rest.rstrip("/") if rest.strip("/") else ""
    host, port_text = s, ""
    if s.startswith("["):
        end = s.find("]")
        if end < 0:
            raise SettingsError(f'CORRAL_HOST "{raw}" has an unclosed "["')
        host, port_text = s[1:end], s[end + 1 :].lstrip(":")
    elif s.count(":") == 1:
        host, port_text = s.split(":")
    elif s.count(":") > 1:
        host = s  # bare IPv6
    if not s and not raw:
        host = "127.0.0.1"
    elif not s:
        host = "127.0.0.1"
    port = default_port
    if port_text:
        try:
            p = int(port_text)
            if 0 <= p <= 65535:
                port = p
        except ValueError:
            pass
    return Host(scheme=scheme, host=host, port=port, path=path)


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


def parse_bytes(text: str, what: str = "size") -> int:
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else ""
    if not m or unit not in _UNITS:
        raise SettingsError(f'{what} "{text}" is not a size; use bytes or a unit, e.g. 8GiB, 512MB')
    return int(float(m.group(1)) * _UNITS[unit])


_DUR = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_DUR_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object, what: str = "keep_alive") -> float:
    """Seconds from a JSON number (seconds) or a Go duration string; negative -> math.inf."""
    if isinstance(value, bool):
        raise SettingsError(f'{what} must be a duration like "5m" or a number of seconds')
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        s = value.strip()
        sign = -1.0 if s.startswith("-") else 1.0
        body = s.lstrip("+-")
        if body == "0":
            seconds = 0.0
        else:
            pos, total = 0, 0.0
            for m in _DUR.finditer(body):
                if m.start() != pos:
                    break
                total += float(m.group(1)) * _DUR_UNITS[m.group(2)]
                pos = m.end()
            if not body or pos != len(body):
                raise SettingsError(
                    f'{what} "{value}" is not a duration; use a number of seconds or units like "5m", "1h30m", "10s"'
                )
            seconds = sign * total
    else:
        raise SettingsError(f'{what} must be a duration like "5m" or a number of seconds')
    if math.isnan(seconds):
        raise SettingsError(f"{what} must be a number")
    return math.inf if seconds < 0 else seconds


def parse_keep_alive_env(raw: str) -> float:
    """``CORRAL_KEEP_ALIVE`` as Ollama reads ``OLLAMA_KEEP_ALIVE``: a Go duration, or else a whole number of seconds
    ("-1" and "300" are what its docs and users write); negative -> forever; unset -> 5 minutes."""
    text = _unquote(raw)
    if not text:
        return 300.0
    if re.fullmatch(r"[+-]?[0-9]+", text):
        seconds = int(text)
        return math.inf if seconds < 0 else float(seconds)
    return parse_duration(text, "CORRAL_KEEP_ALIVE")


def _bool(value: str) -> bool:
    return value.strip().lower() in ("1", "t", "true", "yes", "on")


def _unquote(raw: str) -> str:
    """Trimmed of spaces and of surrounding quotes, as Ollama reads its variables."""
    return raw.strip().strip("\"'").strip()


def parse_load_timeout(raw: str) -> float:
    """``CORRAL_LOAD_TIMEOUT`` (as ``OLLAMA_LOAD_TIMEOUT``): a duration or seconds; unset = 5m; 0 or less = forever."""
    text = _unquote(raw)
    if not text:
        return 300.0
    try:
        seconds = float(text)  # a bare number is seconds
    except ValueError:
        seconds = parse_duration(text, "CORRAL_LOAD_TIMEOUT")
    if math.isnan(seconds):
        raise SettingsError("CORRAL_LOAD_TIMEOUT must be a duration like 5m or a number of seconds")
    return math.inf if seconds <= 0 else seconds


def parse_instance(raw: str) -> str:
    """CORRAL_INSTANCE: a name of letters, digits and ``.-_:`` (it goes into headers, log lines and metric labels);
    unset: the hostname."""
    if not raw:
        return socket.gethostname()
    if len(raw) > 128 or not re.fullmatch(r"[A-Za-z0-9._:-]+", raw):
        raise SettingsError(
            f"CORRAL_INSTANCE={raw!r} is not a usable replica name: use at most 128 letters, digits, '.', '-', '_' "
            "or ':' (e.g. the pod or host name)"
        )
    return raw


def parse_drain_timeout(raw: str) -> float:
    """CORRAL_DRAIN_TIMEOUT: a duration (25s, 1m) or seconds; 0 turns draining off."""
    text = _unquote(raw)
    if not text:
        return 25.0
    seconds = float(text) if re.fullmatch(r"[0-9]+(\.[0-9]*)?", text) else parse_duration(text, "CORRAL_DRAIN_TIMEOUT")
    if not math.isfinite(seconds) or seconds < 0:
        raise SettingsError(f"CORRAL_DRAIN_TIMEOUT={raw} must be a duration of 0 or more, e.g. 25s or 2m")
    return seconds


def parse_context_length(raw: str) -> int:
    """``CORRAL_CONTEXT_LENGTH``: a number of tokens; empty or 0 = automatic (see :func:`default_context_length`)."""
    s = _unquote(raw)
    if not s:
        return 0
    try:
        value = int(s)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_CONTEXT_LENGTH:
        raise SettingsError(
            f'CORRAL_CONTEXT_LENGTH="{raw}" is not valid; use a number of tokens from 1 to '
            f"{MAX_CONTEXT_LENGTH} (e.g. 8192), or 0 for automatic"
        )
    return value


def parse_flash_attention(raw: str) -> str:
    """``CORRAL_FLASH_ATTENTION`` -> "auto" (unset), "on" or "off". Ollama reads it as a Go boolean (where anything
    unparseable silently means true); here a typo is an error, since it changes how every model runs."""
    s = _unquote(raw).lower()
    if not s or s == "auto":
        return "auto"
    if s in ("1", "t", "true", "on", "yes"):
        return "on"
    if s in ("0", "f", "false", "off", "no"):
        return "off"
    raise SettingsError(
        f'CORRAL_FLASH_ATTENTION="{raw}" is not valid; use true (1) or false (0), '
        "or leave it unset to let llama.cpp decide"
    )


def parse_kv_cache_type(raw: str) -> str:
    """``CORRAL_KV_CACHE_TYPE``: f16 (the default), q8_0 or q4_0 for both K and V."""
    s = _unquote(raw).lower()
    if not s:
        return "f16"
    if s not in KV_CACHE_TYPES:
        raise SettingsError(f'CORRAL_KV_CACHE_TYPE="{raw}" is not valid; use one of {", ".join(KV_CACHE_TYPES)}')
    return s


def default_context_length(total_vram: int, configured: int = 0) -> int:
    """The num_ctx a model gets when neither the request nor its Modelfile sets one: ``CORRAL_CONTEXT_LENGTH``
    when set, else by the usable GPUs' total VRAM as newest Ollama (a big GPU holds a long context for little
    cost, a CPU or small GPU would spend its memory and prompt time on it). Always clamped to the model's trained
    context when loaded."""
    if configured > 0:
        return configured
    if total_vram >= 47 * GiB:
        return 262144
    if total_vram >= 23 * GiB:
        return 32768
    return 4096


def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    raw = environ.get(key, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f'{key}="{raw}" is not a whole number') from None
    if value < 0:
        raise SettingsError(f'{key}="{raw}" must not be negative')
    return value


def _key_file(path: str) -> str | None:
    if not path:
        return None
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as exc:
        raise SettingsError(f'CORRAL_API_KEY_FILE "{path}" cannot be read: {exc.strerror or exc}') from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise SettingsError(f'CORRAL_API_KEY_FILE "{path}" is empty; put the key on its first line')
    return key


def default_models_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("corral", appauthor=False)) / "models"


def default_kv_disk_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("corral", appauthor=False)) / "kv"


def _free_bytes(path: Path) -> int:
    """The free space of the filesystem ``path`` is (or would be created) on: its nearest existing ancestor's."""
    import shutil

    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def parse_kv_disk(raw: str, directory: Path) -> int:
    """``CORRAL_KV_DISK``: the prompt cache's bound in bytes (a size: ``10GB``, ``512MiB``, bytes); ``0`` turns it
    off; unset: :data:`KV_DISK_SHARE` of the free space of ``directory``'s filesystem now, at most
    :data:`KV_DISK_MAX_DEFAULT`."""
    s = _unquote(raw)
    if not s:
        return min(int(_free_bytes(directory) * KV_DISK_SHARE), KV_DISK_MAX_DEFAULT)
    try:
        return parse_bytes(s, "CORRAL_KV_DISK")
    except SettingsError:
        raise SettingsError(
            f'CORRAL_KV_DISK="{raw}" is not a size; use bytes or a unit, e.g. 10GB or 512MiB, or 0 to turn the '
            "prompt cache on disk off"
        ) from None


def _inside(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def parse_kv_disk_dir(raw: str, models: Path) -> Path:
    """``CORRAL_KV_DISK_DIR`` (unset: :func:`default_kv_disk_dir`), absolute. Refused inside the model store, and
    holding it (``corral prune`` removes what it does not recognise in the cache directory)."""
    s = _unquote(raw)
    directory = Path(s).expanduser() if s else default_kv_disk_dir()
    directory = Path(os.path.abspath(directory))
    real, store = directory.resolve(), Path(os.path.abspath(models)).resolve()
    if _inside(real, store):
        raise SettingsError(
            f'CORRAL_KV_DISK_DIR="{directory}" is inside the model store ({models}); the prompt cache must live '
            "elsewhere, e.g. unset CORRAL_KV_DISK_DIR for the user cache directory"
        )
    if _inside(store, real):
        raise SettingsError(
            f'CORRAL_KV_DISK_DIR="{directory}" holds the model store ({models}); give the prompt cache a directory '
            "of its own, e.g. unset CORRAL_KV_DISK_DIR for the user cache directory"
        )
    return directory


@dataclass(frozen=True)
class Settings:
    host: Host = field(default_factory=lambda: parse_host(None))
    models: Path = field(default_factory=default_models_dir)
    keep_alive: float = 300.0
    max_loaded_models: int = 0
    num_parallel: int = 0
    max_queue: int = 512
    origins: tuple[str, ...] = ()
    noprune: bool = False
    debug: int = 0
    api_key: str | None = field(default=None, repr=False)
    log_prompts: bool = False
    ram_budget: int | None = None
    vram_budget: int | None = None
    registry_auth: str = ""
    context_length: int = 0  # 0 = automatic by VRAM (default_context_length)
    flash_attention: str = "auto"  # "auto", "on" or "off"
    kv_cache_type: str = "f16"  # f16, q8_0 or q4_0
    load_timeout: float = 300.0  # seconds without load progress before a load fails; math.inf = forever
    preload: tuple[str, ...] = ()  # models loaded in the background at startup
    preload_pull: bool = False  # pull the preloads the store lacks first (CORRAL_PRELOAD_PULL)
    instance: str = field(default_factory=socket.gethostname)  # CORRAL_INSTANCE: this replica's name
    drain_timeout: float = 25.0  # CORRAL_DRAIN_TIMEOUT: SIGTERM waits this long for requests in flight
    pull_bandwidth: int = 0  # bytes per second across all pulls; 0 = no limit
    # the prompt cache on disk: its bound in bytes (0 = off) and its directory (None: none, so nothing is written or
    # pruned). A Settings built in code has neither; from_env gives a share of the free disk and the user cache dir
    kv_disk: int = 0
    kv_disk_dir: Path | None = None
    # one model over several hosts (issue 30): llama.cpp rpc-servers, and the RPC-enabled libraries for runners
    rpc_servers: tuple[str, ...] = ()
    llama_lib_path: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        def get(key: str) -> str:
            return environ.get(key, "").strip()

        models = get("CORRAL_MODELS")
        keep = get("CORRAL_KEEP_ALIVE")
        debug_raw = get("CORRAL_DEBUG")
        debug = 0
        if debug_raw:
            debug = int(debug_raw) if debug_raw.isdigit() else (1 if _bool(debug_raw) else 0)
        ram, vram = get("CORRAL_RAM_BUDGET"), get("CORRAL_VRAM_BUDGET")
        flash = parse_flash_attention(environ.get("CORRAL_FLASH_ATTENTION", ""))
        kv_type = parse_kv_cache_type(environ.get("CORRAL_KV_CACHE_TYPE", ""))
        if kv_type != "f16" and flash == "off":
            # llama.cpp cannot hold a quantized V cache without flash attention: refuse now, not at every load
            raise SettingsError(
                f"CORRAL_KV_CACHE_TYPE={kv_type} needs flash attention, but "
                f"CORRAL_FLASH_ATTENTION={get('CORRAL_FLASH_ATTENTION')} turns it off; unset "
                "CORRAL_FLASH_ATTENTION or use CORRAL_KV_CACHE_TYPE=f16"
            )
        models_dir = Path(models).expanduser() if models else default_models_dir()
        kv_dir = parse_kv_disk_dir(environ.get("CORRAL_KV_DISK_DIR", ""), models_dir)
        return cls(
            host=parse_host(get("CORRAL_HOST")),
            models=models_dir,
            keep_alive=parse_keep_alive_env(keep),
            max_loaded_models=_int(environ, "CORRAL_MAX_LOADED_MODELS", 0),
            num_parallel=_int(environ, "CORRAL_NUM_PARALLEL", 0),
            max_queue=_int(environ, "CORRAL_MAX_QUEUE", 512),
            origins=tuple(o.strip() for o in get("CORRAL_ORIGINS").split(",") if o.strip()),
            noprune=_bool(get("CORRAL_NOPRUNE")) if get("CORRAL_NOPRUNE") else False,
            debug=debug,
            api_key=get("CORRAL_API_KEY") or _key_file(get("CORRAL_API_KEY_FILE")),
            log_prompts=_bool(get("CORRAL_LOG_PROMPTS")),
            ram_budget=parse_bytes(ram, "CORRAL_RAM_BUDGET") if ram else None,
            vram_budget=parse_bytes(vram, "CORRAL_VRAM_BUDGET") if vram else None,
            registry_auth=get("CORRAL_REGISTRY_AUTH"),
            context_length=parse_context_length(environ.get("CORRAL_CONTEXT_LENGTH", "")),
            flash_attention=flash,
            kv_cache_type=kv_type,
            load_timeout=parse_load_timeout(get("CORRAL_LOAD_TIMEOUT")),
            preload=tuple(n.strip() for n in get("CORRAL_PRELOAD").split(",") if n.strip()),
            preload_pull=_bool(get("CORRAL_PRELOAD_PULL")),
            instance=parse_instance(get("CORRAL_INSTANCE")),
            drain_timeout=parse_drain_timeout(get("CORRAL_DRAIN_TIMEOUT")),
            pull_bandwidth=parse_bytes(get("CORRAL_PULL_BANDWIDTH"), "CORRAL_PULL_BANDWIDTH")
            if get("CORRAL_PULL_BANDWIDTH")
            else 0,
            kv_disk=parse_kv_disk(environ.get("CORRAL_KV_DISK", ""), kv_dir),
            kv_disk_dir=kv_dir,
            rpc_servers=parse_rpc_servers(environ.get("CORRAL_RPC_SERVERS", "")),
            llama_lib_path=get("CORRAL_LLAMA_LIB_PATH"),
        )


def parse_rpc_servers(raw: str) -> tuple[str, ...]:
    """``CORRAL_RPC_SERVERS``: host:port entries, comma-separated (daemon/rpc.py); a bad one stops the daemon with
    a message naming it."""
    from daemon.rpc import RpcSetupError, parse_servers

    try:
        return parse_servers(raw)
    except RpcSetupError as exc:
        raise SettingsError(str(exc)) from None


def env_help() -> str:
    lines = ["Environment variables:"]
    for key, (meaning, default) in ENV_DOCS.items():
        lines.append(f"  {key:<26} {meaning} (default: {default})")
    return "\n".join(lines)
