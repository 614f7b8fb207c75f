"""``fairseq-modattn average``: the parameter average of fairseq checkpoints.

fairseq ships its averaging as ``scripts/average_checkpoints.py``, which the pip package leaves
out; this command takes the same flags. The averaged parameter is the plain mean over the K
checkpoints' floating-point tensors, theta = (1/K) sum_k theta_k
(``analysis.checkpoints.average_checkpoints``). Which files are averaged follows fairseq's
rules: explicit files, or the last N epoch (update) checkpoints of one directory, optionally
bounded by ``--checkpoint-upper-bound``.
"""

import argparse
import os
import sys
from pathlib import Path
from typing import List

from ..analysis import AnalysisError
from ..analysis import checkpoints as ckpt
from ..atomic_files import check_output_file
from ..disk_space import describe_disk_full
from ..folder_lock import exclusive_use


def average_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-modattn average",
        description="Average the parameters of fairseq checkpoints (fairseq's scripts/average_checkpoints.py).",
    )
    p.add_argument("--inputs", nargs="+", required=True, metavar="PATH",
                   help="checkpoint files to average, or ONE directory together with "
                        "--num-epoch-checkpoints / --num-update-checkpoints")
    p.add_argument("--output", required=True, metavar="FILE",
                   help="where to write the averaged checkpoint (written atomically; an existing "
                        "directory is refused, never replaced)")
    add_checkpoint_selection(p, "the --inputs directory")
    return p


def add_checkpoint_selection(parser: argparse.ArgumentParser, folder: str, epochs_default: str = ""):
    """The flags that pick which checkpoints of FOLDER (a --save-dir) are averaged, named as
    fairseq's scripts/average_checkpoints.py names them; EPOCHS_DEFAULT says what happens when
    neither count is given."""
    n = parser.add_mutually_exclusive_group()
    n.add_argument("--num-epoch-checkpoints", type=int, metavar="N",
                   help=f"average the last N checkpointEPOCH.pt files of {folder}{epochs_default}")
    n.add_argument("--num-update-checkpoints", type=int, metavar="N",
                   help=f"average the last N checkpoint_EPOCH_UPDATES.pt files of {folder} instead")
    parser.add_argument("--checkpoint-upper-bound", type=int, metavar="K",
                        help=f"only consider the checkpoints of {folder} up to epoch (or update, with "
                             "--num-update-checkpoints) K")


def average(argv: List[str]) -> int:
    """``fairseq-modattn average``: exit 0 on success, 1 on bad input, 2 on usage errors."""
    parser = average_parser()
    args = parser.parse_args(argv)
    try:
        # before any work: an existing folder at --output is refused, never replaced
        check_output_file(args.output, "--output", error=AnalysisError)
        paths = _average_inputs(args)
        _refuse_repeated_files(paths, Path(args.output))
        print(f"averaging {len(paths)} checkpoint(s):")
        for path in paths:
            print(f"  {path}")
        with exclusive_use(args.output, error=AnalysisError, what="--output"):
            ckpt.save_checkpoint_atomically(ckpt.average_checkpoints(paths), args.output)
        print(f"wrote {args.output}")
    except AnalysisError as e:
        print(f"fairseq-modattn average: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk is one line naming the folder and the space needed
        message = describe_disk_full(e, Path(args.output).parent)
        if message is None:
            raise
        print(f"fairseq-modattn average: error: {message}; nothing was written to {args.output}", file=sys.stderr)
        return 1
    return 0


def _average_inputs(args) -> List[Path]:
    """The files ``average`` reads, by fairseq's rules: a directory and N, or explicit files."""
    counted = args.num_epoch_checkpoints is not None or args.num_update_checkpoints is not None
    if counted:
        if len(args.inputs) != 1 or not Path(args.inputs[0]).is_dir():
            raise AnalysisError("--num-epoch-checkpoints/--num-update-checkpoints need --inputs to be one "
                                f"existing directory, got {' '.join(args.inputs)}")
        return ckpt.find_checkpoints(args.inputs[0], args.num_epoch_checkpoints, args.num_update_checkpoints,
                                     args.checkpoint_upper_bound)
    if args.checkpoint_upper_bound is not None:
        raise AnalysisError("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
    paths = [Path(p) for p in args.inputs]
    for path in paths:
        if path.is_dir():
            raise AnalysisError(f"--inputs {path} is a directory: give --num-epoch-checkpoints or "
                                "--num-update-checkpoints, or list checkpoint files")
    return paths


def _file_identity(path: Path):
    """(device, inode) of the file PATH names, through any symlink; None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # a missing input is reported by the loader, naming it
    return st.st_dev, st.st_ino


def _refuse_repeated_files(paths: List[Path], output: Path) -> None:
    """Before anything is read: an --output that is one of the inputs would be replaced by the
    average (a checkpoint lost, and the result carrying the other input's metadata), and an
    input given twice would count twice in the mean. Both are refused, by the files' identity,
    not their spelling (``./a.pt``, a symlink, a hard link)."""
    seen = {}
    for path in paths:
        identity = _file_identity(path)
        if identity is None:
            continue
        if identity in seen:
            raise AnalysisError(f"--inputs names one file twice ({seen[identity]} and {path}): each checkpoint "
                                "counts once in an average; list it once")
        seen[identity] = path
    same = seen.get(_file_identity(output))
    if same is not None:
        raise AnalysisError(f"--output {output} is the input {same}: averaging would replace it; give another "
                            "--output")
