"""Packaging files: CITATION.cff (the software and the four papers), LICENSE against the license
pyproject.toml declares, the setup.py shim, and the extras the README names."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fairseq_modattn

REPO = Path(__file__).resolve().parents[1]

#: title -> (family names of the authors in order, year, arXiv identifier or None)
PAPERS = {
    "Disentangled Mask Attention in Transformer": (["Chien", "Huang"], 2021, None),
    "Talking-Heads Attention": (["Shazeer", "Lan", "Cheng", "Ding", "Hou"], 2020, "2003.02436"),
    "Transformers with Competitive Ensembles of Independent Mechanisms":
        (["Lamb", "He", "Goyal", "Ke", "Liao", "Ravanelli", "Bengio"], 2021, "2103.00336"),
    "Recurrent Independent Mechanisms":
        (["Goyal", "Lamb", "Hoffmann", "Sodhani", "Levine", "Bengio", "Schölkopf"], 2021, "1909.10893"),
}


def pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def citation():
    """CITATION.cff parsed with PyYAML (which fairseq's omegaconf requires)."""
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((REPO / "CITATION.cff").read_text(encoding="utf-8"))


def test_citation_cites_this_software():
    cff = citation()
    assert cff["cff-version"] == "1.2.0"
    assert cff["type"] == "software"
    for key in ("message", "title", "authors"):  # required by CFF 1.2.0
        assert cff[key], key
    assert all("name" in a or "family-names" in a for a in cff["authors"])
    assert str(cff["version"]) == fairseq_modattn.__version__
    assert cff["license"] == "MIT"


def test_citation_references_the_four_papers():
    references = {ref["title"]: ref for ref in citation()["references"]}
    assert set(references) == set(PAPERS)
    for title, (family_names, year, arxiv) in PAPERS.items():
        ref = references[title]
        assert ref["type"] in ("article", "conference-paper", "unpublished"), title
        assert [a["family-names"] for a in ref["authors"]] == family_names, title
        assert all(a.get("given-names") for a in ref["authors"]), title
        assert ref["year"] == year, title
        if arxiv:
            assert ref["url"] == f"https://arxiv.org/abs/{arxiv}"
            assert {"type": "other", "value": f"arXiv:{arxiv}", "description": "arXiv identifier"} \
                in ref["identifiers"]
    assert "ICLR 2021" in references["Recurrent Independent Mechanisms"]["conference"]["name"]
    assert references["Disentangled Mask Attention in Transformer"]["url"].startswith("https://openreview.net/")


def test_license_is_the_mit_license_pyproject_declares():
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n")
    assert "Copyright (c) 2026 the fairseq_modattn authors" in text
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text
    project = pyproject()["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]


def test_extras():
    extras = pyproject()["project"]["optional-dependencies"]
    assert extras["tensorboard"] == ["tensorboardX"]
    assert "tensorboardX" in extras["test"]  # so the TensorBoard test runs where the suite does


def test_setup_py_shim_reads_pyproject():
    shim = (REPO / "setup.py").read_text(encoding="utf-8")
    assert re.search(r"^from setuptools import setup$", shim, re.MULTILINE)
    assert re.search(r"^setup\(\)$", shim, re.MULTILINE)
    proc = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == fairseq_modattn.__version__


def test_python_versions_declared_are_the_installable_ones():
    """requires-python starts where fairseq-fixed imports (3.11); the fork is capped below its next
    minor release, the breaking version in 0.x; no dependency is left for an older Python
    (fairseq 0.12.2, which pip >= 24.1 refuses to install)."""
    project = pyproject()["project"]
    assert project["requires-python"] == ">=3.11"
    deps = project["dependencies"]
    assert "fairseq-fixed>=0.12.3,<0.13" in deps
    assert not [d for d in deps if "python_version" in d or d.startswith("fairseq==")]
    minors = [c.rsplit(":: ", 1)[1] for c in project["classifiers"]
              if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert minors and minors[0] == "3.11" and all(int(m.split(".")[1]) >= 11 for m in minors)
    assert "Typing :: Typed" in project["classifiers"]


def _code_lines(markdown_block: str):
    return [line.split("  #", 1)[0].strip() for line in markdown_block.strip().splitlines()]


def test_ci_runs_the_readme_install_and_test_commands():
    """.ci/run holds README's Install and Test commands verbatim and in order, lint before tests;
    README names the second CI script, .ci/python-versions."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    install = re.search(r"^## Install\n.*?```bash\n(.*?)```", readme, re.MULTILINE | re.DOTALL).group(1)
    test = re.search(r"^## Test\n.*?```bash\n(.*?)```", readme, re.MULTILINE | re.DOTALL).group(1)
    commands = _code_lines(install) + _code_lines(test)
    assert "ruff check ." in commands and "mypy" in commands
    assert commands.index("mypy") < commands.index("python -m pytest -q --require-shared-data --durations=25")
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    positions = [ci.index(command) for command in commands]
    assert positions == sorted(positions)
    # the other Pythons' fast tier is the second CI script, named in README, runnable as it stands
    assert ".ci/python-versions" in readme
    assert os.access(REPO / ".ci" / "python-versions", os.X_OK)


def test_pep561_marker_is_package_data():
    assert (REPO / "fairseq_modattn" / "py.typed").is_file()
    assert "py.typed" in pyproject()["tool"]["setuptools"]["package-data"]["fairseq_modattn"]


def test_built_wheel_ships_py_typed_and_the_metadata(tmp_path):
    """The wheel pip builds from the tree carries py.typed (PEP 561) and the declared Python floor."""
    import zipfile

    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("fairseq_modattn-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "fairseq_modattn/py.typed" in names
    assert "fairseq_modattn/demo/static/index.html" in names
    assert "Requires-Python: >=3.11" in metadata
    assert "Requires-Dist: fairseq-fixed<0.13,>=0.12.3" in metadata


def test_gitignore_covers_what_readmes_commands_write_in_the_checkout():
    """A user who runs README's commands in the checkout gets no untracked data-bins, corpora,
    checkpoints or quickstart runs in `git status`."""
    readme = (REPO / "README.md").read_text()
    flags = r"--(?:output-dir|raw-dir|save-dir|destdir|dest|checkpoint-dir)"
    written = {m.group(1).split("/")[0] for m in re.finditer(rf"{flags}[ =]([\w.-][\w./-]*)", readme)}
    assert {"quickstart", "raw", "data-bin", "checkpoints"} <= written, written
    ignored = {line.strip().strip("/") for line in (REPO / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith(("#", "!"))}
    assert not written - ignored, sorted(written - ignored)
