"""Jinja chat-template bombs built from ranges and other iterables (issue 25): every filter, method and operator
that builds a string or a list from an iterable is bounded *before* it builds, measured by the peak resident memory
of a real process rendering through :func:`daemon.templates.prompt.render_jinja` (the path the daemon takes).

Each template runs in a fresh child process that resets its kernel-kept peak (``/proc/self/clear_refs``) before
the render and reads ``VmHWM`` after it, so a value built and thrown away in one C call counts. The bound per template
is 75 MB: what the templates build before their last step is at most ~36 MB (a 16 MiB string and the steps to it),
and a last step refused before it builds adds nothing (the daemon's own bound, in
tests/daemon/test_hardening_prompts.py, is 200 MB). The issue's template grew the daemon by ~390 MB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BOUND_MB = 75

SEP = "{% set sep = 'x' * 4000 %}"
DICT = "{% set sep = 'x' * 20000 %}{% set d = {}.fromkeys(range(20000), 1) %}"  # joined: 400 MB
# a 16 MiB string of control characters, built by doubling (each step is within the bounds): its repr is 4x its
# size, its JSON 6x
CONTROL = "{% set ns = namespace(s='\\x01' * 16) %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
BOMBS = {
    # the template, exactly
    "join-range": "{% set sep = 'x' * 4000 %}{{ range(100000) | join(sep) | length }}",
    "join-range-printed": SEP + "{{ range(100000) | join(sep) }}",
    "join-reversed-range": SEP + "{{ range(100000) | reverse | join(sep) | length }}",
    "join-dict-keys": DICT + "{{ d.keys() | join(sep) | length }}",
    "join-dict-items": DICT + "{{ d.items() | join(sep) | length }}",
    "join-dict-values": DICT + "{{ d.values() | join(sep) | length }}",
    "join-method-range": SEP + "{{ sep.join(range(100000)) | length }}",
    "join-method-values": DICT + "{% set d = {}.fromkeys(range(20000), 'y') %}{{ sep.join(d.values()) | length }}",
    "join-of-lists": SEP + "{{ ([[1]] * 100000) | join(sep) | length }}",
    "string-of-control": CONTROL + "{{ [ns.s] | string | length }}",
    "tojson-of-control": CONTROL + "{{ [ns.s] | tojson | length }}",
    "tilde-of-control": CONTROL + "{{ ([ns.s] ~ '') | length }}",
    "print-of-control": CONTROL + "{{ [ns.s] }}",
    "percent-r": CONTROL + "{{ ('%r' % ns.s) | length }}",
    "format-r": CONTROL + "{{ '{!r}'.format(ns.s) | length }}",
}

CHILD = r"""
import json, sys
from daemon.chat.types import Message
from daemon.templates.prompt import TemplateError, render_jinja

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0

HI = [Message(role="user", content="hi")]
render_jinja("{{ messages[0].content | join(',') }}", HI)  # jinja imported, the environment built
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak, reset to the resident size now
base = status("VmRSS:")
try:
    result = "rendered " + str(len(render_jinja(sys.stdin.read(), HI)))
except TemplateError as e:
    result = str(e)
print(json.dumps({"grown_mb": (status("VmHWM:") - base) / 2**20, "result": result}))
"""


def render_in_child(template: str) -> tuple[float, str]:
    """(MB the peak resident size grew by, what rendering said) in a fresh process: a process's peak is only
    trustworthy for its first large allocation."""
    r = subprocess.run(
        [sys.executable, "-c", CHILD], input=template, capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    return float(row["grown_mb"]), str(row["result"])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("name", sorted(BOMBS))
def test_iterable_bombs_are_refused_before_they_build(name: str) -> None:
    grown, result = render_in_child(BOMBS[name])
    print(f"{name}: grown {grown:.0f} MB: {result}")
    assert result.startswith("chat template: "), result
    assert "larger than" in result or "MiB" in result, result  # a size bound said so, not some other failure
    assert grown < BOUND_MB, (grown, result)


def test_iterables_still_join_and_print_as_jinja_does() -> None:
    """The bounds change nothing for ordinary sizes: ranges, dict views and generators join, list and print as
    plain jinja2 renders them."""
    import jinja2.sandbox

    from daemon.chat.types import Message
    from daemon.templates.prompt import render_jinja

    plain = jinja2.sandbox.ImmutableSandboxedEnvironment()
    plain.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)  # as Hugging Face's (and corral's)
    wire = {"role": "user", "content": "a\x01'\"\\b"}
    for template in [
        "{{ range(5) | join(', ') }}",
        "{{ range(3) | reverse | join }}",
        "{% set d = {'a': 1, 'b': 2} %}{{ d.keys() | join('-') }}{{ d.values() | join }}{{ d.items() | join(';') }}",
        "{% set d = {'a': 1, 'b': 2} %}{{ '+'.join(d.keys()) }}{{ '+'.join(d) }}",
        "{{ ','.join(range(4) | map('string')) }}",
        "{{ range(3) | string }}{{ range(3) | list }}{{ range(3) | batch(2) | list }}",
        "{{ messages | map(attribute='content') | join('|') }}{{ [messages[0].content] }}",
        "{{ ('%r' % messages[0].content) }}{{ '{!r}'.format(messages[0].content) }}",
        "{{ messages[0].content | tojson }}{{ [messages[0].content] ~ '!' }}",
    ]:
        want = plain.from_string(template).render(messages=[wire])
        assert render_jinja(template, [Message.of(wire)], add_generation_prompt=False) == want, template
