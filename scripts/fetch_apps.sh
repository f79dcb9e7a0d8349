#!/usr/bin/env bash
# Install the agent apps the tests point at corral (Codex CLI and Claude Code, pinned versions, from npm) into
# $CORRAL_TEST_CACHE/apps (default ~/.cache/corral-test/apps), outside the repo. Idempotent; needs node and npm
# (Debian's nodejs and npm packages; .ci/run installs them). Prints the folder holding the two commands.
set -euo pipefail
CODEX=0.171.0
CLAUDE=2.1.197
DIR="${CORRAL_TEST_CACHE:-$HOME/.cache/corral-test}/apps"
BIN="$DIR/node_modules/.bin"
have() { [ -x "$BIN/$1" ] && "$BIN/$1" --version 2>/dev/null | grep -q "$2"; }
if ! have codex "$CODEX" || ! have claude "$CLAUDE"; then
  mkdir -p "$DIR"
  [ -f "$DIR/package.json" ] || echo '{"private": true}' > "$DIR/package.json"
  npm install --prefix "$DIR" --no-audit --no-fund --loglevel=error \
    "@openai/codex@$CODEX" "@anthropic-ai/claude-code@$CLAUDE" >/dev/null
fi
echo "$BIN"
