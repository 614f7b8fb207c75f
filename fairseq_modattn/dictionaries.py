"""Whether a data-bin's dictionaries are the ones a checkpoint was trained with.

A model reads and writes token ids, and the data-bin's ``dict.SRC.txt`` / ``dict.TGT.txt`` say
which word each id is. A data-bin whose dictionaries have the model's sizes but another order
(or other words) loads without any error in fairseq and translates garbage (``H-0 ▁yell ▁yell
▁yell``). Two checks catch it (docs/design.md, "The model knows its dictionaries"):

* models of this package carry a fingerprint of the dictionaries they were built with, as a
  buffer of their state dict (``models/dictionary_fingerprint.py``), and refuse a state dict
  whose fingerprint differs, on every path fairseq loads weights by;
* every checkpoint ``fairseq-train`` saves with the plugin loaded, whatever its architecture
  (fairseq's own ``transformer``, ``lstm``, ...), records the same fingerprint of its task's
  dictionaries in its extra state, and every load the plugin sees compares it with the
  dictionaries of the data-bin given now (``compat/dictionaries_in_every_checkpoint.py``; for a
  file, :func:`check_checkpoint_dictionaries`);
* a checkpoint that records neither (saved by fairseq without the plugin, or before the record
  existed) is compared by ``evaluate``, ``serve`` and the analysis loader through the data-bin
  its task recorded (``cfg.task.data``), while that folder still holds its dictionaries.

A fingerprint is the SHA-256 of a dictionary's symbols in order (special symbols included, counts
left out: they do not change what an id means), kept as the number of symbols and eight 32-bit
words. Small non-negative integers survive fairseq's ``scripts/average_checkpoints.py``, which
sums integer tensors and then floor-divides by the number of checkpoints: one int64 holding a
64-bit digest would overflow in that sum, eight 32-bit words need over 2^31 checkpoints to.
This module imports nothing of fairseq at import time (``compat/one_line_errors.py`` imports the
error class).
"""

import hashlib
import logging
import os
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

#: the key of the fingerprint: the buffer in the model state dict of this package's models, and
#: the entry of every plugin-trained checkpoint's ``extra_state``
FINGERPRINT_KEY = "dictionary_fingerprint"
#: hex digits of a fingerprint shown in messages
SHOWN_DIGITS = 12
_WORDS = 8  # a SHA-256 digest as 32-bit words


class DictionaryMismatchError(RuntimeError):
    """A data-bin's dictionaries differ (content or order) from those the checkpoint was built
    with; the message is one line naming both."""


def fingerprint(symbols: Sequence[str]) -> torch.Tensor:
    """(9,) int64: the number of symbols, then SHA-256 of the symbols in order as eight 32-bit
    words (each < 2^32, see the module docstring)."""
    digest = hashlib.sha256()
    for symbol in symbols:
        # a length prefix, so that no two different lists of symbols give the same bytes
        data = symbol.encode("utf-8")
        digest.update(len(data).to_bytes(4, "big") + data)
    words = [int.from_bytes(digest.digest()[4 * i: 4 * i + 4], "big") for i in range(_WORDS)]
    return torch.tensor([len(symbols), *words], dtype=torch.int64)


def dictionaries_fingerprint(source_dictionary, target_dictionary) -> torch.Tensor:
    """(2, 9) int64: the fingerprints of a model's source and target fairseq Dictionaries."""
    return torch.stack([fingerprint(list(source_dictionary.symbols)), fingerprint(list(target_dictionary.symbols))])


def describe(row: torch.Tensor) -> str:
    """'1a2b3c4d5e6f (1234 symbols)': a fingerprint, shortened, and its dictionary's size."""
    values = [int(v) for v in row.reshape(-1).tolist()]
    hexdigest = "".join(f"{w & 0xFFFFFFFF:08x}" for w in values[1:])
    return f"{hexdigest[:SHOWN_DIGITS]} ({values[0]} symbols)"


def same_fingerprints(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tuple(a.shape) == tuple(b.shape) and torch.equal(a.detach().cpu().long(), b.detach().cpu().long())


def dictionary_files(data, source_lang, target_lang) -> Optional[Tuple[Path, Path]]:
    """(DATA/dict.SRC.txt, DATA/dict.TGT.txt) of a data-bin as fairseq's translation task reads
    them (the first folder of a colon-separated DATA); None when something is unknown."""
    first = str(data or "").split(os.pathsep)[0]
    if not first or not source_lang or not target_lang:
        return None
    folder = Path(first).absolute()
    return folder / f"dict.{source_lang}.txt", folder / f"dict.{target_lang}.txt"


def mismatch_message(built: torch.Tensor, trained_on: Optional[str], now: torch.Tensor,
                     files: Optional[Tuple[Path, Path]]) -> str:
    """One line: the dictionaries a model was built with (BUILT, from the data-bin TRAINED_ON
    when known) and those of the data-bin given now (NOW, read from FILES)."""
    where = f" (trained on {trained_on})" if trained_on else ""
    if files is not None:
        given = f"the data-bin has {files[0]} {describe(now[0])} and {files[1]} {describe(now[1])}"
    else:
        given = f"the data-bin's dictionaries are source {describe(now[0])} and target {describe(now[1])}"
    return (f"the data-bin's dictionaries are not the ones the checkpoint was built with: it was built with source "
            f"dictionary {describe(built[0])} and target dictionary {describe(built[1])}{where}, but {given}; "
            "token ids would mean other words (a garbage translation): pass the data-bin the model was trained on")


# ------------------------------------------------------------------ what a checkpoint records
def recorded_fingerprint(state: dict) -> Optional[torch.Tensor]:
    """The (2, 9) fingerprint a checkpoint's STATE records: its model's buffer (this package's
    models) or its extra state's entry (any model fairseq-train saved with the plugin loaded);
    None when it records neither."""
    model = state.get("model")
    if isinstance(model, dict) and torch.is_tensor(model.get(FINGERPRINT_KEY)):
        return model[FINGERPRINT_KEY]
    extra = state.get("extra_state")
    if isinstance(extra, dict) and torch.is_tensor(extra.get(FINGERPRINT_KEY)):
        return extra[FINGERPRINT_KEY]
    return None


def _recorded_task(path) -> Optional[dict]:
    """What the checkpoint file PATH says about its dictionaries, read without loading its
    tensors (torch's mmap; safe loader): {"fingerprint": (2, 9) tensor or None, "data",
    "source_lang", "target_lang"}; None when the file cannot be read this way (the real loader
    then reports)."""
    from . import compat

    compat.apply()  # the safe loader's allow-list (fix 4); a no-op once the package applied it

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a legacy (non-zip) file, a damaged one, ...: the loader that follows says why
        return None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return None
    cfg = state.get("cfg")
    task = cfg.get("task") if isinstance(cfg, dict) else None
    if task is None and state.get("args") is not None:  # checkpoints of fairseq < 0.10
        task = vars(state["args"])
    task = task if isinstance(task, dict) else {}
    recorded = recorded_fingerprint(state)
    return {"fingerprint": None if recorded is None else recorded.clone(), "data": task.get("data"),
            "source_lang": task.get("source_lang"), "target_lang": task.get("target_lang")}


def _trained_on(recorded: dict, now_folder: Optional[Path]) -> Optional[str]:
    """The data-bin a checkpoint's task recorded, for a message; None when it is the one given now."""
    first = str(recorded.get("data") or "").split(os.pathsep)[0]
    if not first:
        return None
    folder = os.path.abspath(first)
    return None if now_folder is not None and Path(folder) == Path(now_folder).absolute() else folder


def check_task_dictionaries(checkpoint, task) -> None:
    """Raises DictionaryMismatchError where the checkpoint file CHECKPOINT records a fingerprint
    (the model's buffer or its extra state's) other than that of fairseq TASK's source and target
    dictionaries: the check of every load the plugin sees (compat fix
    ``dictionaries_in_every_checkpoint``). A file that records none, or a task without both
    dictionaries, is left to the other checks."""
    recorded = _recorded_task(checkpoint)
    source, target = getattr(task, "source_dictionary", None), getattr(task, "target_dictionary", None)
    if recorded is None or recorded["fingerprint"] is None or source is None or target is None:
        return
    now = dictionaries_fingerprint(source, target)
    if same_fingerprints(recorded["fingerprint"], now):
        return
    cfg = getattr(task, "cfg", None)
    files = dictionary_files(getattr(cfg, "data", None), getattr(cfg, "source_lang", None),
                             getattr(cfg, "target_lang", None))
    raise DictionaryMismatchError(mismatch_message(recorded["fingerprint"],
                                                   _trained_on(recorded, files[0].parent if files else None),
                                                   now, files))


def _symbols(path: Path) -> list:
    """The symbols of a fairseq dictionary file, as fairseq's Dictionary.load gives them."""
    from fairseq.data import Dictionary

    return list(Dictionary.load(str(path)).symbols)


def check_checkpoint_dictionaries(checkpoint, data, source_lang=None, target_lang=None) -> Optional[str]:
    """Whether the data-bin DATA holds the dictionaries the checkpoint file CHECKPOINT was
    trained with, before anything is loaded (``evaluate`` asks for every checkpoint it averages).

    A checkpoint that records a fingerprint (module docstring) is compared with DATA's dictionary
    files. One that records none (saved by fairseq without the plugin, or before the record
    existed) is compared through the data-bin its task recorded: DATA's dictionaries against
    that folder's. Raises DictionaryMismatchError on a difference; returns a one-line warning
    where it cannot tell (the recorded folder is gone or has no dictionaries, or it is DATA
    itself and its dictionaries are newer than the checkpoint), None when they are the same (or
    DATA itself, unchanged since the checkpoint was saved)."""
    recorded = _recorded_task(checkpoint)
    if recorded is None or data is None:
        return None
    source_lang = source_lang or recorded["source_lang"]
    target_lang = target_lang or recorded["target_lang"]
    if not (source_lang and target_lang):  # as fairseq's translation task infers them from the data-bin
        from fairseq.data import data_utils

        source_lang, target_lang = data_utils.infer_language_pair(str(data).split(os.pathsep)[0])
    now = dictionary_files(data, source_lang, target_lang)
    if now is None or not all(p.is_file() for p in now):
        return None  # the loader reports a data-bin without these dictionaries
    if recorded["fingerprint"] is not None:
        given = torch.stack([fingerprint(_symbols(p)) for p in now])
        if not same_fingerprints(recorded["fingerprint"], given):
            raise DictionaryMismatchError(mismatch_message(recorded["fingerprint"],
                                                           _trained_on(recorded, now[0].parent), given, now))
        return None
    cannot_tell = f"cannot tell whether the dictionaries of {now[0].parent} are the ones {checkpoint} was trained with"
    then = dictionary_files(recorded["data"], source_lang, target_lang)
    if then is None:
        return f"{cannot_tell}: it records no data-bin"
    if not all(p.is_file() for p in then):
        return (f"{cannot_tell}: the data-bin it recorded, {then[0].parent}, "
                f"no longer holds {then[0].name} and {then[1].name}")
    if then[0].parent.resolve() == now[0].parent.resolve():
        # Nothing to compare with. Dictionaries older than the checkpoint were there while it was
        # trained (the usual case: evaluating a run on its own data-bin) and get no warning;
        # dictionaries written after it was saved mean the folder was prepared again since.
        saved = Path(checkpoint).stat().st_mtime
        if all(p.stat().st_mtime <= saved for p in now):
            return None
        return (f"{cannot_tell}: it recorded this same data-bin, whose dictionaries were written again after the "
                "checkpoint was saved, and a checkpoint of this model keeps no fingerprint of its dictionaries")
    then_symbols, now_symbols = [_symbols(p) for p in then], [_symbols(p) for p in now]
    if then_symbols == now_symbols:
        return None
    built = torch.stack([fingerprint(s) for s in then_symbols])
    given = torch.stack([fingerprint(s) for s in now_symbols])
    raise DictionaryMismatchError(
        f"the data-bin's dictionaries are not the ones the checkpoint was trained with: it was trained on "
        f"{then[0].parent}, whose {then[0].name} is {describe(built[0])} and {then[1].name} {describe(built[1])}, "
        f"but the data-bin has {now[0]} {describe(given[0])} and {now[1]} {describe(given[1])}; token ids would mean "
        "other words (a garbage translation): pass the data-bin the model was trained on")
