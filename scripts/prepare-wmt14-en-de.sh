#!/usr/bin/env bash
# Prepare the wmt14_en_de corpus into a fairseq data-bin (see examples/wmt14_en_de/README.md).
#   scripts/prepare-wmt14-en-de.sh --raw-dir RAW --dest data-bin/NAME [flags of: fairseq-modattn prepare wmt14_en_de -h]
# Resumable: rerun the same command after an interruption. PYTHON picks the interpreter when
# the fairseq-modattn command is not installed.
set -euo pipefail
if command -v fairseq-modattn >/dev/null 2>&1; then
    exec fairseq-modattn prepare wmt14_en_de "$@"
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m fairseq_modattn.cli.main prepare wmt14_en_de "$@"
