"""The demo tokenises like the data recipe: for every recipe, a tiny raw corpus is prepared with
``fairseq-modattn prepare`` (the real recipe code), and each raw source sentence of its test split,
sent through the demo's text entry point (``TextPipeline.from_data_bin``, what ``Translator``
builds and the server calls ``encode`` on), gives exactly the subword tokens of the prepared test
split the data-bin was binarised from, line by line.

The sentences exercise what the recipes do beyond white-space splitting: curly and guillemet
quotes, ``’``, non-breaking and ideographic spaces, ``-`` between words and inside compounds
(``state-of-the-art``: WMT14's ``-a`` splits it), ``&`` (Moses escapes it), zero-width and soft
hyphen characters, and Chinese for jieba.
"""

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from fairseq_modattn import data
from fairseq_modattn.data import iwslt14
from fairseq_modattn.data.manifest import MANIFEST, read_manifest
from fairseq_modattn.data.readers import read_lines
from fairseq_modattn.data.text_pipeline import TextPipeline
from fairseq_modattn.data.text_settings import TextSettings

EN = [
    "The “well-known” author’s book costs 5 € & more.",
    "« Quotes » and state-of-the-art methods - really?",
    "A non\u00a0breaking space and 1,000.5 numbers: fine!",
    'He said: "It\'s a long-term plan" — twice…',
    "Zero\u200bwidth space and soft\u00adhyphen in one-off cases.",
    "Prices rose by two percent (AT&T, R&D) last year.",
]
DE = [
    "Ein „bekannter“ Autor – mit 5 € & mehr.",
    "« Zitate » und State-of-the-Art-Methoden - wirklich?",
    "Ein geschütztes\u00a0Leerzeichen, 1.000,5 Zahlen: gut!",
    'Er sagte: "Das ist ein langfristiger Plan" — zweimal…',
    "Null\u200bbreite und weiches\u00adTrennzeichen im Haus’ Garten.",
    "Die Preise (AT&T, F&E) stiegen im letzten Jahr.",
]
ZH = [
    "我们在北京大学学习机器翻译。",
    "“人工智能”正在改变世界——真的吗？",
    "GDP增长了7%，超过预期！",
    "他说：「这是一个长期计划」。",
    "中文\u00a0空格和全角\u3000空格。",
    "零\u200b宽空格与《经济学人》的state-of-the-art技术 & AI。",
]
EN_OF_ZH = [
    "We study machine translation at Peking University.",
    "“Artificial intelligence” is changing the world - really?",
    "GDP grew by 7 %, more than expected!",
    "He said: « this is a long-term plan ».",
    "Chinese\u00a0spaces and full-width spaces.",
    "Zero-width spaces & The Economist's state-of-the-art AI.",
]

TRAIN_EN = ["The cat sat on the mat .", "A dog runs in the park .", "The well-known author wrote a book .",
            "This is a state-of-the-art method .", "Prices rose by two percent last year ."]
TRAIN_DE = ["Die Katze saß auf der Matte .", "Ein Hund läuft im Park .", "Der bekannte Autor schrieb ein Buch .",
            "Das ist eine hochmoderne Methode .", "Die Preise stiegen im letzten Jahr um zwei Prozent ."]
TRAIN_ZH = ["我们在北京大学学习。", "中国经济今年增长了。", "他昨天去上海开会。",
            "政府宣布了新的政策。", "世界银行发表了报告。"]
TRAIN_EN_ZH = ["We study at Peking University .", "China's economy grew this year .",
               "He went to a meeting in Shanghai yesterday .", "The government announced a new policy .",
               "The World Bank published a report ."]


def numbered(lines, n, tag):
    return [f"{lines[i % len(lines)][:-1]} {tag}{i}{lines[i % len(lines)][-1]}" for i in range(n)]


def lines_text(lines):
    return "".join(s + "\n" for s in lines)


def sgm(lines, lang):
    return lines_text([f'<srcset setid="x" srclang="any" trglang="{lang}">', '<doc docid="d1" genre="news">']
                      + [f'<seg id="{i}">{s}</seg>' for i, s in enumerate(lines, 1)] + ["</doc>", "</srcset>"])


def write(path: Path, content: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(content.encode("utf-8")))
    else:
        path.write_text(content, encoding="utf-8")


# ------------------------------------------------------------------------- the four raw corpora
# each returns (prepare argv after --raw-dir/--dest, source language, raw test-split source
# lines, the folder of the subword text the data-bin was binarised from)

def multi30k_raw(raw: Path):
    for stem, n in (("train", 60), ("val", 6)):
        write(raw / f"{stem}.de.gz", lines_text(numbered(TRAIN_DE, n, "d")))
        write(raw / f"{stem}.en.gz", lines_text(numbered(TRAIN_EN, n, "d")))
    write(raw / "test_2016_flickr.de.gz", lines_text(DE))
    write(raw / "test_2016_flickr.en.gz", lines_text(EN))
    return ["--bpe-size", "60"], "de", DE, "bpe"


def iwslt14_raw(raw: Path):
    members = {"train.tags.de-en.de": lines_text(["<url>http://x</url>"] + numbered(TRAIN_DE, 60, "d")),
               "train.tags.de-en.en": lines_text(["<url>http://x</url>"] + numbered(TRAIN_EN, 60, "d"))}
    test = []
    for k, name in enumerate(iwslt14.TEST_SETS):  # fairseq's order; the sentences spread over the sets
        de, en = DE[k::len(iwslt14.TEST_SETS)], EN[k::len(iwslt14.TEST_SETS)]
        test += de
        for lang, lines in (("de", de), ("en", en)):
            members[f"{name}.de-en.{lang}.xml"] = sgm(lines, lang)
    raw.mkdir(parents=True)
    with tarfile.open(raw / "de-en.tgz", "w:gz") as tar:
        for name, content in members.items():
            blob = content.encode("utf-8")
            info = tarfile.TarInfo("de-en/" + name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return ["--bpe-size", "60"], "de", test, "bpe"


def wmt14_raw(raw: Path):
    # extracted files where the recipe looks for them first (no archives, no checksums)
    for stem, tag in (("training/europarl-v7.de-en", "e"), ("commoncrawl.de-en", "c"),
                      ("training/news-commentary-v9.de-en", "n")):
        write(raw / f"{stem}.en", lines_text(numbered(TRAIN_EN, 20, tag)))
        write(raw / f"{stem}.de", lines_text(numbered(TRAIN_DE, 20, tag)))
    write(raw / "test-full/newstest2014-deen-src.en.sgm", sgm(EN, "en"))
    write(raw / "test-full/newstest2014-deen-ref.de.sgm", sgm(DE, "de"))
    write(raw / "dev/newstest2013.en", lines_text(numbered(TRAIN_EN, 5, "v")))
    write(raw / "dev/newstest2013.de", lines_text(numbered(TRAIN_DE, 5, "v")))
    return ["--bpe-size", "60", "--valid-set", "newstest2013"], "en", EN, "final"


def wmt17_raw(raw: Path):
    write(raw / "training/news-commentary-v12.zh-en.zh", lines_text(numbered(TRAIN_ZH, 40, "")))
    write(raw / "training/news-commentary-v12.zh-en.en", lines_text(numbered(TRAIN_EN_ZH, 40, "")))
    write(raw / "dev/newsdev2017-zhen-src.zh.sgm", sgm(TRAIN_ZH, "zh"))
    write(raw / "dev/newsdev2017-zhen-ref.en.sgm", sgm(TRAIN_EN_ZH, "en"))
    write(raw / "test/newstest2017-zhen-src.zh.sgm", sgm(ZH, "zh"))
    write(raw / "test/newstest2017-zhen-ref.en.sgm", sgm(EN_OF_ZH, "en"))
    return ["--src-bpe-size", "60", "--tgt-bpe-size", "60"], "zh", ZH, "final"


RECIPES = {"multi30k": multi30k_raw, "iwslt14": iwslt14_raw, "wmt14_en_de": wmt14_raw, "wmt17_zh_en": wmt17_raw}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """{recipe: (data-bin, work dir, source language, raw test source lines, subword text dir)}."""
    out = {}
    for name, make in RECIPES.items():
        root = tmp_path_factory.mktemp(name)
        flags, src, raw_test, text_dir = make(root / "raw")
        dest = root / "data-bin"
        data.prepare(name, ["--raw-dir", str(root / "raw"), "--dest", str(dest), "--no-download", *flags])
        out[name] = (dest, root / "data-bin.work", src, raw_test, text_dir)
    return out


def demo_text(dest: Path, languages=None, **flags) -> TextPipeline:
    """The demo's text pipeline of DEST (LANGUAGES: (src, tgt), default the manifest's), built as
    ``Translator`` builds it."""
    from fairseq.data import Dictionary

    if languages is None:
        manifest = read_manifest(dest)
        languages = manifest["src"], manifest["tgt"]
    src, tgt = languages
    src_dict, tgt_dict = (Dictionary.load(str(dest / f"dict.{lang}.txt")) for lang in (src, tgt))
    return TextPipeline.from_data_bin(dest, src_dict, tgt_dict, src, tgt, **flags)


# ------------------------------------------------------------------------------------ the tests

@pytest.mark.parametrize("recipe", list(RECIPES))
def test_served_tokens_equal_the_prepared_test_split(prepared, recipe):
    dest, work, src, raw_test, text_dir = prepared[recipe]
    binarised = read_lines(work / text_dir / f"test.{src}")
    assert len(binarised) == len(raw_test)
    text = demo_text(dest)
    assert text.describe()["settings"] == "recorded", text.describe()
    for raw, expected in zip(raw_test, binarised):
        assert text.encode(raw).subwords == expected.split(), raw


def test_the_recipes_record_their_settings(prepared):
    recorded = {name: read_manifest(dest)["text"] for name, (dest, *_rest) in prepared.items()}
    assert recorded["wmt14_en_de"]["en"] == {
        **TextSettings("en", apostrophe=True, aggressive_dash_splits=True).to_dict(),
        "subword": "subword-nmt", "subword_model": "code"}
    assert recorded["wmt17_zh_en"]["zh"]["tokenizer"] == "jieba"
    assert recorded["wmt17_zh_en"]["zh"]["subword_model"] == "code.zh"
    assert recorded["wmt17_zh_en"]["en"]["normalize"] is True
    assert recorded["multi30k"]["de"]["lowercase"] is True and recorded["iwslt14"]["de"]["apostrophe"] is True
    # today's case of the issue: -a splits compounds, as the model's training text
    tokens = demo_text(prepared["wmt14_en_de"][0]).encode("a state-of-the-art method").subwords
    assert "@-@" in " ".join(tokens).replace("@@ ", "")


def test_flags_override_and_a_data_bin_without_settings_is_guessed(prepared, tmp_path):
    dest = prepared["multi30k"][0]
    assert demo_text(dest, lowercase="no").encode("Ein Hund").subwords[0].startswith("E")
    described = demo_text(dest, lowercase="no", bpe="subword_nmt").describe()  # the old spelling
    assert described["bpe"] == "subword-nmt" and "--lowercase no" in described["settings_origin"]

    # the same data-bin as plain fairseq-preprocess leaves it: no manifest, the earlier guesses
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in dest.iterdir():
        if f.name != MANIFEST:
            (bare / f.name).symlink_to(f)
    text = demo_text(bare, ("de", "en"))
    info = text.describe()
    assert info["settings"] == "guessed" and "records no text settings" in info["settings_origin"]
    assert (info["tokenizer"], info["lowercase"], info["bpe"]) == ("moses", True, "subword-nmt")


def test_serve_accepts_both_spellings_of_subword_nmt():
    from fairseq_modattn.cli.serve import parser

    base = ["--path", "x.pt", "--data", "d"]
    assert parser().parse_args(base + ["--bpe", "subword_nmt"]).bpe == "subword-nmt"
    assert parser().parse_args(base + ["--bpe", "subword-nmt"]).bpe == "subword-nmt"
    assert parser().parse_args(base).bpe == "auto"
