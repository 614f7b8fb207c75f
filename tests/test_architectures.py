"""Named architectures carry the paper's Table 5 configurations; bad settings fail clearly."""

import argparse

import pytest
import torch

import fairseq_modattn  # noqa: F401
from fairseq_modattn.modules import DisentangledMaskAttention
from tiny_models import model_args

# arch: (embed, ffn, heads, n_c, c_qq, c_xq, c_grad)
TABLE5 = {
    "dma_transformer_iwslt_de_en": (512, 1024, 4, 8, 100, 10, 10),
    "dma_transformer_iwslt_de_en_small": (384, 1024, 4, 4, 100, 10, 10),
    "dma_transformer_iwslt_de_en_tiny": (256, 512, 4, 4, 50, 5, 10),
    "dma_transformer_wmt_en_de": (512, 2048, 8, 4, 100, 10, 10),
    "dma_transformer_wmt_en_de_small": (384, 2048, 8, 4, 100, 10, 10),
    "dma_transformer_wmt_zh_en": (512, 1024, 4, 4, 50, 5, 5),
}


@pytest.mark.parametrize("arch", sorted(TABLE5))
def test_paper_configuration(arch):
    embed, ffn, heads, clusters, c_qq, c_xq, c_grad = TABLE5[arch]
    args = model_args(arch)
    for side in ("encoder", "decoder"):
        assert getattr(args, f"{side}_embed_dim") == embed
        assert getattr(args, f"{side}_ffn_embed_dim") == ffn
        assert getattr(args, f"{side}_attention_heads") == heads
        assert getattr(args, f"{side}_layers") == 6
    assert (args.dma_clusters, args.dma_qq_weight, args.dma_xq_weight, args.dma_centroid_grad_mult) == (
        clusters, c_qq, c_xq, c_grad)
    assert args.dma_kl_weight == 0.01
    assert args.dma_decoder_mask_at_inference is False


def test_command_line_overrides_architecture_defaults():
    args = model_args("dma_transformer_iwslt_de_en", "--dma-clusters", "12", "--dma-qq-weight", "3",
                 "--dma-kl-weight", "0.5", "--encoder-embed-dim", "256", "--dma-decoder-mask-at-inference")
    assert (args.dma_clusters, args.dma_qq_weight, args.dma_kl_weight, args.encoder_embed_dim) == (12, 3, 0.5, 256)
    assert args.dma_decoder_mask_at_inference is True


def test_every_dma_flag_has_help_text():
    # fairseq-train -h prints its help before the architecture's flags are added (fairseq
    # parses twice), so the flags' help is checked on the model's own argument group.
    from fairseq_modattn.models.dma_transformer import DMATransformerModel

    parser = argparse.ArgumentParser()
    DMATransformerModel.add_args(parser)
    text = parser.format_help()
    for flag in ("--dma-clusters", "--dma-attention", "--dma-alpha", "--dma-anneal-rate", "--dma-noise-var",
                 "--dma-kl-weight", "--dma-qq-weight", "--dma-xq-weight", "--dma-div-weight",
                 "--dma-centroid-grad-mult", "--dma-decoder-mask-at-inference"):
        assert flag in text
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    assert all(actions[f].help for f in actions if f.startswith("--dma-"))


#: one layer each side, width 32 (test_dma_compiled builds with them too)
SMALL = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32"]


@pytest.fixture
def build(tiny_model):
    """build(*flags, arch=...) -> (model, args) of a SMALL model of ARCH."""
    def build(*extra, arch="dma_transformer_iwslt_de_en_tiny"):
        built = tiny_model(arch, *SMALL, *extra)
        return built.model, built.args

    return build


def test_built_model_uses_dma_where_asked_and_exact_cluster_count(build):
    model, _ = build("--dma-clusters", "5", "--dma-attention", "enc_self,enc_dec")
    assert isinstance(model.encoder.layers[0].self_attn, DisentangledMaskAttention)
    assert not isinstance(model.decoder.layers[0].self_attn, DisentangledMaskAttention)
    attn = model.decoder.layers[0].encoder_attn
    assert isinstance(attn, DisentangledMaskAttention)
    assert attn.token_gmm.means.shape == (4, 5, 8) and attn.query_gmm.means.shape == (1, 5, 8)


def test_gamma_follows_set_num_updates_not_a_saved_parameter(build):
    model, _ = build("--dma-alpha", "0.6")
    attn = model.encoder.layers[0].self_attn
    model.set_num_updates(0)
    assert attn.gamma == 0.0
    model.set_num_updates(100000)
    assert attn.gamma == pytest.approx(0.6)
    assert not any("gamma" in k or "num_updates" in k for k in model.state_dict())


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--encoder-attention-heads", "3"), "--encoder-attention-heads"),
        (("--decoder-attention-heads", "5"), "--decoder-attention-heads"),
        (("--dma-clusters", "0"), "--dma-clusters"),
        (("--dma-qq-weight", "-1"), "--dma-qq-weight"),
        (("--dma-kl-weight", "-0.1"), "--dma-kl-weight"),
        (("--dma-alpha", "1.5"), "--dma-alpha"),
        (("--dma-noise-var", "0"), "--dma-noise-var"),
        (("--dma-attention", "enc_self,bogus"), "--dma-attention"),
    ],
)
def test_bad_configuration_names_the_flag(flags, message, build):
    with pytest.raises(ValueError, match=message):
        build(*flags)


def test_checkpoint_of_another_architecture_is_refused_clearly(build):
    dma, _ = build()
    plain, _ = build(arch="transformer_iwslt_de_en")
    with pytest.raises(RuntimeError, match="--arch"):
        dma.load_state_dict(plain.state_dict())
    # and the DMA model's own state dict round-trips
    dma.load_state_dict(dma.state_dict())


def test_forward_reports_aux_losses_and_weights(build):
    model, _ = build()
    src = torch.randint(4, 20, (3, 6))
    prev = torch.randint(4, 20, (3, 5))
    prev[0, -2:] = 1  # padding
    _, extra = model(src, torch.full((3,), 6), prev)
    assert set(extra["aux_losses"]) == {"kl", "dqq", "dxq", "div"}
    assert all(torch.isfinite(v) for v in extra["aux_losses"].values())
    assert extra["aux_loss_weights"] == {"kl": 0.01, "dqq": 50.0, "dxq": -5.0, "div": 1.0}
    # no aux work (and no stale flags) outside the model's own forward
    assert all(not m.collect_aux and m.query_padding_mask is None for m in model.dma_modules())
