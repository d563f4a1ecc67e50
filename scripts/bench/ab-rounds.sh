# Sourced by the *-ab.sh scripts: runs their rounds and reports them.
#
#   ab_rounds ROUNDS UNIT TITLE NAME...
#
# Each round calls the caller's `one NAME` for "raw" and each NAME (a
# build), and prints what it printed; ab-report.py summarises the rounds.
# The order reverses every round (raw A B, B A raw, …): a run's place in a
# round changes what it measures on this VM (the later runs of a round were
# up to 9% slower), and alternating cancels that.
ab_rounds() {
    local rounds=$1 unit=$2 title=$3
    shift 3
    local out order seq_ k line r
    out=$(mktemp)
    order=(raw "$@")
    for r in $(seq "$rounds"); do
        echo "round $r/$rounds" >&2
        declare -A V=()
        if (( r % 2 )); then seq_=("${order[@]}"); else mapfile -t seq_ < <(printf '%s\n' "${order[@]}" | tac); fi
        for k in "${seq_[@]}"; do V[$k]=$(one "$k"); done
        line=""
        for k in "${order[@]}"; do line+="$k ${V[$k]} "; done
        echo "$line" >>"$out"
    done
    python3 "$(dirname "${BASH_SOURCE[0]}")/ab-report.py" "$out" "$unit" "$title"
    rm -f "$out"
}
