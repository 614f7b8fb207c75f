#!/usr/bin/env bash
# Prepare the multi30k corpus into a fairseq data-bin (see examples/multi30k/README.md).
#   scripts/prepare-multi30k.sh --raw-dir RAW --dest data-bin/NAME [flags of: fairseq-modattn prepare multi30k -h]
# Resumable: rerun the same command after an interruption. PYTHON picks the interpreter when
# the fairseq-modattn command is not installed.
set -euo pipefail
if command -v fairseq-modattn >/dev/null 2>&1; then
    exec fairseq-modattn prepare multi30k "$@"
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m fairseq_modattn.cli.main prepare multi30k "$@"
