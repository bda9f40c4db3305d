#!/usr/bin/env bash
# Mutation testing of the scheduler core with mutmut: one comparison, constant, operator or call
# of the files `[tool.mutmut] only_mutate` names (pyproject.toml) changed at a time, and the
# scheduler's unit tests run against each change. A mutant that survives is a rule no test
# pins, or a change that makes no difference. Not part of CI: about 20 minutes on 2 cores.
#
#   bash scripts/mutation.sh               # then: mutmut results; mutmut show <mutant name>
#
# The property tests run BLOCKSERVE_PROPERTY_EXAMPLES examples per mutant (30 here, 300 in the suite).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "mutmut==3.8.1"
export BLOCKSERVE_PROPERTY_EXAMPLES="${BLOCKSERVE_PROPERTY_EXAMPLES:-30}"
rm -rf mutants
log="$(mktemp)"
mutmut run --max-children "$(nproc)" > "$log" 2>&1 || { tail -c 2000 "$log"; exit 1; }
results="$(mutmut results --all true)"
echo "$results" | grep -v ': killed$' || true  # what the tests let through, one mutant a line
echo "mutants by status:"
echo "$results" | awk -F': ' '{print $NF}' | sort | uniq -c
