#!/usr/bin/env bash
# Run before sending a benchmark to the GPU machine (which gets the working
# tree without .git): records the commit the results belong to, marked
# "+dirty" when the tree has uncommitted changes. The file is ignored by git:
# name it in the device call's carry (carry: ["bench/.commit"]).
cd "$(dirname "$0")/.." || exit 1
hash=$(git rev-parse --short HEAD)
[ -n "$(git status --porcelain -- cunorm bench)" ] && hash="$hash+dirty"
echo "$hash" > bench/.commit
echo "$hash"
