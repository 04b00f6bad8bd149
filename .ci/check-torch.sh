#!/bin/sh
# Fails unless $PYTHON's torch is the build named by $1 (cpu, cu128, ...), read from its local
# version label ("2.13.0+cpu"): any other torch means pip chose another build than was asked for.
# `none` asks for no torch at all (the coordinator's install): any torch fails it.
set -eu
PYTHON=${PYTHON:-python3}
WANT=${1:?usage: check-torch.sh VARIANT (cpu, cu128, ..., or none)}
if ! VERSION=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null); then
    if [ "$WANT" = none ]; then
        echo "check-torch: no torch is installed, as asked"
        exit 0
    fi
    echo "check-torch: no torch is installed for $PYTHON; the $WANT build was asked for" >&2
    exit 1
fi
case "$VERSION" in
*+"$WANT") echo "check-torch: torch $VERSION is the $WANT build" ;;
*)
    if [ "$WANT" = none ]; then
        echo "check-torch: torch $VERSION is installed, but no torch was asked for" >&2
    else
        echo "check-torch: torch $VERSION is installed, but the $WANT build (torch ...+$WANT) was asked for" >&2
    fi
    exit 1
    ;;
esac
