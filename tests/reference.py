"""In-process llama-cpp-python references for tests, run in a child process so a native fault cannot kill pytest.

On CPUs where llama.cpp's extra buffer types crash (AMX on some Intel CPUs), the child dies by a signal; the
reference is then made again with them off, as corral's runner falls back (docs/runner-faults.md), so the two
still compute the same thing."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

_CHILD = r"""
import json, sys
import llama_cpp.llama_cpp as low
args = json.loads(sys.argv[1])
if not args["extra_bufts"]:
    original = low.llama_model_default_params
    def params():
        p = original()
        p.use_extra_bufts = False
        return p
    low.llama_model_default_params = params
from llama_cpp import Llama
llm = Llama(**args["llama"])
if args.get("completion") is not None:
    out = llm.create_completion(**args["completion"])
    sys.stdout.write("\nRESULT " + json.dumps(out) + "\n")
"""


def run_llama(
    llama: dict[str, Any],
    completion: dict[str, Any] | None = None,
    *,
    extra_bufts: bool | None = None,
    timeout: float = 300,
) -> tuple[dict[str, Any] | None, str]:
    """Build ``Llama(**llama)`` in a child (and run ``create_completion(**completion)``): (the completion, the
    child's stderr). ``extra_bufts`` None: on, then off if the child dies by a signal."""
    attempts = [True, False] if extra_bufts is None else [extra_bufts]
    for i, extra in enumerate(attempts):
        payload = json.dumps({"llama": llama, "completion": completion, "extra_bufts": extra})
        r = subprocess.run([sys.executable, "-c", _CHILD, payload], capture_output=True, text=True, timeout=timeout)
        if r.returncode < 0 and i + 1 < len(attempts):
            continue  # a native fault with extra buffer types on: the runner would fall back too
        assert r.returncode == 0, f"reference child failed ({r.returncode}): {r.stderr[-2000:]}"
        result = None
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        return result, r.stderr
    raise AssertionError("unreachable")


def completion_text(llama: dict[str, Any], completion: dict[str, Any], **kw: Any) -> str:
    out, _ = run_llama(llama, completion, **kw)
    assert out is not None
    return str(out["choices"][0]["text"])
