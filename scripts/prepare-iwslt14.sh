#!/usr/bin/env bash
# Prepare the iwslt14 corpus into a fairseq data-bin (see examples/iwslt14/README.md).
#   scripts/prepare-iwslt14.sh --raw-dir RAW --dest data-bin/NAME [flags of: fairseq-modattn prepare iwslt14 -h]
# Resumable: rerun the same command after an interruption. PYTHON picks the interpreter when
# the fairseq-modattn command is not installed.
set -euo pipefail
if command -v fairseq-modattn >/dev/null 2>&1; then
    exec fairseq-modattn prepare iwslt14 "$@"
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m fairseq_modattn.cli.main prepare iwslt14 "$@"
