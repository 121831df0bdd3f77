"""Read and write URIs: a plain path, `file://...`, or `s3://bucket/key`.

S3 endpoint and credentials come from the standard AWS variables (`AWS_ENDPOINT_URL`,
`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION`), so MinIO, SeaweedFS and AWS all
work. Writes are atomic: a reader sees the old file or the whole new one, and a folder as one writer
left it, or not at all.

The package, by job:
- `uris`: telling the kinds of URI apart, parsing and joining them; `StoreError`.
- `s3`: the S3 client, the budgeted retries around every call, multipart upload, listing.
- `files`: one file at a URI: read, write, streamed copies to and from local files, exists, delete,
  list, and the pre-flight `check_writable`.
- `folders`: folders published whole behind a completion marker, and a stage's outputs as a set.
- `copies`: a complete folder copied to another URI (server-side on S3), published as a folder.
- `unpublished`: the versions no marker names: a failed write's, removed at once or by the next write,
  and `clean_unpublished`, which clears a work prefix of dead writers' versions and uploads.

Callers use the names re-exported here (`store.write_bytes(...)`, `from dynamicrubric.store import
StoreError`). A test that replaces a module-level name must replace it in the module that looks it up
(`dynamicrubric.store.s3.MULTIPART_THRESHOLD`, `dynamicrubric.store.folders._exchange`): setting it
here only rebinds this package's copy of the name.
"""

from __future__ import annotations

from dynamicrubric.store.copies import copy_dir
from dynamicrubric.store.files import (
    check_writable,
    copy_file,
    delete,
    download_file,
    exists,
    list_files,
    read_bytes,
    upload_file,
    write_bytes,
)
from dynamicrubric.store.folders import (
    COMPLETE_MARKER,
    VERSIONS_DIR,
    delete_dir,
    download_dir,
    folder_file,
    folder_files,
    is_complete,
    new_token,
    outputs_as_a_set,
    pinned_folder,
    publish_version,
    read_manifest,
    upload_dir,
    upload_version,
)
from dynamicrubric.store.locks import held_for_writing
from dynamicrubric.store.s3 import (
    DEFAULT_RETRY_BUDGET_S,
    DEFAULT_STALE_UPLOAD_S,
    FAILURE_SLACK_S,
    MULTIPART_THRESHOLD,
    PART_SIZE,
    READ_TIMEOUT_ENV,
    RETRY_BUDGET_ENV,
    STALE_UPLOAD_ENV,
    abort_stale_uploads,
    read_timeout_s,
    reset_client,
    retry_budget_s,
)
from dynamicrubric.store.unpublished import MarkerOutcomeUnknown, clean_unpublished, discard_version
from dynamicrubric.store.uris import StoreError, canonical, is_s3, join, local_path, split_s3, within

__all__ = [
    "COMPLETE_MARKER",
    "DEFAULT_RETRY_BUDGET_S",
    "DEFAULT_STALE_UPLOAD_S",
    "FAILURE_SLACK_S",
    "MULTIPART_THRESHOLD",
    "PART_SIZE",
    "READ_TIMEOUT_ENV",
    "RETRY_BUDGET_ENV",
    "STALE_UPLOAD_ENV",
    "VERSIONS_DIR",
    "MarkerOutcomeUnknown",
    "StoreError",
    "abort_stale_uploads",
    "canonical",
    "held_for_writing",
    "check_writable",
    "clean_unpublished",
    "copy_dir",
    "copy_file",
    "delete",
    "delete_dir",
    "discard_version",
    "download_dir",
    "download_file",
    "exists",
    "folder_file",
    "folder_files",
    "is_complete",
    "is_s3",
    "join",
    "list_files",
    "local_path",
    "new_token",
    "outputs_as_a_set",
    "pinned_folder",
    "publish_version",
    "read_bytes",
    "read_manifest",
    "read_timeout_s",
    "reset_client",
    "retry_budget_s",
    "split_s3",
    "upload_dir",
    "upload_file",
    "upload_version",
    "within",
    "write_bytes",
]
