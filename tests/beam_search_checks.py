"""Beam search through fairseq's SequenceGenerator with and without beam-shared encoder keys.

SequenceGenerator sets the beam size on this package's models (``set_beam_size``); their
encoder-decoder attention then keeps one copy of each sentence's encoder keys for its beams
(``MultiheadAttentionBase``). ``check_beam_shared_keys_are_exact`` translates the same batch
both ways, through reorderings and sentences that finish early, and requires the same
hypotheses and scores.
"""

import torch
from fairseq.sequence_generator import SequenceGenerator

from fairseq_modattn.modules import MultiheadAttentionBase


def check_beam_shared_keys_are_exact(model, dictionary, beam=3, lengths=(7, 3, 5, 6)):
    """Returns the number of k_proj rows the first shared encoder-decoder attention projected."""
    model.eval()
    pad, eos = dictionary.pad(), dictionary.eos()
    generator = torch.Generator().manual_seed(4)
    src = torch.full((len(lengths), max(lengths)), pad)
    for i, n in enumerate(lengths):  # left-padded, as fairseq's translation task pads sources
        src[i, -n:] = torch.randint(4, len(dictionary), (n,), generator=generator)
        src[i, -1] = eos
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor(lengths)}}

    def favour_eos(module, inputs, logits):  # so that hypotheses end at different steps
        logits[..., eos] += 2.0
        return logits

    hook = model.decoder.output_projection.register_forward_hook(favour_eos)
    try:
        results, rows = {}, {}
        for shared in (True, False):
            search = SequenceGenerator([model], dictionary, beam_size=beam, max_len_a=0, max_len_b=30)
            attentions = [m for layer in model.decoder.layers for m in layer.modules()
                          if isinstance(m, MultiheadAttentionBase) and m.encoder_decoder_attention]
            assert attentions and all(m.beam_size == beam for m in attentions)
            if not shared:
                for m in attentions:
                    m.beam_size = 1
            seen = []
            counter = attentions[0].k_proj.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].size(1)))
            with torch.no_grad():
                results[shared] = search.forward(sample)
            counter.remove()
            rows[shared] = seen
    finally:
        hook.remove()
    assert rows == {True: [len(lengths)], False: [beam * len(lengths)]}, rows
    lengths_out = set()
    for with_sharing, without in zip(results[True], results[False]):
        for a, b in zip(with_sharing, without):
            assert torch.equal(a["tokens"], b["tokens"])
            torch.testing.assert_close(a["positional_scores"], b["positional_scores"], rtol=1e-5, atol=1e-5)
            lengths_out.add(a["tokens"].numel())
    assert len(lengths_out) > 1  # hypotheses ended at different steps: the batch shrank on the way
