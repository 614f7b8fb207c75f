#!/usr/bin/env bash
# Prepare the wmt17_zh_en corpus into a fairseq data-bin (see examples/wmt17_zh_en/README.md).
#   scripts/prepare-wmt17-zh-en.sh --raw-dir RAW --dest data-bin/NAME [flags of: fairseq-modattn prepare wmt17_zh_en -h]
# Resumable: rerun the same command after an interruption. PYTHON picks the interpreter when
# the fairseq-modattn command is not installed.
set -euo pipefail
if command -v fairseq-modattn >/dev/null 2>&1; then
    exec fairseq-modattn prepare wmt17_zh_en "$@"
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m fairseq_modattn.cli.main prepare wmt17_zh_en "$@"
