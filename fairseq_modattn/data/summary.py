"""What a recipe reports when it is done: ``Summary``, and the common tail of the recipes.

``Summary`` collects sentences per split, vocabulary sizes and dropped pairs; ``.print()`` shows
them and ``.save(path)`` writes them as JSON (``--summary-json``). ``text_summary`` reads them
from the files of a finished recipe, so a fully skipped rerun reports the same numbers.
``subword_binarize_summary`` is the end every recipe shares: subword steps, the "binarize" step
and the summary.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..atomic_files import PathLike, atomic_path
from .binarize import binarize_step
from .moses import CleanStats
from .readers import count_lines
from .steps import Steps
from .subwords import subword_steps


@dataclass
class Summary:
    """What a recipe produced: sentences per split, vocabulary sizes, dropped pairs."""
    name: str
    dest: str = ""
    sentences: Dict[str, int] = field(default_factory=dict)
    vocab: Dict[str, int] = field(default_factory=dict)
    dropped: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def read_vocab(self, dest: PathLike, langs: Sequence[str]):
        """Fill ``vocab`` from DEST/dict.LANG.txt (+4 fairseq special symbols)."""
        for lang in langs:
            d = Path(dest) / f"dict.{lang}.txt"
            if d.is_file():
                self.vocab[lang] = count_lines(d) + 4

    def to_dict(self):
        return {"name": self.name, "dest": self.dest, "sentences": self.sentences,
                "vocab": self.vocab, "dropped": self.dropped, "notes": self.notes}

    def format(self) -> str:
        out = [f"== {self.name} -> {self.dest}"]
        out.append("sentences: " + ", ".join(f"{k} {v:,}" for k, v in self.sentences.items()))
        out.append("vocabulary (fairseq dict incl. 4 specials): "
                   + ", ".join(f"{k} {v:,}" for k, v in self.vocab.items()))
        total = sum(self.dropped.values())
        out.append(f"dropped pairs: {total:,}" + (
            " (" + ", ".join(f"{k} {v:,}" for k, v in self.dropped.items()) + ")" if self.dropped else ""))
        out.extend(self.notes)
        return "\n".join(out)

    def print(self, file=None):
        print(self.format(), file=file or sys.stdout, flush=True)

    def save(self, path: PathLike):
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")


def text_summary(name: str, dest: PathLike, text_dir: PathLike, splits: Sequence[str], src: str, tgt: str,
                 dropped: Optional[Dict[str, int]] = None) -> Summary:
    """A Summary from the files of a finished recipe (works after a fully skipped rerun)."""
    summary = Summary(name=name, dest=str(dest))
    for split in splits:
        summary.sentences[split] = count_lines(Path(text_dir) / f"{split}.{src}")
    summary.read_vocab(dest, [src, tgt])
    summary.dropped = dict(dropped or {})
    return summary


def subword_binarize_summary(steps: Steps, args, text_dir: PathLike, sub_dir: PathLike,
                             splits: Sequence[str], src: str, tgt: str, name: str,
                             clean_stats: Optional[PathLike] = None, text_settings=None) -> Summary:
    """The common tail of a recipe: ``subword_steps`` (flags of ``add_subword_args``),
    ``binarize_step`` into ``args.dest`` and the Summary (dropped pairs read from CLEAN_STATS,
    a ``CleanStats.save`` file). TEXT_SETTINGS ({lang: ``text_settings.TextSettings``} of the
    test split) are recorded in the manifest with the subword model."""
    from .text_settings import manifest_text

    joint = args.vocab == "joint"
    models = subword_steps(steps, text_dir, sub_dir, splits, src, tgt, method=args.subword, joint=joint,
                           joint_size=args.bpe_size, src_size=args.src_bpe_size, tgt_size=args.tgt_bpe_size)
    binarize_step(steps, sub_dir, args.dest, src, tgt, joined=joint, workers=args.workers,
                  extra_files=models, splits=splits, corpus=getattr(args, "corpus", None),
                  text=manifest_text(text_settings, args.subword, joint) if text_settings else None)
    dropped = CleanStats.load(clean_stats).reasons() if clean_stats else {}
    summary = text_summary(name, args.dest, sub_dir, splits, src, tgt, dropped)
    summary.notes.append(f"tokenised text: {text_dir}; subword text: {sub_dir}; "
                         f"subword model(s) copied into {args.dest}")
    return summary
