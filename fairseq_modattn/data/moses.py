"""Moses text processing in Python (sacremoses): punctuation, tokens, case, corpus cleaning.

    tokenize(lines, lang, ...)         ``tokenizer.perl -l LANG``, optionally preceded by
                                       ``normalize-punctuation.perl`` and followed by
                                       ``lowercase.perl``; ``-a`` dash splitting (``@-@``) on
                                       request; ``workers`` processes for large corpora
    normalize_punctuation(lines, lang) ``normalize-punctuation.perl`` alone
    lowercase(lines)                   ``lowercase.perl``
    clean_corpus(src, tgt, ...)        ``clean-corpus-n.perl``: min/max tokens and length ratio;
                                       returns the kept pairs and a ``CleanStats``

The recipes reach the first three through ``text_settings.tokenize_lines`` (their settings as
data, shared with the demo, which calls ``tokenize`` once a sentence).
"""

import functools
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..atomic_files import PathLike, load_json, save_json
from .errors import DataError

_WORKER = {}  # the sacremoses objects of this pool worker (set by _init_worker)


@functools.lru_cache(maxsize=16)
def _moses(lang, normalize, tokenize_, lower, escape, aggressive_dash_splits) -> dict:
    """The sacremoses objects of one configuration (built once per process: the demo calls
    ``tokenize`` once a sentence)."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return dict(norm=MosesPunctNormalizer(lang=lang) if normalize else None,
                tok=MosesTokenizer(lang=lang) if tokenize_ else None,
                lower=lower, escape=escape, dash=aggressive_dash_splits)


def _init_worker(lang, normalize, tokenize_, lower, escape, aggressive_dash_splits):
    _WORKER.clear()
    _WORKER.update(_moses(lang, normalize, tokenize_, lower, escape, aggressive_dash_splits))


def _process_one(line: str, w: Optional[dict] = None) -> str:
    w = _WORKER if w is None else w
    if w["norm"] is not None:
        line = w["norm"].normalize(line)
    if w["tok"] is not None:
        line = w["tok"].tokenize(line, return_str=True, escape=w["escape"],
                                 aggressive_dash_splits=w["dash"])
    else:
        line = " ".join(line.split())
    if w["lower"]:
        line = line.lower()
    return line


def _process_chunk(lines: List[str]) -> List[str]:
    return [_process_one(s) for s in lines]


def tokenize(lines: Sequence[str], lang: str, *, normalize: bool = False, tokenize: bool = True,
             lower: bool = False, escape: bool = True, aggressive_dash_splits: bool = False,
             workers: int = 1) -> List[str]:
    """Moses pipeline on LINES: optional punctuation normalisation (``normalize-punctuation.perl``),
    tokenisation (``tokenizer.perl -l LANG``; ESCAPE as Moses' default ``&amp;`` escaping,
    AGGRESSIVE_DASH_SPLITS as ``-a``, which WMT14 en-de uses), optional lower-casing
    (``lowercase.perl``). WORKERS > 1 splits the work over processes (same output)."""
    config = (lang, normalize, tokenize, lower, escape, aggressive_dash_splits)
    lines = list(lines)
    if workers <= 1 or len(lines) < 2000:
        w = _moses(*config)  # not the process-global _WORKER: the demo's threads call this too
        return [_process_one(s, w) for s in lines]
    import multiprocessing

    size = 1000
    chunks = [lines[i:i + size] for i in range(0, len(lines), size)]
    with multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork").Pool(
            workers, initializer=_init_worker, initargs=config) as pool:
        out = []
        for part in pool.imap(_process_chunk, chunks):
            out.extend(part)
    return out


def normalize_punctuation(lines: Sequence[str], lang: str, workers: int = 1) -> List[str]:
    """Moses ``normalize-punctuation.perl -l LANG`` (sacremoses), without tokenising."""
    return tokenize(lines, lang, normalize=True, tokenize=False, workers=workers)


def lowercase(lines: Iterable[str]) -> List[str]:
    """Moses ``lowercase.perl`` (Unicode lower-casing)."""
    return [s.lower() for s in lines]


@dataclass
class CleanStats:
    kept: int = 0
    too_short: int = 0
    too_long: int = 0
    bad_ratio: int = 0

    @property
    def dropped(self) -> int:
        return self.too_short + self.too_long + self.bad_ratio

    def save(self, path: PathLike):
        """Write the counts as JSON (atomically), so a skipped rerun can still report them."""
        save_json(path, {"too_short": self.too_short, "too_long": self.too_long,
                         "bad_ratio": self.bad_ratio, "kept": self.kept})

    @classmethod
    def load(cls, path: PathLike) -> "CleanStats":
        return cls(**load_json(path))

    def reasons(self) -> Dict[str, int]:
        return {"too_short": self.too_short, "too_long": self.too_long, "bad_ratio": self.bad_ratio}


def clean_corpus(src: Sequence[str], tgt: Sequence[str], *, ratio: float = 9.0, min_len: int = 1,
                 max_len: int = 175) -> Tuple[List[str], List[str], CleanStats]:
    """Moses ``clean-corpus-n.perl -ratio RATIO src tgt out MIN MAX`` on aligned token lists.

    Whitespace is collapsed; a pair is dropped if either side has fewer than MIN_LEN or more
    than MAX_LEN tokens, or if one side is more than RATIO times longer than the other.
    Returns (kept src, kept tgt, CleanStats)."""
    if len(src) != len(tgt):
        raise DataError(f"clean_corpus: {len(src)} source but {len(tgt)} target lines")
    out_s, out_t, st = [], [], CleanStats()
    for s, t in zip(src, tgt):
        ws, wt = s.split(), t.split()
        ns, nt = len(ws), len(wt)
        if ns < min_len or nt < min_len:
            st.too_short += 1
        elif ns > max_len or nt > max_len:
            st.too_long += 1
        elif ns / nt > ratio or nt / ns > ratio:
            st.bad_ratio += 1
        else:
            out_s.append(" ".join(ws))
            out_t.append(" ".join(wt))
    st.kept = len(out_s)
    return out_s, out_t, st
