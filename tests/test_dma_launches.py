"""How many kernels a DMA model launches on a GPU, counted on the CPU (a count, not a timing).

On a GPU a training step of many small operator calls runs at the speed of its launches
(about 10 µs each). The models take their CUDA code path here (``device_paths.emulate``) and
``benchmarks/kernel_calls.py`` counts what that path launches. The models are the 6 + 6-layer
IWSLT architectures of ``benchmarks/bench_dma.py`` at a small width: the calls of a step do not
depend on the width, the batch or (on the GPU path) the sentence length.

The bounds are the counts measured when they were set, with the targets they meet; a change that
adds launches to DMA's step fails here and says by how much.
"""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

import fairseq_modattn  # noqa: F401  (registers the architectures and the criterion)
from fairseq_modattn.modules import device_paths
from tiny_models import tiny_dictionary

WIDTH = ["--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
         "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128"]
TRANSFORMER = ("transformer_iwslt_de_en", "label_smoothed_cross_entropy")
DMA = ("dma_transformer_iwslt_de_en", "label_smoothed_cross_entropy_with_aux")

#: the eager DMA step at most this many times the transformer's launches (issue target 5.5;
#: measured 5.38, 5,075 calls against 944, with the authors' objective, the architectures' default)
STEP_RATIO_BOUND = 5.5
#: --dma-objective paper (CLUB L_Dqq, Eq. 14's L_dv, the sample in the GMM only): measured 6.87
PAPER_STEP_RATIO_BOUND = 6.9
#: one beam-search decoding step (target 1.4; measured 1.29, 325 calls against 253)
DECODING_RATIO_BOUND = 1.4


@pytest.fixture(scope="module")
def count_kernel_calls(kernel_calls):
    return kernel_calls.count_kernel_calls


@pytest.fixture(scope="module")
def build(tiny_model, vocabulary):
    """build(arch, criterion, *flags) -> (model, criterion, task) over the module's vocabulary."""
    def build(arch, criterion, *extra):
        built = tiny_model(arch, "-s", "src", "-t", "tgt", "--criterion", criterion, "--label-smoothing", "0.1",
                           "--seed", "1", *WIDTH, *extra, dictionary=vocabulary, seed=1)
        if hasattr(built.model, "dma_modules"):
            built.model.set_num_updates(4000)  # gamma > 0: the mask path runs
        return built.model, built.criterion(), built.task

    return build


def sample(d, length, bsz=4):
    gen = torch.Generator().manual_seed(length)
    src = torch.randint(d.nspecial, len(d), (bsz, length), generator=gen)
    tgt = torch.randint(d.nspecial, len(d), (bsz, length), generator=gen)
    src[:, -1] = tgt[:, -1] = d.eos()
    prev = torch.cat([tgt.new_full((bsz, 1), d.eos()), tgt[:, :-1]], 1)
    return {"id": torch.arange(bsz), "nsentences": bsz, "ntokens": bsz * length, "target": tgt,
            "net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), length), "prev_output_tokens": prev}}


def step_calls(count, model, criterion, batch):
    model.train()

    def step():
        loss, _, _ = criterion(model, batch)
        loss.backward()

    step()  # first calls at a shape may take other paths
    model.zero_grad(set_to_none=True)
    with device_paths.emulate("cuda"):
        counts = count(step, math_sdpa_as_fused=True)
    model.zero_grad(set_to_none=True)
    return sum(counts.values())


@pytest.fixture(scope="module")
def vocabulary():
    return tiny_dictionary(200, padding_factor=1)


@pytest.fixture(scope="module")
def transformer_step(count_kernel_calls, vocabulary, build):
    model, criterion, _ = build(*TRANSFORMER)
    return step_calls(count_kernel_calls, model, criterion, sample(vocabulary, 8))


@pytest.mark.parametrize("objective, bound", [("authors", STEP_RATIO_BOUND), ("paper", PAPER_STEP_RATIO_BOUND)])
def test_training_step_launches_within_bound_and_flat_in_length(
    count_kernel_calls, vocabulary, transformer_step, objective, bound, build
):
    model, criterion, _ = build(*DMA, "--dma-objective", objective)
    short = step_calls(count_kernel_calls, model, criterion, sample(vocabulary, 8))
    long = step_calls(count_kernel_calls, model, criterion, sample(vocabulary, 32))
    assert long == short, f"DMA's launches grow with length on the GPU path: {short} at L=8, {long} at L=32"
    ratio = short / transformer_step
    print(f"{objective}: DMA {short}, transformer {transformer_step}, ratio {ratio:.3f}")
    assert ratio <= bound, f"DMA step: {short} launches = {ratio:.2f} x the transformer's {transformer_step}"


def test_decoding_step_launches_within_bound(count_kernel_calls, vocabulary, build):
    per_step = {}
    for name, (arch, criterion_name) in (("transformer", TRANSFORMER), ("dma", DMA)):
        model, _, task = build(arch, criterion_name)
        model.eval()
        if name == "transformer":  # fairseq's own beam-shared encoder keys, as the plugin's models use
            for m in model.modules():
                if hasattr(m, "set_beam_size") and m is not model:
                    m.set_beam_size(5)
        batch = {"net_input": {k: v[:2] for k, v in sample(vocabulary, 12)["net_input"].items()
                               if k != "prev_output_tokens"}}
        calls = []
        for steps in (4, 8):
            generator = SequenceGenerator([model], task.target_dictionary, beam_size=5, max_len_a=0,
                                          max_len_b=steps, min_len=steps)
            generator.generate([model], batch)
            with device_paths.emulate("cuda"):
                counts = count_kernel_calls(lambda: generator.generate([model], batch), math_sdpa_as_fused=True)
            calls.append(sum(counts.values()))
        per_step[name] = (calls[1] - calls[0]) / 4
    ratio = per_step["dma"] / per_step["transformer"]
    print(f"decoding step: {per_step}, ratio {ratio:.3f}")
    assert ratio <= DECODING_RATIO_BOUND, \
        f"a decoding step: DMA {per_step['dma']}, transformer {per_step['transformer']}"
