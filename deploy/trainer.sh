#!/bin/sh
# Entry point of the compose `trainer` service: `elasticctl ARGS...`, where `run` also gets a
# `--fault SPEC` for each entry of $FAULTS (comma- or space-separated; empty: none), e.g.
#
#   FAULTS="crash@50:rank=1,hang@120:rank=2" deploy/trainer.sh run --nproc 4 examples/train.py
#
# Specs: crash@STEP:rank=R, hang@STEP:rank=R, slow@STEP:rank=R:SECONDS, random:every=S[:seed=N]
# (see `elasticctl run --help`); the launcher checks them and refuses a malformed one.
set -eu
set -f  # no globbing of the specs
if [ "${1:-}" != "run" ]; then
    exec elasticctl "$@"
fi
shift
faults=""
for spec in $(printf '%s' "${FAULTS:-}" | tr ',' ' '); do
    case "$spec" in
        *[!A-Za-z0-9@:=._-]*)
            echo "trainer.sh: FAULTS entry '$spec' has a character a fault spec never has" >&2
            exit 2
            ;;
    esac
    faults="$faults --fault $spec"
done
# $faults is unquoted on purpose: one word per flag and spec, all checked above.
# shellcheck disable=SC2086
exec elasticctl run $faults "$@"
