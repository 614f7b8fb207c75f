"""The data-bin's ``prepare-manifest.json``, and the checks ``prepare`` makes of its paths.

``binarize_step`` writes the manifest (``MANIFEST``) into every data-bin: the corpus, the
languages, every file it wrote and the text settings of each language (``text_settings.py``,
which the demo reads back). A rerun replaces only the files listed there, so a user's own files
in the data-bin survive.

``check_prepare_paths`` (run by ``data.prepare`` before any work) refuses, in one line, a --dest
that is not empty and holds no such manifest (another tool's folder, a parent of data-bins), a
--dest holding another corpus's data-bin, an unwritable --dest / --work-dir, and a
--summary-json that is a directory.
"""

import os
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from ..atomic_files import PathLike, check_output_file, is_temporary, load_json
from .errors import DataError
from .steps import Steps

MANIFEST = "prepare-manifest.json"
WRITTEN_BY = "fairseq-modattn prepare"  # tells our manifests from any other file of that name


def data_bin_files(src: str, tgt: str, splits: Sequence[str], extra_files: Sequence[PathLike] = ()) -> List[str]:
    """Names of the files fairseq-preprocess (plus EXTRA_FILES) writes into a data-bin."""
    names = [f"dict.{src}.txt", f"dict.{tgt}.txt", "preprocess.log"]
    names += [f"{s}.{src}-{tgt}.{lang}.{ext}" for s in splits for lang in (src, tgt) for ext in ("bin", "idx")]
    return names + [Path(f).name for f in extra_files]


def read_manifest(dest: PathLike) -> Optional[dict]:
    """DEST's ``prepare-manifest.json`` (what prepare wrote there), or None."""
    try:
        manifest = load_json(Path(dest) / MANIFEST)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("written_by") == WRITTEN_BY else None


def _check_writable(path: Path, flag: str):
    """DataError (one line) unless PATH is, or can be created as, a folder this process can write in."""
    if path.exists() and not path.is_dir():
        raise DataError(f"{flag} {path} is a file, expected a folder")
    ancestor = path
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DataError(f"{flag} {path}: {ancestor} is a file, expected a folder")
    try:  # os.access says yes to root on a read-only mount: try it
        os.rmdir(tempfile.mkdtemp(prefix=".fairseq-modattn-probe-", dir=ancestor))
    except OSError as e:
        raise DataError(f"{flag} {path} is not writable ({ancestor}: {e.strerror or e}); "
                        "give a folder you can write to") from None


def check_prepare_paths(corpus: str, dest: PathLike, work_dir: PathLike, summary_json: Optional[PathLike] = None,
                        src: Optional[str] = None, tgt: Optional[str] = None):
    """The checks ``prepare`` makes before any work, each failing with a one-line DataError:
    SUMMARY_JSON must not be a directory; DEST and WORK_DIR must be (creatable) writable
    folders; a non-empty DEST must be a data-bin this command wrote (``prepare-manifest.json``,
    or for data-bins of older versions the "binarize" marker in WORK_DIR) for the same CORPUS
    (and SRC-TGT, when given). Temporaries left by a killed run do not count as content."""
    dest, work_dir = Path(dest), Path(work_dir)
    check_output_file(summary_json, "--summary-json", error=DataError)
    if summary_json is not None:
        _check_writable(Path(summary_json).parent, "--summary-json")
    _check_writable(dest, "--dest")
    _check_writable(work_dir, "--work-dir")
    if not dest.is_dir():
        return
    content = [p for p in dest.iterdir() if not is_temporary(p)]
    if not content:
        return
    manifest = read_manifest(dest)
    if manifest is None:
        marker = Steps(work_dir).marker("binarize")
        try:
            recorded = load_json(marker).get("outputs", {})
        except (OSError, ValueError, AttributeError):
            recorded = {}
        if str(dest) in recorded:  # a data-bin of a version without manifests, with its work dir
            return
        raise DataError(f"--dest {dest} is not empty and was not created by fairseq-modattn prepare "
                        f"(no {MANIFEST}); give a new or empty folder, e.g. {dest / corpus}")
    if manifest.get("corpus") not in (None, corpus) or (
            src and tgt and (manifest.get("src"), manifest.get("tgt")) != (src, tgt)):
        raise DataError(f"--dest {dest} holds the {manifest.get('corpus')} {manifest.get('src')}-"
                        f"{manifest.get('tgt')} data-bin; give another --dest for {corpus}"
                        + (f" {src}-{tgt}" if src and tgt else ""))
