#!/bin/bash
# Every front run of 2-4 Dec judged anew against the base model's full prefill of today's prompts (refs/), then
# pooled per family over its draws (docs/bench/pick-2026-12-03/pool.py). No model runs. From the repository root:
#   bash docs/bench/reference-2026-12-04/rejudge.sh
set -euo pipefail
HERE=docs/bench/reference-2026-12-04
B=docs/bench
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
judge() {  # judge FAMILY NAME RUN_DIR: RUN_DIR's fidelity.json(.gz) against the reference of its splits and draw
  local family=$1 name=$2 run=$3 src
  src=$(ls "$run"/fidelity.json* | head -1)
  case "$src" in *.gz) zcat "$src" > "$tmp/run.json" ;; *) cp "$src" "$tmp/run.json" ;; esac
  local group draw
  group=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s={r['split'] for r in d['rows']}; print('manuals' if s=={'manuals'} else 'both' if 'manuals' not in s else 'all')" "$tmp/run.json")
  draw=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['seed_offset'])" "$tmp/run.json")
  if [ "$group" = all ]; then  # a run over every split: judged per split group, then put together
    for g in both manuals; do
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); keep={'both':('bench','heldout'),'manuals':('manuals',)}[sys.argv[2]]; d['rows']=[r for r in d['rows'] if r['split'] in keep]; json.dump(d,open(sys.argv[3],'w'))" "$tmp/run.json" $g "$tmp/$g.json"
      PYTHONPATH=. python -m benchmarks.fidelity --rejudge "$tmp/$g.json" --reference "$tmp/ref-$g$draw.json" --out "$tmp/out-$g" > /dev/null
    done
    mkdir -p "$HERE/rejudged/$family/$name"
    python3 -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); a['rows']+=b['rows']; a['full_prefill_against_reference']+=b['full_prefill_against_reference']; json.dump(a,open(sys.argv[3],'w'),indent=1)" "$tmp/out-both/fidelity.json" "$tmp/out-manuals/fidelity.json" "$HERE/rejudged/$family/$name/fidelity.json"
  else
    PYTHONPATH=. python -m benchmarks.fidelity --rejudge "$tmp/run.json" --reference "$tmp/ref-$group$draw.json" --out "$tmp/out" > /dev/null
    mkdir -p "$HERE/rejudged/$family/$name"
    cp "$tmp/out/fidelity.json" "$HERE/rejudged/$family/$name/fidelity.json"
  fi
  gzip -f "$HERE/rejudged/$family/$name/fidelity.json"
}
for r in both0 both1 manuals0 manuals1; do zcat "$HERE/refs/$r/fidelity.json.gz" > "$tmp/ref-$r.json"; done
for run in both0 both1 manuals0 manuals1; do judge shipped $run $B/wrap-frozen-2026-12-04/shipped/$run; done
for run in both0 both1 manuals0 manuals1 both0-last1 manuals0-last1; do judge wrapped $run $B/wrap-frozen-2026-12-04/wrapped/$run; done
for run in both0 both1 manuals0 manuals1; do judge wrapped-1088 $run $B/wrap-frozen-2026-12-04/longer/none-$run; done
for run in both0 both1 manuals0 manuals1; do judge neighbours $run $B/pick-2026-12-03/product/$run; done
for run in draw0 draw1; do judge pick $run $B/pick-2026-12-03/$run; done
for run in both0 manuals0; do judge wrapped-neighbours $run $B/wrap-frozen-2026-12-04/wrapped-nbr/$run; done
for family in shipped wrapped wrapped-1088 neighbours pick wrapped-neighbours; do  # pool.py: DIR/pooled.json and the table
  python3 $B/pick-2026-12-03/pool.py "$HERE/rejudged/$family" > "$HERE/rejudged/$family/pooled.md"
done
# the shipped adapter's rows pooled as benchmarks.fidelity pools them (what the README's headline and docs/fidelity.md read)
for g in both manuals; do
  for d in 0 1; do zcat "$HERE/rejudged/shipped/$g$d/fidelity.json.gz" > "$tmp/shipped-$g$d.json"; done
  PYTHONPATH=. python -m benchmarks.fidelity --pool "$tmp/shipped-${g}0.json" "$tmp/shipped-${g}1.json" --out "$HERE/shipped-pooled/$g" > /dev/null
done
# the base model's own `none` rows, each reference judged against itself, pooled (the README's untuned number)
for d in 0 1; do
  PYTHONPATH=. python -m benchmarks.fidelity --rejudge "$tmp/ref-both$d.json" --reference "$tmp/ref-both$d.json" --out "$tmp/base$d" > /dev/null
done
PYTHONPATH=. python -m benchmarks.fidelity --pool "$tmp/base0/fidelity.json" "$tmp/base1/fidelity.json" --out "$HERE/base-pooled/both" > /dev/null
