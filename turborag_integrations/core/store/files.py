"""Writing a file so that readers see the old version or the new one, never a part of either."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable

TEMP_PREFIX = ".tmp-"


def write_atomically(target: Path, chunks: Iterable[bytes], *, durable: bool = True) -> int:
    """Write chunks to a temp file in target's folder, then rename it over target.

    The rename is atomic: a reader opens either the old file or the complete new one. With
    `durable`, the data is fsynced before the rename, so a crash cannot leave the new name on a
    file whose data never reached the disk. On any error the temp file is removed and the error
    raised; nothing is left behind. Returns the bytes written.
    """
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=TEMP_PREFIX,
                                    suffix="".join(target.suffixes))
    try:
        with os.fdopen(fd, "wb") as f:
            written = sum(f.write(chunk) for chunk in chunks)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        raise
    return written
