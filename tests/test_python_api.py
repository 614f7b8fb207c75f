"""The Python API fairseq users write first: ``Model.from_pretrained(...).translate(text)``
(``fairseq_modattn/models/hub_interface.py``).

End to end, on conftest's tiny models of the shared Multi30k corpus (trained with ``--user-dir``):
raw test sentences through ``from_pretrained(...).translate`` give ``fairseq-generate``'s
hypotheses on the same sentences, Moses-detokenised as ``fairseq-modattn evaluate`` does it. The
data-bin of those sentences records the text steps conftest ran (lower-casing, Moses without
escaping, its BPE codes), as ``fairseq-modattn prepare`` records a recipe's.

Fast: the choice of the text pipeline (recorded, guessed, fairseq's own, or a clear error), the
checks of the paths, and talking heads (no tiny checkpoint of that family is trained) through
the hub interface against fairseq's generator on the same ids.
"""

import gzip
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fairseq.hub_utils import GeneratorHubInterface
from omegaconf import OmegaConf

import fairseq_modattn
from conftest import PLUGIN, bpe_codes, fairseq_cli, run_cli
from fairseq_modattn.analysis import scoring
from fairseq_modattn.data.manifest import MANIFEST, WRITTEN_BY
from fairseq_modattn.data.text_pipeline import TextPipeline
from fairseq_modattn.data.text_settings import TextSettings, manifest_text
from fairseq_modattn.models import hub_interface
from fairseq_modattn.models.dma_transformer import DMATransformerModel
from fairseq_modattn.models.hub_interface import CheckedHubInterface, FromPretrainedError, TextPipelineHubInterface
from fairseq_modattn.models.rim_lstm import RIMLSTMModel
from fairseq_modattn.models.talking_heads_transformer import TalkingHeadsTransformerModel
from fairseq_modattn.models.tim_transformer import TIMTransformerModel

#: how conftest's multi30k_bin made its text: lower-cased, Moses without escaping, joint BPE
CONFTEST_TEXT = {lang: TextSettings(lang, escape=False, lowercase=True) for lang in ("de", "en")}
SENTENCES = 6
#: the model class whose from_pretrained each tiny checkpoint is loaded with (None: the function,
#: for fairseq's own transformer)
MODEL_CLASSES = {"transformer": None, "dma": DMATransformerModel, "tim": TIMTransformerModel, "rim": RIMLSTMModel}
GENERATION = {"beam": 5, "max_len_b": 20}  # the tiny models repeat words to the limit: keep it short


def write_manifest(data_bin: Path, text=CONFTEST_TEXT, subword="subword-nmt"):
    """DATA_BIN's manifest as prepare writes it, recording TEXT followed by SUBWORD ("code")."""
    manifest = {"written_by": WRITTEN_BY, "corpus": "multi30k", "src": "de", "tgt": "en",
                "text": manifest_text(text, subword, joint=True)}
    (data_bin / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")


@pytest.fixture(scope="module")
def few_sentences(multi30k_dir, multi30k_bin, tmp_path_factory):
    """(data-bin of the first SENTENCES test pairs with a recorded pipeline, their raw German,
    their BPE'd German as binarised)."""
    work = tmp_path_factory.mktemp("few")
    with gzip.open(multi30k_dir / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        raw = [next(f).strip() for _ in range(SENTENCES)]
    subwords = {}
    for lang in ("de", "en"):
        subwords[lang] = (multi30k_bin.parent / f"test.bpe.{lang}").read_text(encoding="utf-8").splitlines()[:SENTENCES]
        (work / f"few.{lang}").write_text("".join(s + "\n" for s in subwords[lang]), encoding="utf-8")
    data_bin = work / "bin"
    run_cli([fairseq_cli("fairseq-preprocess"), "--source-lang", "de", "--target-lang", "en", "--testpref",
             work / "few", "--destdir", data_bin, "--srcdict", multi30k_bin / "dict.de.txt", "--tgtdict",
             multi30k_bin / "dict.en.txt", "--workers", "1"])
    shutil.copy(bpe_codes(multi30k_bin), data_bin / "code")
    write_manifest(data_bin)
    return data_bin, raw, subwords["de"]


def generate_detokenized(checkpoint: Path, data_bin: Path):
    """fairseq-generate's hypotheses of the test split, one sentence a batch, after
    ``--remove-bpe`` and the Moses detokenisation of ``fairseq-modattn evaluate``."""
    _, out = run_cli([fairseq_cli("fairseq-generate"), data_bin, "--user-dir", PLUGIN, "--path", checkpoint,
                      "--gen-subset", "test", "--beam", str(GENERATION["beam"]), "--max-len-b",
                      str(GENERATION["max_len_b"]), "--batch-size", "1", "--remove-bpe", "--cpu"])
    result = scoring.parse_generate_output(out)
    assert sorted(result.hypotheses) == list(range(SENTENCES)), out[-2000:]
    return scoring.detokenize([result.hypotheses[i] for i in range(SENTENCES)], "en")


def load(family, checkpoint: Path, data_bin: Path, **kwargs):
    cls = MODEL_CLASSES[family]
    loader = cls.from_pretrained if cls is not None else fairseq_modattn.from_pretrained
    return loader(str(checkpoint.parent), checkpoint_file=checkpoint.name, data_name_or_path=str(data_bin), **kwargs)


# ------------------------------------------------------------------------------------ end to end

@pytest.mark.parametrize("family", list(MODEL_CLASSES))
def test_translate_raw_text_gives_fairseq_generates_detokenized_hypotheses(tiny_checkpoints, few_sentences, family):
    data_bin, raw, binarised = few_sentences
    hub = load(family, tiny_checkpoints[family], data_bin)
    assert isinstance(hub, TextPipelineHubInterface)
    assert hub.describe_text_pipeline()["settings"] == "recorded"
    # the raw sentence becomes the tokens fairseq-generate reads from the data-bin
    for sentence, tokens in zip(raw, binarised):
        assert hub.text_pipeline.encode(sentence).subwords == tokens.split(), sentence
    expected = generate_detokenized(tiny_checkpoints[family], data_bin)
    assert [hub.translate(sentence, **GENERATION) for sentence in raw] == expected
    assert any(h.strip() for h in expected)  # something to compare: not all hypotheses empty


def test_translate_says_what_is_wrong_with_its_arguments(tiny_checkpoints, few_sentences):
    """Before: translate(42) and translate([s, 3]) failed inside the text pipeline, beam=0 with a
    reshape error in attention_base.py, a 5,000-character input with fairseq's advice to pass
    --skip-invalid-size-inputs-valid-test, and "" translated to the model's output for </s>."""
    data_bin, raw, _ = few_sentences
    hub = load("dma", tiny_checkpoints["dma"], data_bin)
    for bad, name in ((42, "int"), (None, "NoneType"), ({"a": 1}, "dict")):
        with pytest.raises(TypeError, match=f"^translate\\(\\) takes a str or a list of str, got {name}$"):
            hub.translate(bad)
    with pytest.raises(TypeError, match="item 1 of the list is int"):
        hub.translate([raw[0], 3])
    for beam, error, message in ((0, ValueError, "beam must be at least 1, got 0"),
                                 (-2, ValueError, "beam must be at least 1, got -2"),
                                 (2.0, TypeError, "beam must be an int, got float")):
        with pytest.raises(error, match=message):
            hub.translate(raw[0], beam=beam)
    long_text = "ein mann mit einem roten hut spielt gitarre . " * 110  # ~5,000 characters
    limit = hub.models[0].max_positions()[0]
    with pytest.raises(ValueError, match=rf"is [\d,]+ tokens long after the text pipeline .*at most {limit:,} source "
                                         r"positions \(max_source_positions\)") as error:
        hub.translate(long_text)
    assert "skip-invalid-size" not in str(error.value)
    with pytest.raises(ValueError, match="sentence 1 of the list is"):
        hub.translate([raw[0], long_text])
    assert hub.translate("") == "" and hub.translate("  \t ") == ""
    assert hub.translate(["", raw[0], " "], **GENERATION) == ["", hub.translate(raw[0], **GENERATION), ""]


def test_decode_detokenizes_as_evaluate_does(few_sentences, multi30k_bin):
    """The tiny models' hypotheses repeat a few words; the references show decode on real
    sentences: their ids decode to evaluate's Moses detokenisation of the --remove-bpe text."""
    from fairseq.data import Dictionary

    data_bin, _, _ = few_sentences
    dictionary = Dictionary.load(str(data_bin / "dict.en.txt"))
    text = TextPipeline.from_data_bin(data_bin, dictionary, dictionary, "de", "en")
    references = (multi30k_bin.parent / "test.bpe.en").read_text(encoding="utf-8").splitlines()[:SENTENCES]
    decoded = [text.decode(dictionary.encode_line(line, add_if_not_exist=False).tolist()) for line in references]
    assert decoded == scoring.detokenize([(line + " ").replace("@@ ", "").strip() for line in references], "en")
    assert any("." in line and " ." not in line for line in decoded)  # detokenised, not just joined


def test_without_a_recorded_pipeline_the_message_says_what_to_pass(tiny_checkpoints, few_sentences, tmp_path):
    data_bin, raw, _ = few_sentences
    bare = tmp_path / "bare"  # the same data-bin as plain fairseq-preprocess leaves it
    bare.mkdir()
    for f in data_bin.iterdir():
        if f.name != MANIFEST:
            (bare / f.name).symlink_to(f)
    checkpoint = tiny_checkpoints["dma"]
    expected_message = "records no text pipeline.*tokenizer='moses'.*text_pipeline='guessed'"
    with pytest.raises(FromPretrainedError, match=expected_message):
        load("dma", checkpoint, bare)

    recorded = load("dma", checkpoint, data_bin)
    guessed = load("dma", checkpoint, bare, text_pipeline="guessed")
    assert guessed.describe_text_pipeline()["settings"] == "guessed"
    assert guessed.translate(raw[0], **GENERATION) == recorded.translate(raw[0], **GENERATION)

    # fairseq's own tokenizer and BPE when asked for, with the recorded pipeline or without: no
    # lower-casing then, so lower-cased input gives the same translation
    for folder in (bare, data_bin):
        plain = load("dma", checkpoint, folder, tokenizer="moses", bpe="subword_nmt", bpe_codes=str(data_bin / "code"))
        assert type(plain) is CheckedHubInterface and isinstance(plain, GeneratorHubInterface)
        assert plain.translate(raw[0].lower(), **GENERATION) == recorded.translate(raw[0], **GENERATION)


def test_a_user_dir_argument_is_imported_as_fairseq_does(tiny_checkpoints, few_sentences):
    data_bin, raw, _ = few_sentences
    hub = load("dma", tiny_checkpoints["dma"], data_bin, user_dir=str(PLUGIN))
    assert hub.translate(raw[0], **GENERATION) == load("dma", tiny_checkpoints["dma"], data_bin).translate(
        raw[0], **GENERATION)


# ------------------------------------------------------------------------------------ fast

def tiny_data_bin(folder: Path, dictionary, text=None) -> Path:
    """A data-bin of DICTIONARY on both sides (no splits), recording TEXT (no subword model) when given."""
    folder.mkdir()
    for lang in ("de", "en"):
        dictionary.save(str(folder / f"dict.{lang}.txt"))
    if text is not None:
        write_manifest(folder, text, subword="none")
    return folder


def loaded_task(data_bin: Path, dictionary):
    """The parts of a loaded task that the pipeline's choice reads."""
    cfg = SimpleNamespace(data=str(data_bin), source_lang="de", target_lang="en")
    return SimpleNamespace(cfg=cfg, source_dictionary=dictionary, target_dictionary=dictionary)


def test_the_pipeline_is_the_record_or_a_clear_error(tmp_path):
    from tiny_models import tiny_dictionary

    words = tiny_dictionary(20)
    task = loaded_task(tiny_data_bin(tmp_path / "bare", words), words)
    no_text = OmegaConf.create({"tokenizer": None, "bpe": None})
    with pytest.raises(FromPretrainedError) as error:
        hub_interface._text_pipeline(no_text, task, "recorded")
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "bare") in message
    assert "bpe='subword_nmt'" in message and "text_pipeline='guessed'" in message
    # a checkpoint that names fairseq's BPE: fairseq's own encoders (None), as fairseq does
    assert hub_interface._text_pipeline(OmegaConf.create({"tokenizer": None, "bpe": {"_name": "subword_nmt"}}),
                                        task, "recorded") is None
    with pytest.raises(FromPretrainedError, match="no subword model"):  # guessing needs one
        hub_interface._text_pipeline(no_text, task, "guessed")

    plain = {lang: TextSettings(lang, tokenizer="none") for lang in ("de", "en")}
    recorded = loaded_task(tiny_data_bin(tmp_path / "recorded", words, plain), words)
    text = hub_interface._text_pipeline(no_text, recorded, "recorded")
    assert text.recorded and text.encode("w3  w4").subwords == ["w3", "w4"]


def test_paths_are_checked_before_fairseq_loads(tmp_path):
    with pytest.raises(FromPretrainedError, match="does not exist"):
        DMATransformerModel.from_pretrained(str(tmp_path / "nowhere"))
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    with pytest.raises(FromPretrainedError, match="holds no checkpoint checkpoint_best.pt.*checkpoint_last.pt"):
        DMATransformerModel.from_pretrained(str(tmp_path), checkpoint_file="checkpoint_best.pt")
    # a .pt file stands for its folder and name; the default data-bin "." has no dictionaries
    with pytest.raises(FromPretrainedError, match="holds no dictionaries"):
        TIMTransformerModel.from_pretrained(str(tmp_path / "checkpoint_last.pt"))
    with pytest.raises(FromPretrainedError, match="text_pipeline must be one of"):
        RIMLSTMModel.from_pretrained(str(tmp_path), text_pipeline="moses")
    assert DMATransformerModel.hub_models() == {}  # not fairseq's plain transformer archives


def test_talking_heads_hub_translates_as_fairseqs_generator(tiny_model, tmp_path):
    """The hub interface on a talking-heads model (built, not trained) gives the hypothesis of
    fairseq's generator on the same ids, through the pipeline's encode and decode."""
    from fairseq.dataclass.configs import GenerationConfig
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    tiny = tiny_model("talking_heads_transformer_iwslt_de_en", "--encoder-layers", "1", "--decoder-layers", "1",
                      "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
                      "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "4",
                      "--decoder-attention-heads", "4")
    tiny.model.eval()
    plain = {lang: TextSettings(lang, tokenizer="none") for lang in ("de", "en")}
    data_bin = tiny_data_bin(tmp_path / "bin", tiny.dictionary, plain)
    text = TextPipeline.from_data_bin(data_bin, tiny.dictionary, tiny.dictionary, "de", "en")
    hub = TalkingHeadsTransformerModel.from_pretrained  # the class's loader is the package's
    assert hub.__func__ is DMATransformerModel.from_pretrained.__func__
    cfg = convert_namespace_to_omegaconf(tiny.args)
    interface = TextPipelineHubInterface(cfg, tiny.task, [tiny.model], text)

    sentence = "w3 w7 w1 w12"
    ids = interface.encode(sentence)
    assert ids.tolist() == [tiny.dictionary.index(w) for w in sentence.split()] + [tiny.dictionary.eos()]
    generator = tiny.task.build_generator([tiny.model], GenerationConfig(beam=3, max_len_b=10))
    sample = {"id": torch.tensor([0]), "net_input": {"src_tokens": ids[None], "src_lengths": torch.tensor([len(ids)])}}
    with torch.no_grad():
        best = tiny.task.inference_step(generator, [tiny.model], sample)[0][0]["tokens"]
    expected = " ".join(tiny.dictionary[i] for i in best.tolist() if i != tiny.dictionary.eos())
    assert interface.translate(sentence, beam=3, max_len_b=10) == expected
