"""DMA's two objectives: the authors' (the default of the named architectures) and the paper's text.

Each term in each form against a naive reference written from the documented formula (loops
over sentences, heads, head pairs and tokens, float64); the authors' reduction against a hand
computation; the criterion's total; the presets; and the training sample fed to the attention.
"""

import math

import pytest
import torch

import fairseq_modattn  # noqa: F401  (registers the plugin)
from attention_helpers import DOUBLE, loss_inputs, make_dma, naive_posterior, padding, real_tokens, small_dma_model
from fairseq_modattn.criterions.label_smoothed_cross_entropy_with_aux import (
    LabelSmoothedCrossEntropyWithAuxCriterion,
)
from fairseq_modattn.models.dma_transformer import OBJECTIVES, DMATransformerModel
from fairseq_modattn.modules import DisentangledMaskAttention
from fairseq_modattn.modules.dma_attention import AUX_LOSS_NAMES
from fairseq_modattn.modules.mi_bounds import (
    BOUNDED_QQ_EPS,
    diversity_penalty,
    head_dependence_bound,
    head_dependence_estimates,
    infonce_bound,
    masked_token_mean,
)
from fairseq_modattn.modules.noise import standard_normal, standard_normal_like
from tiny_models import model_args

EMBED, HEADS = 16, 2  # make_dma's default width and heads


# ----------------------------------------------------------------------------- naive references
def naive_bounded_dqq(log_joint, log_post, valid):
    """Per sentence: (1/H^2) sum_{h != h'} mean_{i real} -log(1 + eps - min(1, p)),
    p = sum_c [p(q_i^h, c) / sum_{j real} p(q_j^h, c)] Q_ic^h'. Returns (per-sentence list,
    batch token mean)."""
    joint, post = log_joint.exp(), log_post.exp()
    bsz, heads, _, num_c = joint.shape
    sentences, total, count = [], 0.0, 0
    for b in range(bsz):
        idx, acc = real_tokens(valid, b), 0.0
        for h in range(heads):
            for h2 in range(heads):
                if h == h2:
                    continue
                for i in idx:
                    p = 0.0
                    for c in range(num_c):
                        share = joint[b, h, i, c].item() / sum(joint[b, h, j, c].item() for j in idx)
                        p += share * post[b, h2, i, c].item()
                    acc += -math.log(1.0 + BOUNDED_QQ_EPS - min(1.0, p))
        sentences.append(acc / (heads**2 * len(idx)) if idx else 0.0)
        total, count = total + acc / heads**2, count + len(idx)
    return sentences, total / count


def naive_club_per_sentence(log_joint, log_post, valid):
    """Per sentence: mean over h != h' of max(0, mean_{i real} [log S_ii - mean_{j real} log S_ij])."""
    joint, post = log_joint.exp(), log_post.exp()
    bsz, heads, _, num_c = joint.shape
    out = []
    for b in range(bsz):
        idx = real_tokens(valid, b)

        def log_s(h, h2, i, j):
            return math.log(sum(joint[b, h, j, c].item() / sum(joint[b, h, k, c].item() for k in idx)
                                * post[b, h2, i, c].item() for c in range(num_c)))

        pairs = []
        for h in range(heads):
            for h2 in range(heads):
                if h != h2:
                    est = sum(log_s(h, h2, i, i) - sum(log_s(h, h2, i, j) for j in idx) / len(idx) for i in idx)
                    pairs.append(max(0.0, est / len(idx)))
        out.append(sum(pairs) / len(pairs))
    return out


def naive_div(post, valid, form):
    """Per sentence, mean over heads of: paper (1/n) sum_ij ((CC^T)_ij - delta_ij)^2; entrywise
    (1/n^2) sum_ij w_ij (...)^2 with w 1.25 on the diagonal, 0.75 off it (C built explicitly)."""
    bsz, heads = post.shape[:2]
    out = []
    for b in range(bsz):
        idx = real_tokens(valid, b)
        n = len(idx)
        per_head = []
        for h in range(heads):
            c_mat = post[b, h, idx]
            diff = (c_mat @ c_mat.t() - torch.eye(n, dtype=post.dtype)) ** 2
            if form == "paper":
                per_head.append(diff.sum().item() / n)
            else:
                weight = torch.full((n, n), 0.75, dtype=post.dtype) + 0.5 * torch.eye(n, dtype=post.dtype)
                per_head.append((weight * diff).sum().item() / n**2)
        out.append(sum(per_head) / heads)
    return out


def naive_dxq_per_sentence(post, valid):
    bsz, heads, _, num_c = post.shape
    out = []
    for b in range(bsz):
        idx, acc = real_tokens(valid, b), 0.0
        for h in range(heads):
            def f(i, j, b=b, h=h):
                return sum(post[b, h, i, c].item() * post[b, h, j, c].item() for c in range(num_c))
            for i in idx:
                acc += f(i, i) - math.log(sum(math.exp(f(i, j)) for j in idx) / len(idx))
        out.append(acc / (heads * len(idx)))
    return out


# ----------------------------------------------------------------------------- the terms
@pytest.mark.parametrize("lengths", [[5, 3], [2, 5, 4], [5, 5]])
def test_bounded_head_dependence_matches_naive(lengths):
    log_joint, log_post, valid = loss_inputs(3, lengths)
    per_sentence, token_mean = naive_bounded_dqq(log_joint, log_post, valid)
    got = head_dependence_bound(log_joint, log_post, valid, form="bounded", per_sentence=True)
    torch.testing.assert_close(got, torch.tensor(per_sentence, dtype=DOUBLE), rtol=1e-10, atol=1e-12)
    assert head_dependence_bound(log_joint, log_post, valid, form="bounded").item() == pytest.approx(
        token_mean, rel=1e-10
    )


@pytest.mark.parametrize("lengths", [[5, 3], [2, 5, 4]])
def test_per_sentence_club_and_infonce_match_naive(lengths):
    log_joint, log_post, valid = loss_inputs(4, lengths)
    got = head_dependence_bound(log_joint, log_post, valid, form="club", per_sentence=True)
    torch.testing.assert_close(got, torch.tensor(naive_club_per_sentence(log_joint, log_post, valid), dtype=DOUBLE))
    post = log_post.exp()
    torch.testing.assert_close(
        infonce_bound(post, valid, per_sentence=True), torch.tensor(naive_dxq_per_sentence(post, valid), dtype=DOUBLE)
    )
    # per-sentence estimates pooled with the token counts give the batch's estimates back
    per_sentence = head_dependence_estimates(log_joint, log_post, valid, per_sentence=True)
    counts = valid.sum(1).to(DOUBLE).view(-1, 1, 1)
    torch.testing.assert_close((per_sentence * counts).sum(0) / counts.sum(),
                               head_dependence_estimates(log_joint, log_post, valid))


@pytest.mark.parametrize("form", ["paper", "entrywise"])
@pytest.mark.parametrize("lengths", [[5, 3], [1, 5, 4]])
def test_diversity_forms_match_naive(form, lengths):
    _, log_post, valid = loss_inputs(5, lengths)
    post = log_post.exp()
    expected = naive_div(post, valid, form)
    torch.testing.assert_close(
        diversity_penalty(post, valid, form, per_sentence=True), torch.tensor(expected, dtype=DOUBLE)
    )
    assert diversity_penalty(post, valid, form).item() == pytest.approx(sum(expected) / len(expected), rel=1e-10)


def test_entrywise_diversity_is_about_n_times_smaller_than_eq_14():
    # one-hot rows all in one cluster: CC^T is all ones; Eq. 14 gives (n^2 - n) / n = n - 1,
    # the entrywise mean 0.75 (n^2 - n) / n^2
    n = 8
    same = torch.zeros(1, 1, n, 4, dtype=DOUBLE)
    same[..., 0] = 1.0
    assert diversity_penalty(same, None, "paper").item() == pytest.approx(n - 1)
    assert diversity_penalty(same, None, "entrywise").item() == pytest.approx(0.75 * (n * n - n) / n**2)


def test_per_sentence_token_mean_matches_loop():
    values = torch.randn(3, 2, 4, dtype=DOUBLE)
    valid = ~padding([4, 1, 3], 4)
    got = masked_token_mean(values, valid, per_sentence=True)
    expected = [values[b, :, real_tokens(valid, b)].mean().item() for b in range(3)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=DOUBLE))


def test_new_forms_ignore_padded_values_and_give_them_no_gradient():
    log_joint, log_post, valid = loss_inputs(6, [5, 2])
    garbage_joint, garbage_post = log_joint.clone(), log_post.clone()
    garbage_joint[~valid.unsqueeze(1).expand_as(log_joint[..., 0])] = 50.0
    garbage_post[~valid.unsqueeze(1).expand_as(log_post[..., 0])] = -30.0
    for per_sentence in (False, True):
        torch.testing.assert_close(
            head_dependence_bound(garbage_joint, garbage_post, valid, form="bounded", per_sentence=per_sentence),
            head_dependence_bound(log_joint, log_post, valid, form="bounded", per_sentence=per_sentence),
        )
        torch.testing.assert_close(
            diversity_penalty(garbage_post.exp(), valid, "entrywise", per_sentence),
            diversity_penalty(log_post.exp(), valid, "entrywise", per_sentence),
        )
    joint = log_joint.clone().requires_grad_()
    head_dependence_bound(joint, log_post, valid, form="bounded").backward()
    assert joint.grad[~valid.unsqueeze(1).expand_as(joint[..., 0])].abs().max() == 0


def test_bounded_head_dependence_is_positive_with_a_gradient_and_passes_gradcheck():
    log_joint, log_post, valid = loss_inputs(7, [4, 3], heads=2, max_len=4, num_c=3)
    joint, post = log_joint.clone().requires_grad_(), log_post.clone().requires_grad_()
    value = head_dependence_bound(joint, post, valid, form="bounded")
    assert value.item() > 0
    value.backward()
    assert joint.grad.abs().sum() > 0 and post.grad.abs().sum() > 0
    assert torch.autograd.gradcheck(
        lambda a, b: head_dependence_bound(a, b, valid, form="bounded", per_sentence=True),
        (joint.detach().requires_grad_(), post.detach().requires_grad_())
    )
    assert torch.autograd.gradcheck(
        lambda p: diversity_penalty(p, valid, "entrywise", per_sentence=True), (post.detach().exp().requires_grad_(),)
    )


def test_unknown_forms_are_refused():
    log_joint, log_post, valid = loss_inputs(8, [3])
    with pytest.raises(ValueError, match="L_Dqq form"):
        head_dependence_bound(log_joint, log_post, valid, form="nope")
    with pytest.raises(ValueError, match="L_dv form"):
        diversity_penalty(log_post.exp(), valid, "nope")
    with pytest.raises(ValueError, match="qq_form must be one of"):
        DisentangledMaskAttention(EMBED, HEADS, qq_form="nope")


# ----------------------------------------------------------------------------- the sample
def sampling_dma(**kwargs):
    """This section's DMA module in float64: sampling noise s^2 = 0.01, alpha = 0.9, annealed to
    t = 2000."""
    return make_dma(0, alpha=0.9, noise_var=0.01, num_updates=2000, randomise=("biases", "token_gmm"),
                    **kwargs).double()


def test_training_sample_feeds_the_query_projection_and_the_logits():
    """Self-attention in training with sample_inputs="attention": x~ = x + s eps is what the token
    GMM clusters and the query projection reads; keys and values read x; the queries are
    sampled again, q~ = q + s eps', and the logits are q~ k^T / sqrt(d)."""
    m = sampling_dma(sample_inputs="attention", self_attention=True).train()
    length, bsz = 5, 2
    x = torch.randn(length, bsz, EMBED, dtype=DOUBLE)
    torch.manual_seed(11)
    out, _ = m(x, x, x)
    torch.manual_seed(11)  # the module draws eps for the input first, then eps' for the queries
    eps = standard_normal_like(x)
    eps_q = standard_normal((bsz, HEADS, length, EMBED // HEADS), DOUBLE, x.device)

    s, d = math.sqrt(m.noise_var), EMBED // HEADS
    x_tilde = x + s * eps

    def lin(layer, t):
        return t @ layer.weight.detach().t() + layer.bias.detach()

    def heads(t):
        return t.view(length, bsz, HEADS, d).permute(1, 2, 0, 3)

    q = heads(lin(m.q_proj, x_tilde)) + s * eps_q
    k, v = heads(lin(m.k_proj, x)), heads(lin(m.v_proj, x))
    post = naive_posterior(heads(x_tilde), m.token_gmm)  # both sides of self-attention
    mask = post @ post.transpose(-1, -2)
    plain = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    masked = mask * plain
    masked = masked / masked.sum(-1, keepdim=True)
    final = (1 - m.gamma) * plain + m.gamma * masked
    expected = lin(m.out_proj, (final @ v).permute(2, 0, 1, 3).reshape(length, bsz, EMBED))
    torch.testing.assert_close(out, expected)


def test_scaled_query_gmm_clusters_q_over_sqrt_d_and_the_logits_carry_its_sample():
    """query_gmm_input="scaled" (the authors' code): the query GMM clusters u = q / sqrt(d) with
    the sample u~ = u + s eps'; the logits are u~ k^T, so the queries carry sqrt(d) s eps'."""
    m = sampling_dma(sample_inputs="attention", self_attention=True, query_gmm_input="scaled").train()
    seen = {}
    # the GMM is handed q, its scale and the sampled q~ (the tensor the attention reads), and
    # clusters u = scale q with the sample u~ = scale q~ = u + s eps'
    m.query_gmm.register_forward_hook(
        lambda mod, args, kwargs, out: seen.update(
            u=kwargs["scale"] * args[0],
            eps=kwargs["scale"] * (kwargs["point"] - args[0]) / math.sqrt(m.noise_var),
        ),
        with_kwargs=True,
    )
    length, bsz = 5, 2
    s, d = math.sqrt(m.noise_var), EMBED // HEADS
    x = torch.randn(length, bsz, EMBED, dtype=DOUBLE)
    torch.manual_seed(5)
    m.collect_aux = True
    out, _ = m(x, x, x)
    torch.manual_seed(5)  # eps for the input first, then eps' for the queries
    eps = standard_normal_like(x)
    eps_q = standard_normal((bsz, HEADS, length, d), DOUBLE, x.device)

    def heads(layer, t):
        t = t @ layer.weight.detach().t() + layer.bias.detach()
        return t.view(length, bsz, HEADS, d).permute(1, 2, 0, 3)

    x_tilde = x + s * eps
    q, k, v = heads(m.q_proj, x_tilde), heads(m.k_proj, x), heads(m.v_proj, x)
    torch.testing.assert_close(seen["u"], q / math.sqrt(d))
    torch.testing.assert_close(seen["eps"], eps_q)
    u_tilde = q / math.sqrt(d) + s * eps_q
    post = naive_posterior(x_tilde.view(length, bsz, HEADS, d).permute(1, 2, 0, 3), m.token_gmm)
    plain = torch.softmax(u_tilde @ k.transpose(-1, -2), -1)
    masked = (post @ post.transpose(-1, -2)) * plain
    final = (1 - m.gamma) * plain + m.gamma * masked / masked.sum(-1, keepdim=True)
    attended = (final @ v).permute(2, 0, 1, 3).reshape(length, bsz, EMBED)
    torch.testing.assert_close(out, attended @ m.out_proj.weight.detach().t() + m.out_proj.bias.detach())
    assert all(torch.isfinite(value).all() for value in m.aux_losses.values())


def test_encoder_decoder_sample_reaches_keys_not_values_and_nothing_at_inference():
    m = sampling_dma(sample_inputs="attention", encoder_decoder_attention=True)
    seen = {}
    m.k_proj.register_forward_hook(lambda mod, inp, out: seen.__setitem__("k", inp[0]))
    m.v_proj.register_forward_hook(lambda mod, inp, out: seen.__setitem__("v", inp[0]))
    m.q_proj.register_forward_hook(lambda mod, inp, out: seen.__setitem__("q", inp[0]))
    x, enc = torch.randn(3, 2, EMBED, dtype=DOUBLE), torch.randn(4, 2, EMBED, dtype=DOUBLE)
    m.train()
    m(x, enc, enc)
    assert not torch.equal(seen["k"], enc) and not torch.equal(seen["q"], x)
    assert torch.equal(seen["v"], enc)
    assert (seen["k"] - enc).std().item() == pytest.approx(0.1, rel=0.3)  # s = sqrt(0.01)
    m.eval()
    out_eval, _ = m(x, enc, enc)
    assert torch.equal(seen["k"], enc) and torch.equal(seen["q"], x)
    reference = sampling_dma(sample_inputs="gmm", encoder_decoder_attention=True).eval()
    torch.testing.assert_close(out_eval, reference(x, enc, enc)[0], rtol=0, atol=0)


# ----------------------------------------------------------------------------- presets
def test_named_architectures_default_to_the_authors_objective_with_table_5_weights():
    args = model_args("dma_transformer_iwslt_de_en_tiny")
    for name, value in OBJECTIVES["authors"].items():
        assert getattr(args, name) == value, name
    assert (args.dma_qq_weight, args.dma_xq_weight, args.dma_kl_weight, args.dma_div_weight) == (50.0, 5.0, 0.01, 1.0)
    assert (args.dma_centroid_grad_mult, args.dma_clusters, args.dma_anneal_rate) == (10.0, 4, 5e-4)
    assert args.dma_objective == "authors"


def test_paper_objective_is_one_flag_away_and_single_flags_still_override():
    args = model_args("dma_transformer_iwslt_de_en", "--dma-objective", "paper")
    for name, value in OBJECTIVES["paper"].items():
        assert getattr(args, name) == value, name
    args = model_args("dma_transformer", "--dma-objective", "paper", "--dma-alpha", "0.7", "--dma-qq-form", "bounded")
    assert (args.dma_alpha, args.dma_qq_form, args.dma_div_form) == (0.7, "bounded", "paper")
    with pytest.raises(SystemExit):
        model_args("dma_transformer", "--dma-objective", "neither")


@pytest.mark.parametrize("alias, ours, clusters", [
    ("disentangled_transformer", "dma_transformer_iwslt_de_en", 4),
    ("disentangled_transformer_iwslt_de_en", "dma_transformer_iwslt_de_en", 8),
    ("disentangled_transformer_iwslt_de_en_small", "dma_transformer_iwslt_de_en_small", 4),
    ("disentangled_transformer_iwslt_de_en_tiny", "dma_transformer_iwslt_de_en_tiny", 4),
    ("disentangled_transformer_wmt_en_de", "dma_transformer_wmt_en_de", 4),
    ("disentangled_transformer_wmt_en_de_small", "dma_transformer_wmt_en_de_small", 4),
])
def test_the_authors_architecture_names_are_aliases(alias, ours, clusters):
    got, expected = vars(model_args(alias)), vars(model_args(ours))
    assert got.pop("arch") == alias and expected.pop("arch") == ours
    expected["dma_clusters"] = clusters  # their base architecture defaults to 4 clusters
    assert got == expected


# ----------------------------------------------------------------------------- reduction
@pytest.fixture
def build_model(tiny_model):
    """build_model(*flags) -> (model, dictionary, task): attention_helpers.small_dma_model at update 1500."""
    def build(*extra):
        model, dictionary, task, _ = small_dma_model(tiny_model, *extra)
        model.set_num_updates(1500)
        return model, dictionary, task

    return build


class _Reported:
    def __init__(self, attention_type, values):
        self.attention_type = attention_type
        self.aux_losses = {name: torch.tensor(values, dtype=DOUBLE) for name in AUX_LOSS_NAMES}


def test_authors_reduction_by_hand(build_model):
    """Per type the mean over its layers of the per-sentence values, summed over the two
    sentences, then summed over the types."""
    model, _, _ = build_model()
    modules = [
        _Reported("enc_self", [1.0, 2.0]), _Reported("enc_self", [3.0, 6.0]),  # layer mean [2, 4] -> 6
        _Reported("dec_self", [0.5, 0.25]), _Reported("dec_self", [1.5, 0.75]),  # [1, 0.5] -> 1.5
        _Reported("enc_dec", [10.0, 20.0]), _Reported("enc_dec", [0.0, 0.0]),  # [5, 10] -> 15
    ]
    reduced = model.reduce_aux_losses(modules, torch.zeros(()))
    assert all(reduced[name].item() == pytest.approx(6.0 + 1.5 + 15.0) for name in AUX_LOSS_NAMES)
    model.args.dma_loss_reduction = "token"
    modules = [_Reported("enc_self", 2.0), _Reported("dec_self", 4.0), _Reported("enc_dec", 9.0)]
    assert model.reduce_aux_losses(modules, torch.zeros(()))["kl"].item() == pytest.approx(5.0)


def batch(dictionary, sources, targets):
    """Left-padded sources and right-padded decoder inputs (eos first), as fairseq collates them."""
    pad, eos = dictionary.pad(), dictionary.eos()
    src = torch.full((len(sources), max(map(len, sources))), pad)
    for b, s in enumerate(sources):
        src[b, src.size(1) - len(s):] = torch.tensor(s)
    prev = torch.full((len(targets), max(map(len, targets)) + 1), pad)
    tgt = torch.full_like(prev, pad)
    for b, t in enumerate(targets):
        prev[b, : len(t) + 1] = torch.tensor([eos, *t])
        tgt[b, : len(t) + 1] = torch.tensor([*t, eos])
    lengths = torch.tensor(list(map(len, sources)))
    return src, lengths, prev, tgt


def test_sentence_sums_of_a_padded_batch_equal_the_sums_of_its_sentences(build_model):
    """With the authors' reduction a batch's value is the sum of its sentences' values: padding
    adds nothing, and no sentence's value depends on the other one (evaluation mode)."""
    model, dictionary, _ = build_model()
    model.eval()
    sources, targets = [[5, 6, 7, 8, 9, 10], [11, 12, 13]], [[5, 9, 14, 15], [16, 17]]
    with torch.no_grad():
        src, lengths, prev, _ = batch(dictionary, sources, targets)
        together = model(src, lengths, prev)[1]["aux_losses"]
        alone = []
        for s, t in zip(sources, targets):
            src, lengths, prev, _ = batch(dictionary, [s], [t])
            alone.append(model(src, lengths, prev)[1]["aux_losses"])
    for name in AUX_LOSS_NAMES:
        torch.testing.assert_close(together[name], alone[0][name] + alone[1][name], msg=name)
        assert together[name].abs() > 0, name


@pytest.mark.parametrize("reduction", ["sentence", "token"])
def test_criterion_total_is_ce_plus_weighted_aux(reduction, build_model):
    """L = CE_sum + sum_k w_k aux_k (the authors' sums) or CE_sum + sum_k w_k aux_k * ntokens
    (per-token means), with w_dxq = -c_xq."""
    model, dictionary, task = build_model("--dma-loss-reduction", reduction, "--dma-kl-weight", "0.5",
                                          "--dma-qq-weight", "3", "--dma-xq-weight", "2", "--dma-div-weight", "0.25")
    model.eval()
    src, lengths, prev, tgt = batch(dictionary, [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]])
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
              "target": tgt, "ntokens": int(tgt.ne(dictionary.pad()).sum())}
    criterion = LabelSmoothedCrossEntropyWithAuxCriterion(task, sentence_avg=False, label_smoothing=0.1)
    with torch.no_grad():
        loss, sample_size, logging = criterion(model, sample)
        net_output = model(**sample["net_input"])
        ce, _ = criterion.compute_loss(model, net_output, sample)
    aux = net_output[1]["aux_losses"]
    assert net_output[1]["aux_reduction"] == ("sum" if reduction == "sentence" else "mean")
    scale = 1 if reduction == "sentence" else sample_size
    expected = ce + (0.5 * aux["kl"] + 3 * aux["dqq"] - 2 * aux["dxq"] + 0.25 * aux["div"]) * scale
    torch.testing.assert_close(loss, expected)
    assert logging["dqq"].item() == pytest.approx(aux["dqq"].item() * scale)


def test_model_class_declares_the_reduction_it_reports(build_model):
    model, dictionary, _ = build_model("--dma-objective", "paper")
    model.train()
    src, lengths, prev, _ = batch(dictionary, [[5, 6, 7]], [[8, 9]])
    extra = model(src, lengths, prev)[1]
    assert extra["aux_reduction"] == "mean" and isinstance(model, DMATransformerModel)
    assert all(v.dim() == 0 for v in extra["aux_losses"].values())


def test_the_authors_criterion_name_is_an_alias():
    from fairseq.criterions import CRITERION_REGISTRY

    alias = CRITERION_REGISTRY["disentangled_label_smoothed_cross_entropy"]
    assert issubclass(alias, LabelSmoothedCrossEntropyWithAuxCriterion)


def test_gmm_initialisations():
    """xavier (the authors'): N(0, 2 / ((n_c + G) d)) centres and log-variances and
    N(0, 2 / (n_c + G)) logits, so the first posteriors of unit-scale inputs are soft;
    spread: N(0, 1) centres and unit variances, peaked first posteriors."""
    from fairseq_modattn.modules import DiagonalGMM

    torch.manual_seed(0)
    groups, clusters, dim = 4, 8, 256
    xavier = DiagonalGMM(clusters, dim, groups)
    assert xavier.means.std().item() == pytest.approx(math.sqrt(2 / ((clusters + groups) * dim)), rel=0.05)
    assert xavier.log_vars.std().item() == pytest.approx(math.sqrt(2 / ((clusters + groups) * dim)), rel=0.05)
    assert xavier.logits.std().item() == pytest.approx(math.sqrt(2 / (clusters + groups)), rel=0.5)
    spread = DiagonalGMM(clusters, dim, groups, init="spread")
    assert spread.means.std().item() == pytest.approx(1.0, rel=0.05)
    assert torch.all(spread.log_vars == 0) and torch.all(spread.logits == 0)
    x = torch.randn(2, groups, 50, 32)  # a head of the tiny preset: mean top posterior 0.28 / 0.84
    top_xavier = DiagonalGMM(clusters, 32, groups)(x).log_post.exp().amax(-1).mean().item()
    top_spread = DiagonalGMM(clusters, 32, groups, init="spread")(x).log_post.exp().amax(-1).mean().item()
    assert top_xavier < 0.5 < 0.75 < top_spread
    with pytest.raises(ValueError, match="init must be one of"):
        DiagonalGMM(clusters, dim, groups, init="nope")


def test_infonce_block_by_block_matches_naive(monkeypatch):
    """With one sentence per block (blocking.BLOCK_ELEMENTS) L_Dxq and its gradient are unchanged."""
    from fairseq_modattn.modules import blocking

    _, log_post, valid = loss_inputs(9, [5, 2, 4])
    post = log_post.exp().requires_grad_()
    whole = infonce_bound(post, valid, per_sentence=True)
    (grad_whole,) = torch.autograd.grad(whole.sum(), post)
    monkeypatch.setattr(blocking, "BLOCK_ELEMENTS", 3 * 5 * 5)
    assert len(blocking.sentence_blocks(3, 3 * 5 * 5)) == 3
    blocked = infonce_bound(post, valid, per_sentence=True)
    torch.testing.assert_close(blocked, torch.tensor(naive_dxq_per_sentence(post.detach(), valid), dtype=DOUBLE))
    torch.testing.assert_close(torch.autograd.grad(blocked.sum(), post)[0], grad_whole)
    assert torch.autograd.gradcheck(lambda p: infonce_bound(p, valid, per_sentence=True), (post,))
