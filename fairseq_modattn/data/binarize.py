"""Binarising: fairseq's own ``fairseq-preprocess`` run safely, and the recipes' "binarize" step.

``fairseq_preprocess(dest, src, tgt, trainpref, validpref, testpref, joined=True, ...)`` runs
``fairseq-preprocess`` into a temporary folder and renames it to ``dest``, a new folder (an
existing one is refused). The child process dies with its parent (Linux: ``PR_SET_PDEATHSIG``),
also when the parent is killed with SIGKILL, and is stopped when the parent raises
(KeyboardInterrupt included).

``binarize_step`` is the last resumable step of every recipe: it writes the data-bin file by
file and records the files it wrote, with the text settings of each language, in
``DEST/prepare-manifest.json`` (``manifest.py``); other files in DEST (a user's notes) are left
alone on every rerun.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..atomic_files import PathLike, atomic_path, is_temporary, remove_path
from ..child_processes import die_with_parent
from .errors import DataError
from .manifest import MANIFEST, WRITTEN_BY, data_bin_files, read_manifest
from .steps import Steps

# Runs fairseq-preprocess as the child of a small wrapper: it leads its own process group (so
# its --workers pool processes can be stopped with it) and, on SIGTERM, kills that whole group.
_CHILD_WRAPPER = (
    "import os, runpy, signal, sys\n"
    "signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))\n"
    "sys.argv[0] = 'fairseq-preprocess'\n"
    "runpy.run_module('fairseq_cli.preprocess', run_name='__main__', alter_sys=True)\n"
)


def _run_child(cmd: Sequence[str]) -> Tuple[int, str]:
    """Run CMD (a Python child) to completion: (exit status, stdout + stderr). The child leads
    its own process group, dies with this process (``child_processes.die_with_parent``), and the group is
    killed when this process raises while waiting (Ctrl-C included)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=die_with_parent())
    try:
        out, _ = proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        raise
    return proc.returncode, out or ""


def _preprocess_command(src, tgt, trainpref, validpref, testpref, joined, workers, nwordssrc, nwordstgt,
                        extra_args) -> List[str]:
    cmd = [sys.executable, "-c", _CHILD_WRAPPER, "--source-lang", src, "--target-lang", tgt,
           "--trainpref", str(trainpref), "--workers", str(workers)]
    if validpref:
        cmd += ["--validpref", str(validpref)]
    if testpref:
        cmd += ["--testpref", str(testpref)]
    if joined:
        cmd += ["--joined-dictionary"]
    if nwordssrc > 0:
        cmd += ["--nwordssrc", str(nwordssrc)]
    if nwordstgt > 0:
        cmd += ["--nwordstgt", str(nwordstgt)]
    return cmd + list(extra_args)


def _preprocess_into(outdir: Path, cmd: Sequence[str], dest_for_messages: PathLike, log_dest: PathLike):
    """Run fairseq-preprocess CMD into the (new) folder OUTDIR; its preprocess.log names LOG_DEST."""
    code, output = _run_child(list(cmd) + ["--destdir", str(outdir)])
    if code != 0:
        raise DataError(f"fairseq-preprocess failed (exit {code}):\n{output[-3000:]}", dest_for_messages)
    log = Path(outdir) / "preprocess.log"
    if log.is_file():
        text = log.read_text(encoding="utf-8").replace(str(outdir), str(log_dest))
        log.write_text(text, encoding="utf-8")


def fairseq_preprocess(dest: PathLike, src: str, tgt: str, trainpref: PathLike,
                       validpref: Optional[PathLike] = None, testpref: Optional[PathLike] = None,
                       joined: bool = True, workers: int = 1, nwordssrc: int = -1, nwordstgt: int = -1,
                       extra_files: Sequence[PathLike] = (), extra_args: Sequence[str] = (),
                       log_dest: Optional[PathLike] = None):
    """Run fairseq's ``fairseq-preprocess`` (``--joined-dictionary`` if JOINED) into a temporary
    folder, copy EXTRA_FILES (BPE codes, sentencepiece model) into it, and rename it onto DEST,
    which must not exist yet (an existing folder is refused with DataError, never replaced; the
    recipes' ``binarize_step`` updates a data-bin file by file instead).
    Its ``preprocess.log`` names LOG_DEST (default DEST), not the temporary folder, so reruns
    write identical bytes. The child process dies with this one (see ``child_processes.die_with_parent``)."""
    dest = Path(dest)
    if dest.is_dir() and not dest.is_symlink() and not is_temporary(dest):
        raise DataError("already exists; fairseq_preprocess writes a new folder (remove it or give another)", dest)
    cmd = _preprocess_command(src, tgt, trainpref, validpref, testpref, joined, workers, nwordssrc, nwordstgt,
                              extra_args)
    with atomic_path(dest) as tmp:
        remove_path(tmp)
        _preprocess_into(tmp, cmd, dest, log_dest or dest)
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)


def binarize_step(steps: Steps, text_dir: PathLike, dest: PathLike, src: str, tgt: str, *,
                  joined: bool, workers: int = 1, extra_files: Sequence[PathLike] = (),
                  splits: Sequence[str] = ("train", "valid", "test"), corpus: Optional[str] = None,
                  text: Optional[Dict[str, dict]] = None):
    """Resumable "binarize" step: fairseq-preprocess of TEXT_DIR/{train,valid,test}.{src,tgt}
    into DEST (joined or separate dictionaries); EXTRA_FILES are copied into DEST.
    TEXT (``text_settings.manifest_text``: per language, the text steps and subword model of the
    test split) is recorded in the manifest under ``"text"``, where the demo reads it.

    fairseq-preprocess writes into a temporary folder in the work dir; its files are then moved
    into DEST one by one (each atomically), together with ``prepare-manifest.json`` naming
    CORPUS, the languages and every file written. Nothing else in DEST is touched: a user's
    files survive reruns; files a previous run wrote that this one does not (``code.de`` after
    switching to a joint BPE) are removed, as the old manifest lists them."""
    text_dir, dest = Path(text_dir), Path(dest)
    prefs = {s: text_dir / s for s in splits}
    inputs = [text_dir / f"{s}.{lang}" for s in splits for lang in (src, tgt)] + [Path(f) for f in extra_files]
    names = data_bin_files(src, tgt, splits, extra_files)
    outputs = [dest / n for n in names] + [dest / MANIFEST]  # the manifest is renamed into place first
    manifest = {"written_by": WRITTEN_BY, "corpus": corpus, "src": src, "tgt": tgt,
                "files": sorted(names + [MANIFEST])}
    if text:
        manifest["text"] = text
    stage_prefix = ".binarize.tmp-"
    if steps.work_dir.is_dir():
        for stale in steps.work_dir.glob(stage_prefix + "*"):  # left by a killed run
            remove_path(stale)

    def binarize(*tmps):
        stage = steps.work_dir / f"{stage_prefix}{os.getpid()}"
        remove_path(stage)
        stage.parent.mkdir(parents=True, exist_ok=True)
        try:
            cmd = _preprocess_command(src, tgt, prefs["train"], prefs.get("valid"), prefs.get("test"), joined,
                                      workers, -1, -1, ())
            _preprocess_into(stage, cmd, dest, dest)
            for f in extra_files:
                shutil.copyfile(f, stage / Path(f).name)
            missing = [n for n in names if not (stage / n).is_file()]
            if missing:
                raise DataError(f"fairseq-preprocess did not write {', '.join(missing)}", dest)
            for name, tmp in zip(names, tmps):
                shutil.move(str(stage / name), str(tmp))  # the work dir may be on another filesystem
            Path(tmps[-1]).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            old = read_manifest(dest) or {}
            for name in old.get("files", []):
                gone = dest / str(name)
                if name not in manifest["files"] and gone.parent == dest and gone.is_file():
                    gone.unlink()
        finally:
            remove_path(stage)

    steps.run("binarize", outputs, binarize, inputs=inputs,
              params={"joined": joined, "src": src, "tgt": tgt, "files": manifest["files"], "corpus": corpus,
                      **({"text": text} if text else {})})
