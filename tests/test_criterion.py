"""The criterion label_smoothed_cross_entropy_with_aux: its loss is

    L = CE_ls + sum_k w_k aux_k * scale,      scale = sample_size ("mean") or 1 ("sum"),

with CE_ls fairseq's label-smoothed cross-entropy summed over the real target tokens,

    CE_ls = sum_i (1 - eps - eps / (V - 1)) (-log p_i(y_i)) + eps / (V - 1) sum_v (-log p_i(v)),

computed here by hand. Each model is checked twice: one whose aux terms and weights the test
chooses (distinct values, no weight 1, so an ignored weight or a dropped term changes the
total), and the real models (a DMA transformer, which reports aux terms, and fairseq's
transformer, which reports none). The logged keys come from the model's declarations.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from fairseq.logging import metrics

import fairseq_modattn  # noqa: F401  (registers the criterion and the models)
from fairseq_modattn.criterions.label_smoothed_cross_entropy_with_aux import (
    LabelSmoothedCrossEntropyWithAuxCriterion,
)
from tiny_models import tiny_dictionary

EPS = 0.1
FAIRSEQ_KEYS = {"loss", "nll_loss", "ppl", "ce_loss"}


def hand_ce(lprobs, target, pad):
    """Label-smoothed cross-entropy, summed over the non-pad targets, in float64."""
    lprobs, vocab = lprobs.double(), lprobs.size(-1)
    eps_i = EPS / (vocab - 1)
    total = torch.zeros((), dtype=torch.float64)
    for b in range(target.size(0)):
        for t in range(target.size(1)):
            y = int(target[b, t])
            if y == pad:
                continue
            total = total + (1.0 - EPS - eps_i) * -lprobs[b, t, y] + eps_i * -lprobs[b, t].sum()
    return total


def reduced(logging_output):
    """What the criterion's reduce_metrics logs for one logging output: {key: value}."""
    with metrics.aggregate(new_root=True) as agg:
        LabelSmoothedCrossEntropyWithAuxCriterion.reduce_metrics([logging_output])
    return {k: float(v) for k, v in agg.get_smoothed_values().items()}


# ----------------------------------------------------------------------------- chosen terms
class Scripted(nn.Module):
    """A model stand-in with fixed logits (B, T, V); reports ``extra`` as it is given."""

    def __init__(self, logits, extra):
        super().__init__()
        self.logits, self.extra = logits, extra

    def forward(self, src_tokens, src_lengths, prev_output_tokens):
        return self.logits, dict(self.extra)

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        return torch.log_softmax(net_output[0], dim=-1)

    def get_targets(self, sample, net_output):
        return sample["target"]


class ScriptedWithAux(Scripted):
    aux_loss_names = ("first", "second", "third")
    aux_metric_names = ("rate",)


AUX = {"first": 0.3, "second": -1.7, "third": 2.5}
WEIGHTS = {"first": 0.5, "second": 3.0, "third": -2.0}


def scripted_case(with_aux, reduction="mean", seed=0):
    d = tiny_dictionary(12)
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(d.nspecial, len(d), (2, 4), generator=g)
    target[1, 2:] = d.pad()
    logits = torch.randn(2, 4, len(d), dtype=torch.float64, generator=g)
    sample = {
        "net_input": {"src_tokens": target, "src_lengths": torch.tensor([4, 4]), "prev_output_tokens": target},
        "target": target,
        "ntokens": int(target.ne(d.pad()).sum()),
    }
    if not with_aux:
        return Scripted(logits, {"attn": None}), sample, d
    extra = {
        "aux_losses": {k: torch.tensor(v, dtype=torch.float64) for k, v in AUX.items()},
        "aux_loss_weights": dict(WEIGHTS),
        "aux_reduction": reduction,
        "aux_metrics": {"rate": 0.25},
    }
    return ScriptedWithAux(logits, extra), sample, d


def criterion(d):
    task = SimpleNamespace(target_dictionary=d)
    return LabelSmoothedCrossEntropyWithAuxCriterion(task, sentence_avg=False, label_smoothing=EPS)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_total_is_ce_plus_every_weighted_term(reduction):
    model, sample, d = scripted_case(with_aux=True, reduction=reduction)
    loss, sample_size, logging = criterion(d)(model, sample)
    ce = hand_ce(torch.log_softmax(model.logits, -1), sample["target"], d.pad())
    scale = sample["ntokens"] if reduction == "mean" else 1
    expected = ce + scale * (0.5 * 0.3 + 3.0 * -1.7 - 2.0 * 2.5)
    assert sample_size == sample["ntokens"] == 6
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(logging["ce_loss"], ce, rtol=1e-12, atol=0)
    # the terms are logged unweighted (per sample_size unit), the metric as a mean over samples
    for name, value in AUX.items():
        assert float(logging[name]) == pytest.approx(value * scale, rel=1e-12)
    logged = reduced(logging)
    assert set(logged) == FAIRSEQ_KEYS | set(AUX) | {"rate"}
    assert logged["rate"] == pytest.approx(0.25)
    assert logged["second"] == pytest.approx(round(-1.7 * scale / sample_size, 4))


def test_total_without_aux_terms_is_the_cross_entropy():
    model, sample, d = scripted_case(with_aux=False)
    loss, _, logging = criterion(d)(model, sample)
    ce = hand_ce(torch.log_softmax(model.logits, -1), sample["target"], d.pad())
    torch.testing.assert_close(loss, ce, rtol=1e-12, atol=0)
    assert set(logging) == {"loss", "ce_loss", "nll_loss", "ntokens", "nsentences", "sample_size"}
    assert set(reduced(logging)) == FAIRSEQ_KEYS


def test_terms_the_model_does_not_declare_or_weigh_are_refused():
    model, sample, d = scripted_case(with_aux=True)
    model.extra["aux_losses"]["fourth"] = torch.tensor(1.0, dtype=torch.float64)
    with pytest.raises(KeyError, match="without a weight"):
        criterion(d)(model, sample)
    model.extra["aux_loss_weights"]["fourth"] = 1.0
    with pytest.raises(KeyError, match="does not declare"):
        criterion(d)(model, sample)


# ----------------------------------------------------------------------------- real models
TINY = [
    "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "16", "--decoder-ffn-embed-dim", "16",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]


@pytest.fixture
def real_case(tiny_model):
    """real_case(arch, *flags) -> (model, sample, task): a TINY model of ARCH in eval mode and a
    batch of two sentences."""
    return lambda arch, *extra: _real_case(tiny_model(arch, *TINY, *extra))


def _real_case(built):
    model, d, task, _ = built
    model.eval()  # eval: the same forward in the criterion and here
    if hasattr(model, "set_num_updates"):
        model.set_num_updates(1500)
    pad, eos = d.pad(), d.eos()
    src = torch.tensor([[5, 6, 7, 8, eos], [pad, pad, 9, 10, eos]])
    prev = torch.tensor([[eos, 11, 12, 13], [eos, 14, pad, pad]])
    target = torch.tensor([[11, 12, 13, eos], [14, eos, pad, pad]])
    sample = {
        "net_input": {"src_tokens": src, "src_lengths": torch.tensor([5, 3]), "prev_output_tokens": prev},
        "target": target,
        "ntokens": int(target.ne(pad).sum()),
    }
    return model, sample, task


@pytest.mark.parametrize("reduction", ["sentence", "token"])
def test_dma_total_is_ce_plus_its_weighted_regularisers(reduction, real_case):
    model, sample, task = real_case(
        "dma_transformer", "--dma-clusters", "3", "--dma-loss-reduction", reduction,
        "--dma-kl-weight", "0.5", "--dma-qq-weight", "3", "--dma-xq-weight", "2", "--dma-div-weight", "0.25",
    )
    crit = LabelSmoothedCrossEntropyWithAuxCriterion(task, sentence_avg=False, label_smoothing=EPS)
    with torch.no_grad():
        loss, sample_size, logging = crit(model, sample)
        net_output = model(**sample["net_input"])
    aux = {k: v.double() for k, v in net_output[1]["aux_losses"].items()}
    assert set(aux) == {"kl", "dqq", "dxq", "div"} and all(v.abs() > 0 for v in aux.values())
    ce = hand_ce(model.get_normalized_probs(net_output, log_probs=True), sample["target"], task.target_dictionary.pad())
    scale = 1 if reduction == "sentence" else sample_size  # the authors' sums, or per-token means
    # the weights from the flags, L_Dxq maximised (paper, Eq. 15)
    expected = ce + scale * (0.5 * aux["kl"] + 3 * aux["dqq"] - 2 * aux["dxq"] + 0.25 * aux["div"])
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    logged = reduced(logging)
    assert set(logged) == FAIRSEQ_KEYS | {"kl", "dqq", "dxq", "div", "gamma"}
    # gamma(t) = 1 - max(1 - alpha, exp(-r t)), alpha 0.9 and r 5e-4 (the architecture's), t = 1500
    assert logged["gamma"] == pytest.approx(1 - math.exp(-5e-4 * 1500), abs=1e-4)


def test_transformer_total_is_the_cross_entropy_and_logs_no_aux_keys(real_case):
    model, sample, task = real_case("transformer_iwslt_de_en")
    crit = LabelSmoothedCrossEntropyWithAuxCriterion(task, sentence_avg=False, label_smoothing=EPS)
    with torch.no_grad():
        loss, _, logging = crit(model, sample)
        net_output = model(**sample["net_input"])
    ce = hand_ce(model.get_normalized_probs(net_output, log_probs=True), sample["target"], task.target_dictionary.pad())
    torch.testing.assert_close(loss.double(), ce, rtol=1e-5, atol=1e-5)
    assert set(reduced(logging)) == FAIRSEQ_KEYS
