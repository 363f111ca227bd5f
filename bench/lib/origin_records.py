"""An origin's object records where it keeps them, read from outside the origin (tests and benches).

An origin's default (``--records store``) keeps its object records beside its blobs
(``records.sqlite3`` in a folder store, ``records/`` in an s3:// bucket) and the registry
keeps the rest; ``--records registry`` keeps them all in the registry. ``open_records``
answers like the origin's own registry in either case, so a check written against "the
records" holds for both.
"""

from __future__ import annotations

import os

from kdn.origin.s3records import open_records as open_store_records
from kdn.registry import KVRegistry, open_registry
from kdn.registry.split import RecordsBeside


def open_records(registry_url: str, store: str | os.PathLike[str] | None, *,
                 credentials: str | os.PathLike[str] | None = None) -> KVRegistry | RecordsBeside:
    """The registry at ``registry_url`` with, unless ``store`` is None (an origin on ``--records
    registry``), the object records of the origin store ``store``."""
    control = open_registry(registry_url)
    if store is None:
        return control
    if not isinstance(control, KVRegistry):
        raise TypeError(f"records beside a store split a KVRegistry, not {control!r}")
    return RecordsBeside(control, open_store_records(store, credentials=credentials))
