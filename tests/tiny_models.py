"""Tiny models built as fairseq-train builds them, for the model-level tests.

``model_args(arch, *flags)`` parses a command line with fairseq-train's own parser and the
plugin loaded (``--user-dir``), which fills the architecture's defaults and runs the flags'
checks; ``training_parser`` returns that parser too, with the architecture's and criterion's
arguments added. ``tiny_model(arch, *flags)`` builds the model of those flags through a
translation task over a small dictionary of made-up words (``tiny_dictionary``), after
``torch.manual_seed(seed)``; the tests get it as conftest's ``tiny_model`` fixture.

Like ``attention_helpers.py`` this is no test file; the tests import it as they import
``conftest`` (tests/ has no ``__init__.py``, so pytest puts it on ``sys.path``).
"""

from typing import NamedTuple, Union

import torch
from fairseq import models, options
from fairseq.data import Dictionary
from fairseq.tasks.translation import TranslationTask

from conftest import PLUGIN


def parse_training_command(argv, parser=None):
    """fairseq-train's parsing of the whole command line ARGV (data first): the args."""
    parser = parser or options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=[str(a) for a in argv])


def training_parser(arch, *flags, task="translation"):
    """(parser, args): fairseq-train's parser after parsing ``--arch ARCH FLAGS`` with the plugin
    loaded (parsing adds the architecture's and the criterion's arguments to the parser)."""
    parser = options.get_training_parser()
    args = parse_training_command(
        ["/nonexistent", "--user-dir", PLUGIN, "--task", task, "--arch", arch, *flags], parser)
    return parser, args


def model_args(arch, *flags, task="translation"):
    """fairseq-train's args of ``--arch ARCH FLAGS`` with the plugin loaded."""
    return training_parser(arch, *flags, task=task)[1]


def tiny_dictionary(size=20, padding_factor=None):
    """A dictionary of fairseq's 4 special symbols and SIZE words ``w0``, ``w1``, ...; finalized
    with PADDING_FACTOR when one is given (fairseq-preprocess finalizes with 8)."""
    d = Dictionary()
    for i in range(size):
        d.add_symbol(f"w{i}")
    if padding_factor is not None:
        d.finalize(padding_factor=padding_factor)
    return d


class TinyModel(NamedTuple):
    model: torch.nn.Module
    dictionary: Dictionary
    task: TranslationTask
    args: object

    def criterion(self):
        """The criterion the args name, built as fairseq-train builds it."""
        return self.task.build_criterion(self.args)


def build(args, dictionary, seed=0) -> TinyModel:
    """The model of ARGS on a translation task whose source and target dictionary is DICTIONARY
    (fairseq's ``models.build_model``: the task's own ``build_model`` would also set up the
    tokenizer and BPE of ``--eval-bleu``)."""
    task = TranslationTask(args, dictionary, dictionary)
    torch.manual_seed(seed)
    return TinyModel(models.build_model(args, task), dictionary, task, args)


def tiny_model(arch, *flags, dictionary: Union[int, Dictionary] = 20, seed=0) -> TinyModel:
    """The model of ``--arch ARCH FLAGS`` (model, dictionary, task, args) over DICTIONARY (a
    Dictionary, or the size of a ``tiny_dictionary``), its weights drawn after ``manual_seed(seed)``."""
    if isinstance(dictionary, int):
        dictionary = tiny_dictionary(dictionary)
    return build(model_args(arch, *flags), dictionary, seed)
