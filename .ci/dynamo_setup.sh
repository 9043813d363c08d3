#!/usr/bin/env bash
# Install Dynamo's own programs (the PyPI wheel ai-dynamo-runtime: python -m dynamo.indexer,
# python -m dynamo.select_service) in their own venv, for tests/e2e/test_dynamo_interop.py.
#
#   DYNAMO_VENV     venv to create or reuse   (default $HOME/.cache/kvindex-dynamo-venv)
#   DYNAMO_VERSION  the wheel's version       (default 1.6.1, the newest on PyPI when written)
#
# Reused when already complete, so a rerun on the same machine takes a second; a fresh one needs
# about 20 s (one ~60 MB wheel). Prints the path as a shell assignment on its last line.
set -euo pipefail

DYNAMO_VENV=${DYNAMO_VENV:-$HOME/.cache/kvindex-dynamo-venv}
DYNAMO_VERSION=${DYNAMO_VERSION:-1.6.1}

have_dynamo() {
  [ -x "$DYNAMO_VENV/bin/python" ] &&
    [ "$("$DYNAMO_VENV/bin/python" -m pip show ai-dynamo-runtime 2>/dev/null | sed -n 's/^Version: //p')" = "$DYNAMO_VERSION" ] &&
    "$DYNAMO_VENV/bin/python" -c 'import dynamo.llm' >/dev/null 2>&1
}

if have_dynamo; then
  echo "dynamo-setup: reusing $DYNAMO_VENV (ai-dynamo-runtime $DYNAMO_VERSION)" >&2
else
  echo "dynamo-setup: installing ai-dynamo-runtime $DYNAMO_VERSION into $DYNAMO_VENV" >&2
  rm -rf "$DYNAMO_VENV"
  mkdir -p "$(dirname "$DYNAMO_VENV")"
  python3 -m venv "$DYNAMO_VENV"
  "$DYNAMO_VENV/bin/python" -m pip install --quiet "ai-dynamo-runtime==$DYNAMO_VERSION" 2>&1 \
    | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2
  have_dynamo || { echo "dynamo-setup: ai-dynamo-runtime did not install into $DYNAMO_VENV" >&2; exit 1; }
fi
echo "DYNAMO_VENV=$DYNAMO_VENV"
