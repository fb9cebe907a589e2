#!/usr/bin/env bash
# Type-check the `loraplane` package with mypy (config: pyproject.toml [tool.mypy]).
# mypy cannot follow setuptools' editable-install hook for the package-dir mapping
# (streams/ imports as loraplane.streams), so it checks a symlink tree that has the
# installed layout: .loraplane/typecheck/loraplane/ holds a link to every entry of
# loraplane/ plus schemas, streams, workers, infra and dashboards linked to the repo
# folders. Rebuilt on every run (cheap, and entries added or removed stay in step).
# Reported paths are mapped back to repo paths. Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TREE=.loraplane/typecheck
PKG="$TREE/loraplane"
MAPPED=(schemas streams workers infra dashboards)

rm -rf "$TREE"
mkdir -p "$PKG"
for entry in loraplane/*; do
  name=$(basename "$entry")
  [ "$name" = __pycache__ ] && continue
  ln -s "$ROOT/$entry" "$PKG/$name"
done
for folder in "${MAPPED[@]}"; do
  ln -s "$ROOT/$folder" "$PKG/$folder"
done

rc=0
MYPYPATH="$TREE" python -m mypy -p loraplane "$@" > "$TREE.out" 2>&1 || rc=$?
sed -e "s#$PKG/\(schemas\|streams\|workers\|infra\|dashboards\)/#\1/#g" \
    -e "s#$PKG/#loraplane/#g" "$TREE.out"
exit "$rc"
