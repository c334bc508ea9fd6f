#!/usr/bin/env bash
# Build the documentation site into site/ (git-ignored), with warnings as errors: a broken
# link or anchor, a page missing from the nav, a docstring mkdocstrings cannot read, or a
# public name without a docstring (scripts/check_docstrings.py) fails it.
# Open site/index.html, or run `.venv/bin/mkdocs serve` for a live preview.
# The docs tools come with the dev extra (bash scripts/setup.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export NO_MKDOCS_2_WARNING=1
"$PY" scripts/check_docstrings.py
"$PY" -m mkdocs build --strict "$@"
# The layer picture is a mermaid diagram: ship mermaid.js with the site when npm can fetch it
# (cached in .cache/), so the picture renders offline too; otherwise the theme loads it from
# its CDN when a page is opened.
MERMAID=mermaid@11.17.2
cache=.cache/docs/${MERMAID}
if [ ! -f "$cache/mermaid.min.js" ] && command -v npm >/dev/null 2>&1; then
  mkdir -p "$cache"
  if tgz=$(cd "$cache" && timeout 120 npm pack --silent "$MERMAID" 2>/dev/null); then
    tar -xzf "$cache/$tgz" -C "$cache" --strip-components=2 package/dist/mermaid.min.js || true
    rm -f "$cache/$tgz"
  fi
fi
if [ -f "$cache/mermaid.min.js" ]; then
  mkdir -p site/js && cp "$cache/mermaid.min.js" site/js/mermaid.min.js
fi
echo "docs built: site/index.html"
