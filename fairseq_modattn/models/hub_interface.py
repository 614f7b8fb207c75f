"""``Model.from_pretrained(...).translate(text)`` with the text pipeline the data-bin records.

fairseq's ``from_pretrained`` (``BaseFairseqModel.from_pretrained``, ``fairseq.hub_utils``) loads
a checkpoint with the dictionaries of a data-bin and returns a ``GeneratorHubInterface``, whose
``encode`` / ``decode`` apply only the tokenizer and BPE named in its keyword arguments or in the
checkpoint's args. A data-bin of ``fairseq-modattn prepare`` records its own text steps instead
(Moses with the recipe's options, lower-casing, jieba for Chinese, the subword model it copied
into the data-bin: ``data/text_settings.py``), and a model fed raw text without them reads
tokens it never saw in training. So every model of this package has ``from_pretrained`` from
``PretrainedWithTextPipeline`` (first among its bases), which chooses, in this order:

1. ``tokenizer=`` or ``bpe=`` among the keyword arguments: fairseq's own behaviour, unchanged
   (its ``GeneratorHubInterface`` with those encoders); a warning says that a recorded pipeline
   is then not applied.
2. a data-bin with recorded settings: ``TextPipelineHubInterface``, whose ``encode`` and
   ``decode`` are ``data/text_pipeline.py``'s ``TextPipeline``, the one the demo uses: the
   recipe's steps on the way in; subword marks removed and, for a Moses-tokenised target,
   Moses detokenisation on the way out (what ``fairseq-modattn evaluate`` scores), so text in
   gives text out like the recipe's detokenised references.
3. a data-bin without them (plain ``fairseq-preprocess``, or an earlier ``prepare``):
   ``text_pipeline="guessed"`` takes the guesses ``fairseq-modattn serve`` makes; a checkpoint
   whose own args name a tokenizer or BPE gets fairseq's behaviour; anything else is a
   ``FromPretrainedError`` saying what to pass.

Generation is fairseq's own (``GeneratorHubInterface.generate``: ``task.build_generator`` and
``inference_step``, as in ``fairseq-generate``), so ``translate(text, beam=5, lenpen=1.0, ...)``
takes fairseq's generation options as fairseq does. The function ``from_pretrained`` (exported
as ``fairseq_modattn.from_pretrained``) does the same for any checkpoint, fairseq's own
architectures (the transformer baselines) included.

A registered model class is needed to load a checkpoint: ``import fairseq_modattn`` registers
this package's (a checkpoint trained with ``--user-dir`` records only the folder; loading does
not import it). ``user_dir=`` is passed on to fairseq, which imports it as ``--user-dir`` does.
"""

import logging
import os
from pathlib import Path
from typing import Optional

import torch
from fairseq.hub_utils import GeneratorHubInterface

logger = logging.getLogger(__name__)

#: the keyword arguments with which fairseq's own tokenizer / BPE are asked for (rule 1)
FAIRSEQ_TEXT_KWARGS = ("tokenizer", "bpe")
#: ``text_pipeline=``: the data-bin's record only, or (without one) the demo's guesses
TEXT_PIPELINES = ("recorded", "guessed")


class FromPretrainedError(ValueError):
    """``from_pretrained`` cannot go on: one line saying what is missing and what to pass."""


class CheckedHubInterface(GeneratorHubInterface):
    """fairseq's hub interface whose ``translate`` / ``sample`` say what is wrong with their
    arguments, in Python's terms, before fairseq meets them: fairseq's own reports a non-string as
    an error of its encoder, ``beam=0`` as a reshape error deep in attention, and a too-long
    input with the advice to pass ``--skip-invalid-size-inputs-valid-test``, a command-line flag.
    An empty or blank sentence translates to ``""`` (fairseq would decode the model's output for
    a source of only </s>). Everything else, ``generate`` included, is fairseq's."""

    def sample(self, sentences, beam: int = 1, verbose: bool = False, **kwargs):
        single = isinstance(sentences, str)
        batch = [sentences] if single else _sentence_list(sentences)
        if isinstance(beam, bool) or not isinstance(beam, int):
            raise TypeError(f"beam must be an int, got {type(beam).__name__}")
        if beam < 1:
            raise ValueError(f"beam must be at least 1, got {beam}")
        translations = [""] * len(batch)
        todo = [i for i, sentence in enumerate(batch) if sentence.strip()]
        if todo:
            tokens = [self.encode(batch[i]) for i in todo]
            self._check_lengths(tokens, todo, single)
            for i, hypos in zip(todo, self.generate(tokens, beam, verbose, **kwargs)):
                translations[i] = self.decode(hypos[0]["tokens"])
        return translations[0] if single else translations

    def _check_lengths(self, tokens, positions, single: bool) -> None:
        from fairseq import utils

        limit = utils.resolve_max_positions(self.task.max_positions(), *[m.max_positions() for m in self.models])
        source_limit = limit[0] if isinstance(limit, tuple) else limit
        if source_limit is None:
            return
        for i, ids in zip(positions, tokens):
            if len(ids) > source_limit:
                which = "the sentence" if single else f"sentence {i} of the list"
                raise ValueError(f"{which} is {len(ids):,} tokens long after the text pipeline (with </s>); this "
                                 f"model reads at most {source_limit:,} source positions (max_source_positions): "
                                 "split it into shorter sentences")


def _sentence_list(sentences) -> list:
    """SENTENCES as a list of str, or a TypeError naming what it is."""
    if not isinstance(sentences, (list, tuple)):
        raise TypeError(f"translate() takes a str or a list of str, got {type(sentences).__name__}")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise TypeError(f"translate() takes a str or a list of str; item {i} of the list is "
                            f"{type(sentence).__name__}")
    return list(sentences)


class TextPipelineHubInterface(CheckedHubInterface):
    """The checked hub interface whose ``encode`` / ``decode`` are TEXT (a ``TextPipeline``):
    ``translate``, ``sample`` and ``generate`` are fairseq's own, with their arguments checked."""

    def __init__(self, cfg, task, models, text):
        super().__init__(cfg, task, models)
        self.text_pipeline = text

    def encode(self, sentence: str) -> torch.LongTensor:
        """A raw sentence -> source ids (with the final </s>), by the recipe's steps."""
        return self.text_pipeline.encode(sentence).ids

    def decode(self, tokens) -> str:
        """Target ids -> detokenised text."""
        return self.text_pipeline.decode(tokens.tolist() if torch.is_tensor(tokens) else list(tokens))

    def describe_text_pipeline(self) -> dict:
        """The steps in force and where they come from (what ``fairseq-modattn serve`` prints)."""
        return self.text_pipeline.describe()


def _is_local(name: str) -> bool:
    return "://" not in name


def _checkpoint_location(model_name_or_path, checkpoint_file: str, archive_map: Optional[dict]):
    """(folder or archive name, checkpoint file names) for fairseq: a ``.pt`` file given as the
    path is split into its folder and name; a local folder must hold every checkpoint file."""
    name = str(model_name_or_path)
    if (archive_map and name in archive_map) or not _is_local(name):
        return name, checkpoint_file
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".pt":
        return str(path.parent), path.name
    if not path.exists():
        raise FromPretrainedError(f"{path} does not exist: pass the folder fairseq-train saved the checkpoint in "
                                  f"(--save-dir), or the checkpoint file")
    if path.is_dir():
        for part in checkpoint_file.split(os.pathsep):
            if not (path / part).is_file():
                found = ", ".join(sorted(p.name for p in path.glob("*.pt"))) or "none"
                raise FromPretrainedError(f"{path} holds no checkpoint {part} (checkpoint_file=); the checkpoints "
                                          f"there: {found}")
    return str(path), checkpoint_file


def _check_data_bin(model_dir: str, data_name_or_path: str) -> None:
    """A local data-bin must exist and hold the dictionaries (fairseq's own error is "Could not
    infer language pair" deep in a traceback). Its default "." is the checkpoint's folder."""
    if not _is_local(data_name_or_path) or not _is_local(model_dir):
        return
    data = data_name_or_path
    if data.startswith("."):
        data = os.path.join(model_dir, data)
    data = Path(data.split(os.pathsep)[0])
    if not data.is_dir():
        raise FromPretrainedError(f"data-bin {data} does not exist: pass data_name_or_path= the folder "
                                  "fairseq-preprocess (or fairseq-modattn prepare) wrote")
    if not any(data.glob("dict.*.txt")):
        raise FromPretrainedError(f"{data} holds no dictionaries (dict.SRC.txt, dict.TGT.txt): pass "
                                  "data_name_or_path= the data-bin the model was trained on (fairseq's default "
                                  "'.' is the checkpoint's folder)")


def no_recorded_pipeline_message(data_bin, source_lang: str) -> str:
    from ..data.manifest import MANIFEST

    return (f"{data_bin} records no text pipeline for {source_lang!r} (no \"text\" in a {MANIFEST} of "
            "fairseq-modattn prepare: plain fairseq-preprocess, or an earlier prepare), so raw text cannot be "
            "tokenised as the model's training text was: pass fairseq's own tokenizer='moses', bpe='subword_nmt', "
            "bpe_codes=PATH (fairseq then neither lower-cases nor normalises), or text_pipeline='guessed' for the "
            "guesses of fairseq-modattn serve, or make the data-bin with fairseq-modattn prepare")


def _text_pipeline(cfg, task, choice: str):
    """The ``TextPipeline`` of the loaded task's data-bin (rules 2 and 3), or None for fairseq's
    own encoders (a checkpoint that names them, without a record)."""
    from ..data.text_pipeline import TextPipeline, TextPipelineError
    from ..data.text_settings import recorded_settings

    data_bin = Path(str(task.cfg.data).split(os.pathsep)[0])
    src, tgt = task.cfg.source_lang, task.cfg.target_lang
    try:
        recorded = recorded_settings(data_bin, src)
    except ValueError as e:
        raise FromPretrainedError(str(e)) from None
    if recorded is None and choice != "guessed":
        if cfg.get("tokenizer") or cfg.get("bpe"):
            logger.info("%s records no text pipeline: the tokenizer / BPE the checkpoint names are applied", data_bin)
            return None
        raise FromPretrainedError(no_recorded_pipeline_message(data_bin, src))
    try:
        text = TextPipeline.from_data_bin(data_bin, task.source_dictionary, task.target_dictionary, src, tgt)
    except TextPipelineError as e:
        raise FromPretrainedError(str(e)) from None
    logger.info("text pipeline: %s (%s)", text.settings.steps(), text.origin)
    return text


def from_pretrained(model_name_or_path, checkpoint_file: str = "model.pt", data_name_or_path: str = ".",
                    text_pipeline: str = "recorded", archive_map: Optional[dict] = None, **kwargs):
    """fairseq's ``from_pretrained`` (same arguments; the keyword arguments override the
    checkpoint's args, ``user_dir=`` is imported) returning a hub interface whose ``translate``
    takes and gives raw text by the data-bin's recorded pipeline (see the module docstring).

    MODEL_NAME_OR_PATH: the checkpoint's folder (or the ``.pt`` file itself); CHECKPOINT_FILE:
    its name there (``a.pt:b.pt`` for an ensemble); DATA_NAME_OR_PATH: the data-bin (paths
    starting with "." are relative to the checkpoint's folder); TEXT_PIPELINE: ``"recorded"`` or
    ``"guessed"`` (without a record, the guesses of ``fairseq-modattn serve``)."""
    from fairseq import hub_utils

    import fairseq_modattn  # noqa: F401  (registers the models; the loading fixes of compat/)

    if text_pipeline not in TEXT_PIPELINES:
        raise FromPretrainedError(f"text_pipeline must be one of {', '.join(TEXT_PIPELINES)}, got {text_pipeline!r}")
    model_dir, checkpoint_file = _checkpoint_location(model_name_or_path, checkpoint_file, archive_map)
    _check_data_bin(model_dir, str(data_name_or_path))
    loaded = hub_utils.from_pretrained(model_dir, checkpoint_file, str(data_name_or_path), archive_map=archive_map,
                                       **kwargs)
    cfg, task, models = loaded["args"], loaded["task"], loaded["models"]
    fairseq_text = [k for k in FAIRSEQ_TEXT_KWARGS if kwargs.get(k)]
    if fairseq_text:
        from ..data.text_settings import recorded_settings

        data_bin = Path(str(task.cfg.data).split(os.pathsep)[0])
        try:
            recorded = recorded_settings(data_bin, task.cfg.source_lang)
        except ValueError:
            recorded = None
        if recorded is not None:
            logger.warning("%s given: fairseq's own encoders are applied, not the text pipeline %s records (%s)",
                           " and ".join(f"{k}=" for k in fairseq_text), data_bin, recorded.steps())
        return CheckedHubInterface(cfg, task, models)
    text = _text_pipeline(cfg, task, text_pipeline)
    if text is None:
        return CheckedHubInterface(cfg, task, models)
    return TextPipelineHubInterface(cfg, task, models, text)


class PretrainedWithTextPipeline:
    """Mixin first among a model class's bases: its ``from_pretrained`` is ``from_pretrained``
    above, and it names no downloadable archives (fairseq's ``TransformerModel.hub_models``
    names plain transformers, which are no models of this class)."""

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".",
                        text_pipeline="recorded", **kwargs):
        """Load a checkpoint of this package for ``translate(text)`` on raw text: see
        ``fairseq_modattn/models/hub_interface.py``."""
        return from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, text_pipeline=text_pipeline,
                               archive_map=cls.hub_models(), **kwargs)
