"""Fix 10: ``fairseq-modattn score``, fairseq-score working with sacrebleu >= 2.0.

``fairseq-score`` (fairseq 0.12 ``fairseq_cli/score.py``) calls
``sacrebleu.corpus_bleu(file, [file])``, which sacrebleu >= 2.0 refuses ("Each element of refs
should be a sequence of strings"), and builds ``bleu.Scorer(pad, eos, unk)`` for
``--sentence-bleu`` although 0.12's Scorer takes one ``BleuConfig``. fairseq-score has no
``--user-dir`` and imports no plugin, so nothing here can reach that process; ``fairseq-modattn
score`` (``fairseq_score``) runs fairseq's own ``cli_main`` (same flags, same output) with both
calls adjusted for its duration only (``fairseq_score_adjusted``). fairseq-score also reads its
files unchecked: an empty one ends it with a ZeroDivisionError, a folder with IsADirectoryError,
non-UTF-8 bytes with UnicodeDecodeError, each in a traceback; ``fairseq-modattn score`` checks
``--ref`` and ``--sys`` first and says what is wrong in one line (``score_input_problem``).
Nothing global is changed, so ``apply`` does nothing.

When it can go: each adjustment is made only where the installed sacrebleu refuses open files
(``_sacrebleu_refuses_files``) / fairseq-score builds ``Scorer(dict.pad(), dict.eos(),
dict.unk())`` while ``Scorer.__init__`` takes only ``cfg``; once neither holds, only the input
checks remain.
"""

import inspect
import io
import os
import sys
from contextlib import contextmanager
from typing import List, Optional, Sequence

from ._fairseq_source import source_of

_SACREBLEU_CORPUS_BLEU = _FAIRSEQ_BLEU_SCORER = None  # set by fairseq_score_adjusted


def corpus_bleu_reading_files(hypotheses, references, *args, **kwargs):
    """``sacrebleu.corpus_bleu`` that also takes open files (one sentence a line), as sacrebleu
    1.x did: files are read into lists of lines first."""
    def lines(stream):
        return stream if isinstance(stream, (str, Sequence)) else [line.rstrip("\n") for line in stream]

    return _SACREBLEU_CORPUS_BLEU(lines(hypotheses), [lines(r) for r in references], *args, **kwargs)


def bleu_scorer_of_indices(*args, **kwargs):
    """``fairseq.scoring.bleu.Scorer`` that also takes ``(pad, eos, unk)``, the call of
    fairseq-score --sentence-bleu, as well as its ``BleuConfig``."""
    from fairseq.scoring import bleu

    if len(args) == 3 and not kwargs:
        args = (bleu.BleuConfig(pad=args[0], eos=args[1], unk=args[2]),)
    return _FAIRSEQ_BLEU_SCORER(*args, **kwargs)


def _sacrebleu_refuses_files(corpus_bleu) -> bool:
    try:
        corpus_bleu(io.StringIO("a b c d\n"), [io.StringIO("a b c d\n")])
    except TypeError:
        return True
    return False


@contextmanager
def fairseq_score_adjusted():
    """Within the block, fairseq-score's ``--sacrebleu`` and ``--sentence-bleu`` work; both
    module attributes are restored afterwards."""
    global _SACREBLEU_CORPUS_BLEU, _FAIRSEQ_BLEU_SCORER
    import sacrebleu
    from fairseq.scoring import bleu
    from fairseq_cli import score

    saved = sacrebleu.corpus_bleu, bleu.Scorer
    _SACREBLEU_CORPUS_BLEU, _FAIRSEQ_BLEU_SCORER = saved
    if _sacrebleu_refuses_files(sacrebleu.corpus_bleu):
        sacrebleu.corpus_bleu = corpus_bleu_reading_files
    if "Scorer(dict.pad(), dict.eos(), dict.unk())" in source_of(score.cli_main) and \
            list(inspect.signature(bleu.Scorer.__init__).parameters) == ["self", "cfg"]:
        bleu.Scorer = bleu_scorer_of_indices
    try:
        yield
    finally:
        sacrebleu.corpus_bleu, bleu.Scorer = saved


def score_input_problem(argv: List[str]) -> Optional[str]:
    """Why fairseq-score cannot score the files ARGV names, or None: each of ``--ref`` and
    ``--sys`` (unless ``-``, stdin) must be a file of UTF-8 lines with at least one line.
    fairseq's own reader ends with a ZeroDivisionError on an empty file, IsADirectoryError on
    a folder and UnicodeDecodeError on other bytes, each deep in a traceback."""
    from fairseq_cli import score

    from ..data.errors import DataError
    from ..data.readers import iter_lines

    parser = score.get_parser()
    parser.prog = "fairseq-modattn score"
    args = parser.parse_args(argv)  # a usage error exits 2 with argparse's one line, as fairseq's would
    for flag, path in (("--ref", args.ref), ("--sys", args.sys)):
        if path == "-" or not os.path.exists(path):  # a missing file: fairseq's own assertion says so
            continue
        try:
            for _ in iter_lines(path):
                pass
        except DataError as e:
            return f"{flag} {e}"
    return None


def fairseq_score(argv: List[str]) -> int:
    """``fairseq-modattn score``: fairseq-score with its own flags and output."""
    from fairseq_cli import score

    def fail(message) -> int:
        print(f"fairseq-modattn score: error: {message}", file=sys.stderr)
        return 1

    problem = score_input_problem(argv)
    if problem:
        return fail(problem)
    saved_argv = sys.argv
    sys.argv = ["fairseq-modattn score", *argv]  # fairseq's parser reads sys.argv
    try:
        with fairseq_score_adjusted():
            score.cli_main()
    except (AssertionError, FileNotFoundError) as e:  # fairseq asserts that both files exist
        return fail(e)
    except ZeroDivisionError:  # only stdin is left unchecked
        return fail("the system output (--sys -, standard input) is empty: nothing to score")
    except UnicodeDecodeError as e:
        return fail(f"the system output (--sys -, standard input) is not UTF-8 text ({e.reason} at byte "
                    f"{e.start}): convert it to UTF-8")
    finally:
        sys.argv = saved_argv
    return 0


def apply() -> None:
    """Nothing to install: fairseq-score runs in its own process, adjusted by ``fairseq_score``."""
