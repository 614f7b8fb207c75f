"""The tiny models of every family, built and trained in-process as fairseq-train builds them.

``train_args(family)`` are fairseq-train flags (without data and --save-dir) of the tiny
``transformer``, ``dma``, ``tim``, ``rim`` (conftest.TINY_MODELS) and ``talking_heads`` model
(the tiny transformer's sizes, talking heads in all three attention types).
``build_trainer`` parses them with fairseq-train's own parser and returns fairseq's ``Trainer``;
``batches`` yields training batches epoch after epoch, in fairseq-train's order.
"""

from fairseq import tasks, utils
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.trainer import Trainer

import tiers
from conftest import tiny_train_args
from tiny_models import parse_training_command

# a later --arch overrides the tiny transformer's
TALKING_HEADS = ["--arch", "talking_heads_transformer_iwslt_de_en", "--th-attention", "enc_self,dec_self,enc_dec"]
FAMILIES = ("transformer", "dma", "tim", "rim", "talking_heads")


def train_args(family):
    """fairseq-train flags (without data and --save-dir) of the tiny model of FAMILY."""
    if family == "talking_heads":
        return [*tiny_train_args("transformer"), *TALKING_HEADS]
    return tiny_train_args(family)


@tiers.trains
def build_trainer(data, family, save_dir, *extra):
    """fairseq's Trainer of FAMILY's tiny model (flags EXTRA appended), seeded as fairseq-train seeds."""
    args = parse_training_command([data, *train_args(family), *extra, "--save-dir", save_dir])
    cfg = convert_namespace_to_omegaconf(args)
    utils.set_torch_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return Trainer(cfg, task, model, criterion)


def batches(trainer):
    """Training batches, epoch after epoch, as fairseq-train draws them."""
    epoch_itr = trainer.get_train_iterator(epoch=1)
    while True:
        trainer.begin_epoch(epoch_itr.next_epoch_idx)
        yield from epoch_itr.next_epoch_itr(shuffle=True)
