#!/usr/bin/env bash
# Wall time and size of a fresh venv with this checkout installed, per pip target:
#   bash devtools/measure_install.sh . '.[test,cluster]'      ('-r requirements.txt' for older checkouts)
# Both depend on pip's cache (warm or cold): compare targets measured in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
for target in "${@:-.}"; do
  dir=$(mktemp -d)
  python3 -m venv "$dir/venv"
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # a target may be two words (-r FILE)
  "$dir/venv/bin/pip" install -q $target >"$dir/pip.log" 2>&1 || { tail -5 "$dir/pip.log"; exit 1; }
  end=$(date +%s.%N)
  echo "$target: $(python3 -c "print(round($end - $start))") s, $(du -sm "$dir/venv" | cut -f1) MB"
  rm -rf "$dir"
done
