"""The native CPU noise generator (modules/philox_normal.c, native_normal.py): its stream restated
in torch and compared bit for bit on every kernel width this CPU runs, its distribution, and
how it is built, found and refused."""

import logging
import math
import subprocess

import pytest
import torch

import tiers
from fairseq_modattn.modules import native_build, native_normal, noise

MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011) of (4, n) uint32 counters held in int64 and a
    (k0, k1) key: 10 rounds of two 32 x 32 -> 64 bit products, the key bumped between rounds."""
    c = [t.clone() for t in counter]
    k0, k1 = key
    for _ in range(10):
        p0, p1 = c[0] * 0xD2511F53, c[2] * 0xCD9E8D57  # < 2^64: int64 wraps, the low 64 bits are right
        c = [((p1 >> 32) & MASK32) ^ c[1] ^ k0, p1 & MASK32, ((p0 >> 32) & MASK32) ^ c[3] ^ k1, p0 & MASK32]
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c


@pytest.mark.parametrize("counter, key, expected", [
    # Random123's known-answer vectors (kat_vectors, philox4x32 10 rounds)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((MASK32,) * 4, (MASK32, MASK32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_the_reference_philox_gives_the_known_answers(counter, key, expected):
    words = philox4x32_10([torch.tensor([c]) for c in counter], key)
    assert tuple(int(w) for w in words) == expected


def f32(value: float) -> torch.Tensor:
    """A C float literal or constant expression: the value rounded to fp32 once."""
    return torch.tensor(value, dtype=torch.float32)


def box_muller(w, w2, scale):
    """The C file's Box-Muller pair of two (n,) word tensors, in its operations and order."""
    u1 = ((w >> 8) + 1).to(torch.float32) * 2.0**-24
    bits = u1.view(torch.int32).to(torch.int64) & MASK32
    e = (bits >> 23) - 127
    m = ((bits & 0x007FFFFF) | 0x3F800000).to(torch.int32).view(torch.float32)
    big = m > f32(1.41421356)
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int64)
    z = (m - 1.0) / (m + 1.0)
    z2 = z * z
    series = z2 * (f32(1.0) / 9.0) + f32(1.0) / 7.0
    for c in (f32(1.0) / 5.0, f32(1.0) / 3.0, f32(1.0)):
        series = series * z2 + c
    log_u1 = (2.0 * z) * series + e.to(torch.float32) * f32(0.693147180559945)
    # correctly rounded, as C's sqrtf is (torch's fp32 sqrt on the CPU may be 1 ulp off; the fp64
    # root of an fp32 value rounds to the fp32 root)
    r = (log_u1 * -2.0).double().sqrt().float() * f32(scale)
    x = w2 >> 8
    quadrant = x >> 22
    t = ((x & 0x3FFFFF).to(torch.float32) * 2.0**-22 - 0.5) * f32(1.5707963267948966)
    t2 = t * t
    inner = t2 * (f32(1.0) / 362880)
    for c in (f32(-1.0) / 5040, f32(1.0) / 120, f32(-1.0) / 6, f32(1.0)):
        inner = t2 * (c + inner) if c != 1.0 else 1.0 + inner
    sin_t = t * inner
    inner = t2 * (f32(1.0) / 40320)
    for c in (f32(-1.0) / 720, f32(1.0) / 24, f32(-0.5)):
        inner = t2 * (c + inner)
    cos_t = 1.0 + inner
    half = f32(0.70710678)
    cos_a = torch.where((quadrant == 1) | (quadrant == 2), -half, half)
    sin_a = torch.where(quadrant >= 2, -half, half)
    return r * (cos_a * cos_t - sin_a * sin_t), r * (sin_a * cos_t + cos_a * sin_t)


def reference_stream(key: int, n: int, scale: float = 1.0) -> torch.Tensor:
    """The first n values of the stream of ``key`` (philox_normal.c's comment): block b's 64
    values are four runs of 16, run j lane l from counter 16 b + l."""
    blocks = -(-n // 64)
    counters = torch.arange(blocks * 16, dtype=torch.int64)
    words = philox4x32_10([counters & MASK32, counters >> 32, torch.zeros_like(counters),
                           torch.zeros_like(counters)], (key & MASK32, key >> 32))
    runs = [*box_muller(words[0], words[1], scale), *box_muller(words[2], words[3], scale)]
    return torch.stack([run.view(blocks, 16) for run in runs], 1).reshape(-1)[:n]


def _library_regardless_of_width():
    """The library, also on a CPU whose widest kernel is below ``MIN_LANES`` (where
    ``library()`` is None); None without a compiler. Called at collection, where the fast
    tier's tests may not start the compiler."""
    cc = native_normal.compiler()
    try:
        return None if cc is None else native_normal.load(native_normal.build(native_normal.cache_dir(), cc))
    except (OSError, subprocess.SubprocessError):  # the tests that need it skip
        return None


LIBRARY = native_normal.library() or _library_regardless_of_width()
#: the kernel widths this CPU runs
WIDTHS = [] if LIBRARY is None else [lanes for lanes in (16, 8, 4) if LIBRARY.modattn_normal_lanes(lanes) == lanes]

needs_library = pytest.mark.skipif(native_normal.library() is None,
                                   reason="the native noise library is not available here (see its log line)")


def fill_with(lanes, out, key, scale=1.0, base=None, parts=None):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_normal, "library", lambda: LIBRARY)
        return native_normal.fill(out, key, scale, base, lanes, parts)


@tiers.starts_processes
def build_into(directory):
    return native_normal.build(directory, native_normal.compiler())


@tiers.starts_processes
def look_for_the_library(monkeypatch):
    """``library()`` as a fresh process finds it (it may run the compiler); the process's own
    result comes back at the test's end (monkeypatch), so later tests do not look again."""
    monkeypatch.setattr(native_normal, "_looked_for", False)
    monkeypatch.setattr(native_normal, "_library", None)
    return native_normal.library()


@pytest.mark.parametrize("lanes", WIDTHS)
@pytest.mark.parametrize("n", [1, 63, 64, 1000, 4096 + 37])
def test_every_kernel_width_gives_the_reference_stream_bit_for_bit(lanes, n):
    key = 0x1234_5678_9ABC_DEF0
    expected = reference_stream(key, n)
    assert torch.equal(fill_with(lanes, torch.empty(n), key), expected)
    base = torch.randn(n)
    shifted = fill_with(lanes, torch.empty(n), key, 0.375, base)
    assert torch.equal(shifted, base + reference_stream(key, n, 0.375))
    in_place = base.clone()
    assert torch.equal(fill_with(lanes, in_place, key, 0.375, in_place), shifted)


@pytest.mark.skipif(not WIDTHS, reason="the native noise library is not available here")
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize("n", [1000, 4096 + 37])
def test_the_parts_of_a_draw_give_the_reference_stream_bit_for_bit(parts, n):
    """The blocks of a draw run in parts on OpenMP's threads: any number of parts, also more
    than blocks or threads, gives the stream's values."""
    key = 0x0FED_CBA9_8765_4321
    base = torch.randn(n)
    drawn = fill_with(WIDTHS[0], torch.empty(n), key, 0.5, base, parts)
    assert torch.equal(drawn, base + reference_stream(key, n, 0.5))


def test_large_draws_take_torchs_threads(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert native_normal.draw_parts(4096 * 512) == 2
    assert native_normal.draw_parts(1000) == 1


@pytest.mark.skipif(len(WIDTHS) < 2, reason="one kernel width on this CPU")
def test_kernel_widths_agree_on_a_long_stream():
    key, n = 2**63 + 12345, 200_003
    first = fill_with(WIDTHS[0], torch.empty(n), key)
    for lanes in WIDTHS[1:]:
        assert torch.equal(fill_with(lanes, torch.empty(n), key), first)


@needs_library
def test_the_stream_is_standard_normal():
    n = 1 << 22
    x = native_normal.fill(torch.empty(n), 987654321).double()
    mean, var = x.mean().item(), x.var().item()
    assert abs(mean) < 5 / math.sqrt(n)
    assert abs(var - 1) < 5 * math.sqrt(2 / n)
    z = x.sort().values
    ks = (torch.special.ndtr(z) - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max().item()
    assert ks < 2.0 / math.sqrt(n)  # Kolmogorov-Smirnov: p ~ 7e-4 at this distance
    for moment, value in ((3, 0.0), (4, 3.0)):
        assert abs((x**moment).mean().item() - value) < 0.02
    assert x.abs().max().item() < 6.5  # the largest value u1 = 2^-24 allows is 5.77
    # neighbours in memory, the two values of a Box-Muller pair and the streams of
    # neighbouring keys are uncorrelated
    other = native_normal.fill(torch.empty(n), 987654322).double()
    pairs = x.view(-1, 4, 16)
    for a, b in ((x[1:], x[:-1]), (pairs[:, 0], pairs[:, 1]), (x, other)):
        a, b = a.reshape(-1), b.reshape(-1)
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 5 / math.sqrt(a.numel())


@needs_library
def test_fill_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        native_normal.fill(torch.empty(4, 4).t(), 1)
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        native_normal.fill(torch.empty(8, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="base has 4 values"):
        native_normal.fill(torch.empty(8), 1, base=torch.empty(4))


def test_the_library_is_built_once_per_source_and_compiler(tmp_path):
    if native_normal.compiler() is None:
        pytest.skip("no C compiler here")
    path = build_into(tmp_path)
    stamp = path.stat().st_mtime_ns
    assert build_into(tmp_path) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left behind
    lib = native_normal.load(path)
    assert lib.modattn_normal_lanes(4) == 4


@pytest.mark.parametrize("setting, min_lanes, message", [
    ({native_normal.DISABLE_VARIABLE: "0"}, None, None),
    ({"CC": "false", "PATH": ""}, None, "no C compiler"),
    ({"CC": "false"}, None, "could not build philox_normal.c"),
    ({}, 32, "this CPU has no AVX2"),  # a CPU whose widest kernel is narrower than MIN_LANES
])
def test_without_the_library_noise_falls_back_with_one_log_line(setting, min_lanes, message, tmp_path, monkeypatch,
                                                                 caplog):
    monkeypatch.setenv(native_normal.CACHE_VARIABLE, str(tmp_path / "cache"))
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    if "CC" in setting:  # only $CC and cc: Python's own compiler may be an absolute path
        monkeypatch.setattr(native_build.sysconfig, "get_config_var", lambda name: None)
    if min_lanes is not None:
        monkeypatch.setattr(native_normal, "MIN_LANES", min_lanes)
    with caplog.at_level(logging.INFO, logger=native_normal.__name__):
        assert look_for_the_library(monkeypatch) is None
        assert native_normal.library() is None  # looked for once
    lines = [r.getMessage() for r in caplog.records if r.name == native_normal.__name__]
    if message is None:
        assert lines == []
    else:
        assert len(lines) == 1 and message in lines[0]
    assert not noise.uses_native(torch.device("cpu"))


def test_the_fallbacks_leave_the_sessions_library_in_place():
    # runs after them (a file's tests run in order): a later test that draws noise finds the
    # library the session loaded and does not look again (the fast tier may not build it)
    usable = LIBRARY is not None and LIBRARY.modattn_normal_lanes(0) >= native_normal.MIN_LANES
    assert native_normal.library() is (LIBRARY if usable else None)
