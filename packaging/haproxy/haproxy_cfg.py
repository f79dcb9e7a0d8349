#!/usr/bin/env python3
"""Write an HAProxy configuration for corral replicas (issue 30; docs/scale-out.md).

    python3 packaging/haproxy/haproxy_cfg.py corral-1=10.0.0.11:11434 corral-2=10.0.0.12:11434 > haproxy.cfg
    python3 packaging/haproxy/haproxy_cfg.py --bind 127.0.0.1:8080 --stats '' a=127.0.0.1:11441 b=127.0.0.1:11442

``packaging/haproxy/haproxy.cfg`` is this script's output for the compose file's three replicas (``--reference``;
a test keeps the two equal). Needs HAProxy 2.6 or newer (Debian 12's): ``balance hash`` on a sample expression,
``json_query`` on the buffered body and layer-7 retries are all built in, so no Lua or other hook is needed.

What the configuration does:

* **Affinity.** Requests are spread by consistent hashing on a session key, so that the turns of one conversation
  reach the replica that holds its prefix in its KV cache. The key is the ``X-Corral-Session`` header when the app
  sends one (any string: a conversation or user id); else it is taken from the JSON body: OpenAI's ``user``, then
  Anthropic's ``metadata.user_id``, then the conversation's first message (the first after a leading system
  message: conversations that share only a system prompt still spread out). A request without any of these (an
  ``/api/generate`` without the header, a GET) is spread round robin. Bodies larger than ``tune.bufsize`` are
  not looked into (the header still works).
* **Health.** Each replica is checked on ``GET /health/ready`` (open without an API key): a replica that starts,
  pulls or loads its preloads, or drains after SIGTERM answers 503 and gets no new requests; it is taken out after
  two failed checks and back after two good ones.
* **Fall-over.** A request that finds its replica down (connection refused or reset, no answer) or full (corral's
  ``503`` with ``Retry-After``) is retried up to three times, on another replica each time (``option redispatch
  1``); its conversation's later turns go back to its own replica once that one is up again.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

#: the compose file's replicas (packaging/compose/compose.yaml): name, address
REFERENCE_SERVERS = (("corral-1", "corral-1:11434"), ("corral-2", "corral-2:11434"), ("corral-3", "corral-3:11434"))
REFERENCE = Path(__file__).with_name("haproxy.cfg")

HEADER = "X-Corral-Session"


def render(
    servers: Sequence[tuple[str, str]],
    *,
    bind: str = "*:11434",
    stats: str = "*:8404",
    check_inter: str = "1s",
    log: str = "stdout format raw local0 info",
    bufsize: int = 262144,
    timeout_server: str = "10m",
) -> str:
    """The configuration text. ``servers``: (name, host:port) pairs; ``stats``: the address of HAProxy's own
    statistics page and Prometheus metrics (``/metrics``), empty for none; ``log``: HAProxy's ``log`` target,
    empty for none."""
    if not servers:
        raise ValueError("at least one replica is needed: name=host:port")
    for name, address in servers:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise ValueError(f"replica name {name!r}: use letters, digits, '.', '-' or '_'")
        if not re.fullmatch(r"\[?[A-Za-z0-9.:-]+\]?:[0-9]{1,5}", address):
            raise ValueError(f"replica {name}: {address!r} is not host:port")
    lines = [
        "# HAProxy in front of corral replicas (docs/scale-out.md). Written by packaging/haproxy/haproxy_cfg.py;",
        "# edit the script's options, not this file, so that the two stay the same.",
        "global",
        "    maxconn 2000",
        f"    tune.bufsize {bufsize}  # requests up to this size are hashed on their body and can be retried",
    ]
    if log:
        lines.append(f"    log {log}")
    lines += [
        "",
        "resolvers system  # names are looked up again while running (replicas that move, start late, scale)",
        "    parse-resolv-conf",
        "    hold valid 10s",
        "",
        "defaults",
        "    mode http",
        *(["    log global", "    option httplog", "    option dontlognull"] if log else []),
        "    timeout connect 5s",
        "    timeout client 10m",
        f"    timeout server {timeout_server}  # a model load or a long prompt may come before the first byte",
        "    timeout http-request 30s",
        "    timeout queue 60s",
        "    timeout check 5s",
        "",
        "frontend corral",
        f"    bind {bind}",
        "    option http-buffer-request  # the body is read before balancing: hashed on, and kept for retries",
        "    default_backend corral_replicas",
        "",
        "backend corral_replicas",
        f"    # affinity: the {HEADER} header, else a key from the JSON body, else round robin",
        f"    http-request set-var(txn.session) req.hdr({HEADER.lower()})",
        "    http-request set-var(txn.session) req.body,json_query('$.user') unless { var(txn.session) -m found }",
        "    http-request set-var(txn.session) req.body,json_query('$.metadata.user_id')"
        " unless { var(txn.session) -m found }",
        "    acl system_first req.body,json_query('$.messages[0].role') -m str system",
        "    http-request set-var(txn.session) req.body,json_query('$.messages[1].content')"
        " if system_first !{ var(txn.session) -m found }",
        "    http-request set-var(txn.session) req.body,json_query('$.messages[0].content')"
        " unless { var(txn.session) -m found }",
        "    balance hash var(txn.session)",
        "    hash-type consistent",
        "    # health: readiness is 503 while a replica starts, preloads or drains (SIGTERM)",
        "    option httpchk",
        "    http-check send meth GET uri /health/ready ver HTTP/1.1 hdr Host localhost",
        "    http-check expect status 200",
        f"    default-server check inter {check_inter} fastinter 250ms downinter {check_inter} fall 2 rise 2"
        " resolvers system init-addr last,libc,none",
        "    # fall-over: a replica down or full (503 + Retry-After) sends the request to another one",
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response response-timeout 503",
    ]
    lines += [f"    server {name} {address}" for name, address in servers]
    if stats:
        lines += [
            "",
            "frontend stats",
            f"    bind {stats}",
            "    http-request use-service prometheus-exporter if { path /metrics }",
            "    stats enable",
            "    stats uri /",
            "    stats refresh 5s",
        ]
    return "\n".join(lines) + "\n"


def reference() -> str:
    """The checked-in packaging/haproxy/haproxy.cfg: the compose file's three replicas."""
    return render(REFERENCE_SERVERS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("servers", nargs="*", metavar="NAME=HOST:PORT", help="the corral replicas")
    parser.add_argument("--bind", default="*:11434", help="where clients connect (default *:11434)")
    parser.add_argument("--stats", default="*:8404", help="HAProxy's statistics page and /metrics; '' for none")
    parser.add_argument("--check-inter", default="1s", help="time between readiness checks (default 1s)")
    parser.add_argument("--log", default="stdout format raw local0 info", help="HAProxy's log target; '' for none")
    parser.add_argument("--reference", action="store_true", help="write packaging/haproxy/haproxy.cfg")
    args = parser.parse_args(argv)
    if args.reference:
        REFERENCE.write_text(reference())
        return 0
    pairs = []
    for item in args.servers:
        name, sep, address = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: write replicas as NAME=HOST:PORT")
        pairs.append((name, address))
    try:
        text = render(pairs, bind=args.bind, stats=args.stats, check_inter=args.check_inter, log=args.log)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
