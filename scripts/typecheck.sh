#!/usr/bin/env bash
# Type-check the `loraplane` package with mypy (config: pyproject.toml [tool.mypy]).
# mypy cannot follow setuptools' editable-install hook for the package-dir mapping
# (streams/ imports as loraplane.streams), so it checks a symlink tree with the installed
# layout: .loraplane/typecheck/loraplane/ links every entry of loraplane/, plus one link per
# mapped subpackage (schemas, streams, workers, infra, dashboards: read from
# [tool.setuptools.package-dir], so the two cannot drift). Rebuilt on every run (cheap, and
# added or removed entries stay in step). Reported paths are mapped back to repo paths.
# Extra arguments go to mypy; the exit status is mypy's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TREE=.loraplane/typecheck
PKG="$TREE/loraplane"

# "name folder" per mapped subpackage, e.g. "streams streams" for loraplane.streams -> streams/
MAPPED=$(python - <<'PY'
import tomllib

with open("pyproject.toml", "rb") as f:
    dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
for package, folder in dirs.items():
    if package.startswith("loraplane.") and package.count(".") == 1:
        print(package.removeprefix("loraplane."), folder)
PY
)

rm -rf "$TREE"
mkdir -p "$PKG"
for entry in loraplane/*; do
  name=$(basename "$entry")
  [ "$name" = __pycache__ ] || ln -s "$ROOT/$entry" "$PKG/$name"
done
back=(-e "s#$PKG/#loraplane/#g")
while read -r name folder; do
  ln -s "$ROOT/$folder" "$PKG/$name"
  back=(-e "s#$PKG/$name/#$folder/#g" "${back[@]}")
done <<< "$MAPPED"

set +e
MYPYPATH="$TREE" python -m mypy -p loraplane "$@" 2>&1 | sed "${back[@]}"
exit "${PIPESTATUS[0]}"
