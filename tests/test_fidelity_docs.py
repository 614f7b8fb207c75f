"""docs/fidelity.md names only things that exist: every file of this repository it points to,
and every command-line flag, which must be accepted by fairseq-train with the relevant model
and criterion (or be one of the authors' flags the document quotes)."""

import re

import pytest

from conftest import REPO
from tiny_models import training_parser

DOC = REPO / "docs" / "fidelity.md"

#: (architecture, criterion) whose parsers together define every flag this package has
PARSERS = (
    ("dma_transformer_iwslt_de_en", "label_smoothed_cross_entropy_with_aux"),
    ("talking_heads_transformer_iwslt_de_en", "label_smoothed_cross_entropy"),
    ("tim_transformer_iwslt_de_en", "label_smoothed_cross_entropy"),
    ("rim_lstm_iwslt_de_en", "label_smoothed_cross_entropy"),
)
#: flags of the authors' code that the document quotes (theirs, not ours)
REFERENCE_FLAGS = {
    "--clusters", "--mi_loss_weight", "--grad_multiplier", "--cluster_loss_weight",
    "--regular-attn", "--num_modules",
}
#: files of the reference repositories that the document names
REFERENCE_FILES = {
    "modules/disentangled_attention.py", "criterions/disentangled_label_smoothed_cross_entropy.py",
    "train_disentangled_transformer.sh", "train_transformer.sh",
    "fairseq/modules/transformer_layer.py", "multihead_attention.py",
    "event_based/blocks_core.py", "attention.py", "BlockLSTM.py",
}
#: top-level folders of this repository: a path starting with one must exist
OUR_ROOTS = ("fairseq_modattn/", "docs/", "examples/", "tests/", "benchmarks/", "scripts/")


def doc_text():
    return DOC.read_text()


def test_named_files_exist():
    named = set(re.findall(r"`([\w./-]+\.(?:py|md|sh))`", doc_text()))
    assert named, "no file names found: the pattern is wrong"
    ours = [name for name in named if name.startswith(OUR_ROOTS)]
    missing = [name for name in ours if not (REPO / name).exists()]
    assert not missing, f"docs/fidelity.md names files that do not exist: {missing}"
    # a bare file name is one of ours (somewhere in the package or the tests) or a reference file
    bare = [name for name in named - set(ours) if name not in REFERENCE_FILES]
    unknown = [name for name in bare
               if not any(REPO.glob(f"fairseq_modattn/**/{name}")) and not (REPO / "tests" / name).exists()]
    assert not unknown, f"docs/fidelity.md names files found nowhere: {unknown}"


@pytest.fixture(scope="module")
def accepted_flags():
    flags = set()
    for arch, criterion in PARSERS:
        parser, _ = training_parser(arch, "--criterion", criterion)
        flags.update(s for s in parser._option_string_actions if s.startswith("--"))
    return flags


def test_named_flags_are_accepted(accepted_flags):
    named = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", doc_text()))
    assert "--dma-objective" in named and "--rim-input-heads" in named, "the flag pattern is wrong"
    unknown = sorted(named - accepted_flags - REFERENCE_FLAGS)
    assert not unknown, f"docs/fidelity.md names flags no parser accepts: {unknown}"
    # the authors' flags are quoted as theirs: none of them may be ours under the same name
    assert not (REFERENCE_FLAGS & accepted_flags)


def test_module_docstrings_link_the_document():
    for path in ("modules/dma_attention.py", "modules/talking_heads_attention.py", "modules/rim.py"):
        source = (REPO / "fairseq_modattn" / path).read_text()
        docstring = source.split('"""')[1]
        assert "docs/fidelity.md" in docstring, path


# ------------------------------------------------------------- references to the documentation
#: files whose text may cite the documentation under docs/
CITING = ("fairseq_modattn/**/*.py", "README.md", "docs/*.md", "examples/**/*.md", "benchmarks/*.md")
#: every text file of the repository that might name the design document
ALL_TEXT = CITING + ("tests/*.py", "benchmarks/*.py", "scripts/*.sh", "pyproject.toml", "examples/**/*")
DESIGN = REPO / "docs" / "design.md"
#: the project-internal notes users do not have (spelled in two parts so that this file passes)
INTERNAL_DESIGN = "DESIGN" + ".md"


def files_matching(patterns):
    return sorted({p for pattern in patterns for p in REPO.glob(pattern) if p.is_file()})


def design_sections():
    """The headings of docs/design.md (fenced code blocks left out), whitespace collapsed."""
    text = re.sub(r"^```.*?^```", "", DESIGN.read_text(), flags=re.M | re.S)
    return {" ".join(h.split()) for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


def test_cited_docs_exist():
    cited = {}
    for path in files_matching(CITING):
        for name in re.findall(r"docs/[\w./-]*\w\.md", path.read_text()):
            cited.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert "docs/design.md" in cited and "docs/fidelity.md" in cited, "the path pattern is wrong"
    missing = {name: sorted(where) for name, where in cited.items() if not (REPO / name).is_file()}
    assert not missing, f"documents cited but absent (document: citing files): {missing}"


def test_cited_design_sections_exist():
    sections = design_sections()
    assert {"Evaluation definitions", "fairseq pitfalls", "DMA"} <= sections, sections
    # docs/design.md, "Section" (the quote may follow a backtick, a comma and a line break)
    citation = re.compile(r"docs/design\.md`?,?\s+[\"']([^\"']+)[\"']")
    cited, unknown = 0, []
    for path in files_matching(CITING):
        for name in citation.findall(path.read_text()):
            cited += 1
            name = " ".join(name.split())
            if name not in sections:
                unknown.append(f"{path.relative_to(REPO)}: {name!r}")
    assert cited >= 5, "the citation pattern is wrong"
    assert not unknown, f"docs/design.md has no such section: {unknown}; it has {sorted(sections)}"


def test_no_file_cites_the_internal_design_notes():
    citing = [str(p.relative_to(REPO)) for p in files_matching(ALL_TEXT)
              if INTERNAL_DESIGN in p.read_text(errors="replace")]
    assert not citing, f"{citing} cite {INTERNAL_DESIGN}, which users do not have: cite docs/design.md"
