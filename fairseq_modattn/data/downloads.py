"""Raw corpus files: found in --raw-dir and checked, or downloaded, or listed as missing.

``RawFile(name, url, size=None, sha256=None)`` describes one file; ``fetch_raw_files(files,
raw_dir, download=True)`` looks each up in RAW_DIR first (size / sha256 checked; a folder where
a file should be is an error: "is a directory, expected a file") and downloads, with a progress
bar, only the missing ones. When a file cannot be had, one ``DataError`` lists every missing
file with its URL and the exact path to place it at, so an offline user fixes all of them at once.
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

from ..atomic_files import PathLike, atomic_path
from .errors import DataError
from .readers import refuse_non_file
from .steps import sha256sum


@dataclass
class RawFile:
    """A raw corpus file: NAME inside --raw-dir, its public URL, and optional checks."""
    name: str
    url: Optional[str] = None
    size: Optional[int] = None
    sha256: Optional[str] = None
    note: str = ""

    def check(self, path: Path):
        if self.size is not None and path.stat().st_size != self.size:
            raise DataError(f"has {path.stat().st_size} bytes, expected {self.size} "
                            f"(a truncated or wrong file? {self.url or ''})".rstrip(), path)
        if self.sha256 is not None and sha256sum(path) != self.sha256:
            raise DataError(f"sha256 differs from the expected {self.sha256} (a wrong or corrupt file)", path)


def _download(url: str, dest: Path, timeout: float = 30.0):
    import urllib.request

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    with atomic_path(dest) as tmp:
        with urllib.request.urlopen(url, timeout=timeout) as resp, open(tmp, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, file=sys.stderr) if tqdm else None
            for chunk in iter(lambda: resp.read(1 << 16), b""):
                out.write(chunk)
                if bar:
                    bar.update(len(chunk))
            if bar:
                bar.close()


def fetch_raw_files(files: Sequence[RawFile], raw_dir: PathLike, download: bool = True,
                    log: Callable[[str], None] = None) -> Dict[str, Path]:
    """{name: path} of FILES inside RAW_DIR. Files present are checked (size / sha256); missing
    ones are downloaded (progress bar, checked, written atomically) when DOWNLOAD allows and
    the network answers. Otherwise one DataError lists every missing file: where to place it
    and where it comes from."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    raw_dir = Path(raw_dir)
    found, missing = {}, []
    offline = False
    for f in files:  # a folder (or fifo...) where a file belongs: say so, before any work
        refuse_non_file(raw_dir / f.name)
    for f in files:
        path = raw_dir / f.name
        if path.is_file():
            f.check(path)
            found[f.name] = path
            continue
        if download and f.url and not offline:
            log(f"downloading {f.url} -> {path}")
            try:
                _download(f.url, path)
                f.check(path)
                found[f.name] = path
                continue
            except DataError:
                path.unlink(missing_ok=True)
                raise
            except Exception as e:  # network errors of any kind: fall through to the message
                log(f"  download failed: {e}")
                offline = True  # do not wait for every other URL to time out too
        missing.append((f, path))
    if missing:
        lines = [f"{len(missing)} raw file(s) missing"
                 + (" and could not be downloaded (offline?)" if download else " (downloads disabled)")
                 + "; place each file at the path shown and rerun:"]
        for f, path in missing:
            extra = f" [{f.size} bytes]" if f.size else ""
            lines.append(f"  {path}{extra}\n      from {f.url or '(no public URL)'}"
                         + (f"\n      {f.note}" if f.note else ""))
        raise DataError("\n".join(lines))
    return found
