#!/bin/sh
# Entry point of the trainer containers (compose's `trainer`, the Kubernetes trainer pods):
# `run ARGS...` starts the launcher, `elastic-run ARGS...` (= `elasticctl run`), with a
# `--fault SPEC` for each entry of $FAULTS (comma- or space-separated; empty or unset: none), e.g.
#
#   FAULTS="crash@50:rank=1,hang@120:rank=2" deploy/trainer.sh run --nproc 4 examples/train.py
#
# Specs: crash@STEP:rank=R, hang@STEP:rank=R, slow@STEP:rank=R:SECONDS, random:every=S[:seed=N]
# (see `elastic-run --help`); the launcher checks them and refuses a malformed one. Anything
# but `run` goes to elasticctl (an image with the control plane installed).
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
exec elastic-run $faults "$@"
