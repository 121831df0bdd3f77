"""One writer at a time for a local output that takes long to write (a training stage's checkpoint).

Two `train-policy` runs into one output both passed the checks, trained into the same work folder,
and the first to finish removed it under the other (a FileNotFoundError, three tracebacks). A local
output is held with an exclusive `flock` on a lock file beside it, `.<name>.lock`, for as long as it
is written; a second writer is refused at once, in one line. The lock file is removed by its holder
when it is done (a killed holder's lock is released by the kernel, and the file is taken over by the
next writer). An S3 output has no such lock: writers in other pods share no filesystem.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from dynamicrubric.store.uris import StoreError, is_s3, local_path, short_name


@contextlib.contextmanager
def held_for_writing(uri: str, writer: str) -> Iterator[None]:
    """Hold the local output `uri` for this process while the block writes it (S3: no lock); another
    `writer` (e.g. "train-policy") holding it already is a StoreError."""
    if is_s3(uri):
        yield
        return
    path = local_path(uri)
    lock = path.parent / f".{short_name(path.name)}.lock"
    # The folders made for the lock go again if nothing was written in them (a refusal writes nothing)
    made = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StoreError(
                    f"{uri}: another {writer} is writing this output now; wait for it to end, or write "
                    "elsewhere"
                ) from None
            try:
                if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                    break  # the file at `lock` is the one locked, not one a finished holder removed
            except FileNotFoundError:
                pass
            os.close(fd)
    except OSError as e:
        raise StoreError(f"{uri}: cannot lock the output for writing: {e.strerror}") from None
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not empty: the output (or another writer's) is in it
                break
