"""``fairseq-modattn flags``: the model flags fairseq-train -h cannot show, with each
architecture's defaults."""

import subprocess
import sys

import pytest

from conftest import MODATTN_MAIN, run_commands
from fairseq_modattn.cli.main import main


def run(*argv):
    return subprocess.run(
        [sys.executable, "-m", "fairseq_modattn.cli.main", *argv], capture_output=True, text=True, timeout=120
    )


def test_lists_the_plugin_architectures(capsys):
    assert main(["flags"]) == 0
    out = capsys.readouterr().out
    assert "dma_transformer_iwslt_de_en_tiny" in out and "dma_transformer_wmt_zh_en" in out
    assert " transformer_iwslt_de_en " not in out  # fairseq's own architectures are not listed


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("dma_transformer_iwslt_de_en", {"--dma-clusters": "8", "--dma-qq-weight": "100.0"}),
        ("dma_transformer_iwslt_de_en_tiny", {"--dma-clusters": "4", "--dma-qq-weight": "50.0"}),
        ("dma_transformer_wmt_zh_en", {"--dma-centroid-grad-mult": "5.0", "--dma-xq-weight": "5.0"}),
    ],
)
def test_shows_each_flag_with_the_architecture_default(arch, expected, capsys):
    assert main(["flags", "--arch", arch]) == 0
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for flag, default in expected.items():
        start = out.index(flag + " ", out.index("(DMA):"))
        help_text = out[start:out.index("--dma-", start + len(flag))]
        assert f"(default: {default})" in help_text, (flag, help_text)
    assert "--encoder-layers" not in out


def test_all_adds_the_transformer_flags(capsys):
    assert main(["flags", "--arch", "dma_transformer_iwslt_de_en", "--all"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--encoder-embed-dim" in out and "(default: 512)" in out and "--dma-clusters" in out


def test_bad_input_gives_clear_errors():
    (bad, _, bad_err), (unknown, _, unknown_err) = run_commands([
        (MODATTN_MAIN, ["flags", "--arch", "transformer_nope"]), (MODATTN_MAIN, ["frobnicate"])])
    assert bad == 2 and "unknown architecture 'transformer_nope'" in bad_err
    assert "dma_transformer_iwslt_de_en" in bad_err
    assert unknown == 2 and "unknown command 'frobnicate'" in unknown_err
    assert run("--help").returncode == 0  # python -m fairseq_modattn.cli.main


def test_console_script_is_installed():
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("fairseq-modattn") == "fairseq_modattn.cli.main:main"
