"""Label-smoothed cross-entropy plus the auxiliary losses a model reports,

    L = CE_ls + sum_k w_k aux_k,

e.g. DMA's L = CE_ls + c_kl KL + c_qq L_Dqq - c_xq L_Dxq + c_dv L_dv (DMA paper, Eq. 15).

What a model declares, as class attributes (a model without them has no aux terms):

    aux_loss_names    the terms it reports (DMA: kl, dqq, dxq, div);
    aux_metric_names  values it reports for the log only (DMA: gamma).

In each forward it puts them in its decoder output's ``extra`` dict: ``aux_losses`` (name ->
scalar), ``aux_loss_weights`` (name -> signed weight w_k; the architecture holds the paper's
values), ``aux_reduction`` and ``aux_metrics`` (name -> number). fairseq sums CE over target
tokens and divides the gradient by ``sample_size``, so

    * "mean" (default): each aux term is a mean (per token or sentence, see
      ``modules/mi_bounds.py``) and enters the loss multiplied by ``sample_size``: the weights
      are per target token and do not depend on the batch size;
    * "sum": each aux term is already a sum over the batch's sentences (the DMA authors'
      reduction) and enters the loss as it is, so it is divided by ``sample_size`` together
      with the cross-entropy.

Models without aux terms (a plain transformer) train with plain label-smoothed CE.

Logged every interval and in validation:
    loss, nll_loss   fairseq's (base 2, per token)
    ce_loss          the label-smoothed cross-entropy alone (base 2, per token)
    each aux term    unweighted (nats, per sample_size unit: with the "sum" reduction the
                     sentence sums divided by the target tokens)
    each aux metric  its mean over the samples (DMA: gamma, the mask weight in force)

The model's declarations fix the keys, so that every rank emits the same ones (0 for a value
a forward did not report) and fairseq's summed statistics stay in sync across ranks.
"""

import math
from dataclasses import dataclass

from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics

#: the criterion's own logging keys: every other public key is a model's aux term or metric
OWN_KEYS = ("loss", "ce_loss", "nll_loss", "ntokens", "nsentences", "sample_size", "n_correct", "total")


@dataclass
class LabelSmoothedCrossEntropyWithAuxConfig(LabelSmoothedCrossEntropyCriterionConfig):
    pass


@register_criterion("label_smoothed_cross_entropy_with_aux", dataclass=LabelSmoothedCrossEntropyWithAuxConfig)
class LabelSmoothedCrossEntropyWithAuxCriterion(LabelSmoothedCrossEntropyCriterion):
    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        ce_loss, nll_loss = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]

        extra = net_output[1] if isinstance(net_output[1], dict) else {}
        aux = extra.get("aux_losses") or {}
        weights = extra.get("aux_loss_weights") or {}
        aux_metrics = extra.get("aux_metrics") or {}
        loss_names = tuple(getattr(model, "aux_loss_names", ()))
        metric_names = tuple(getattr(model, "aux_metric_names", ()))
        unknown = set(aux) - set(weights)
        if unknown:
            raise KeyError(f"the model reports aux losses {sorted(unknown)} without a weight")
        undeclared = (set(aux) - set(loss_names)) | (set(aux_metrics) - set(metric_names))
        if undeclared:
            raise KeyError(
                f"the model reports {sorted(undeclared)} but does not declare them in its aux_loss_names / "
                "aux_metric_names (the criterion logs the declared names on every rank)"
            )
        reduction = extra.get("aux_reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"the model reports aux_reduction {reduction!r}; expected 'mean' or 'sum'")
        scale = sample_size if reduction == "mean" else 1
        loss = ce_loss
        for name, value in aux.items():
            if weights[name] != 0.0:
                loss = loss + weights[name] * value * scale

        logging_output = {
            "loss": loss.data,
            "ce_loss": ce_loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        for name in loss_names:
            logging_output[name] = aux[name].data * scale if name in aux else 0.0
        for name in metric_names:
            logging_output[name] = float(aux_metrics.get(name, 0.0)) * sample_size
        if self.report_accuracy:
            n_correct, total = self.compute_accuracy(model, net_output, sample)
            logging_output["n_correct"] = utils.item(n_correct.data)
            logging_output["total"] = utils.item(total.data)
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        if sample_size == 0:
            return
        ce_sum = sum(log.get("ce_loss", 0) for log in logging_outputs)
        metrics.log_scalar("ce_loss", ce_sum / sample_size / math.log(2), sample_size, round=3)
        # the model's terms and metrics, found as fairseq's own ModelCriterion finds a model's
        # losses: the public keys beyond the criterion's (fairseq's tasks prefix theirs with "_")
        names = dict.fromkeys(k for log in logging_outputs for k in log if k not in OWN_KEYS and not k.startswith("_"))
        for name in names:
            total = sum(log.get(name, 0) for log in logging_outputs)
            metrics.log_scalar(name, utils.item(total) / sample_size, sample_size, round=4)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


@register_criterion("disentangled_label_smoothed_cross_entropy", dataclass=LabelSmoothedCrossEntropyWithAuxConfig)
class DisentangledLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyWithAuxCriterion):
    """The name the DMA authors' code registers its criterion under, for their commands; the
    same criterion as ``label_smoothed_cross_entropy_with_aux``."""
