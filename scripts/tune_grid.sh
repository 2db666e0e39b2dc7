#!/usr/bin/env bash
# `ortsparse tune` on three kinds of text x {SmolLM2 genai fp32; genai int8 with --reference fp32}
# (issue 26's targets). Each text: its first 200 kB; tune reads the first 60%, and the tuned model is
# then scored by `ortsparse quality` against genai fp32 on 16 windows of the last 40% (never seen by
# tune). Texts (already on a Debian machine or in the ortsparse cache, nothing downloaded):
#   prose    the cache's britannica-11th.txt (`ortsparse models corpus`)
#   manual   GNU coreutils' info manual (/usr/share/info/coreutils.info.gz)
#   apidocs  Node.js' fs API reference (/usr/share/doc/nodejs/api/fs.md)
# usage: scripts/tune_grid.sh OUT_DIR [KIND-MODEL ...]   (default: every kind x {fp32, int8};
#        e.g. prose-fp32 manual-int8; ~15 min per tune on a quiet 2-core machine)
set -euo pipefail
out=$(realpath -m "$1"); shift
runs=("$@")
[[ ${#runs[@]} -gt 0 ]] || runs=(prose-fp32 manual-fp32 apidocs-fp32 prose-int8 manual-int8 apidocs-int8)
M=$(python -c "from ortsparse.zoo.cache import models_dir; print(models_dir())")/smollm2
mkdir -p "$out"
declare -A source=(
  [prose]="cat $HOME/.cache/ortsparse/corpus/britannica-11th.txt"
  [manual]="zcat /usr/share/info/coreutils.info.gz"
  [apidocs]="cat /usr/share/doc/nodejs/api/fs.md")
for name in "${runs[@]}"; do
  kind=${name%-*} model=${name##*-}
  [[ -n ${source[$kind]:-} && ($model == fp32 || $model == int8) ]] || { echo "unknown run $name" >&2; exit 2; }
  if [[ ! -f $out/$kind.tune.txt ]]; then
    (set +o pipefail; ${source[$kind]} | head -c 200000 > "$out/$kind.txt")
    python - "$out/$kind.txt" <<'PY'
import sys
text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
cut = text.rfind("\n", 0, int(len(text) * 0.6)) + 1
open(sys.argv[1][:-4] + ".tune.txt", "w").write(text[:cut])
open(sys.argv[1][:-4] + ".check.txt", "w").write(text[cut:])
PY
  fi
  ref=()
  [[ $model == int8 ]] && ref=(--reference "$M/genai-fp32")
  rm -rf "${out:?}/$name"
  set +e
  /usr/bin/time -f "%e s" -o "$out/$name.time" \
    ortsparse tune "$M/genai-$model" "${ref[@]}" --text "$out/$kind.tune.txt" -o "$out/$name" > "$out/$name.log" 2>&1
  echo "exit $?" >> "$out/$name.log"
  set -e
  if [[ -d $out/$name ]]; then  # the other 40%: dppl against fp32 (the budget's reference)
    ortsparse quality "$M/genai-fp32" --rewritten "$out/$name" --text "$out/$kind.check.txt" \
      --windows 16 --json "$out/$name.check.json" > "$out/$name.check.log" 2>&1 || true
  fi
  echo "$name: $(tail -2 "$out/$name.log" | tr '\n' ' ')"
done
