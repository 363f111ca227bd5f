"""The registry: models, base relations, objects, manifests, nodes and policies, on etcd or in one SQLite file."""

from typing import TYPE_CHECKING, Any

# Eager: ``follow`` names a module of this package too, whose import would otherwise shadow the function.
from kdn.registry.follow import follow

if TYPE_CHECKING:  # (for readers and type checkers; at run time each name loads when first asked for, so that
    # importing one module of the registry -- url.py's --registry option, a record type -- loads no etcd client)
    from kdn.registry.base import (
        DEFAULT_PREFIX,
        Compactable,
        Event,
        KVRegistry,
        ManifestStore,
        Membership,
        ModelStore,
        ObjectStore,
        PolicyStore,
        Registry,
        Watchable,
    )
    from kdn.registry.embedded import EmbeddedRegistry
    from kdn.registry.lease import NodeLease
    from kdn.registry.etcd import EtcdRegistry
    from kdn.registry.records import (Admission, BaseRelation, Encoding, Manifest, ModelRecord, NodeRecord, ObjectRecord,
                                      Policy)
    from kdn.registry.relations import RelationStore, find_relation
    from kdn.registry.url import default_registry_path, open_registry

_WHERE = {name: f"kdn.registry.{module}" for module, names in (
    ('base', ('DEFAULT_PREFIX', 'Compactable', 'Event', 'KVRegistry', 'ManifestStore', 'Membership', 'ModelStore', 'ObjectStore', 'PolicyStore', 'Registry', 'Watchable')),
    ('embedded', ('EmbeddedRegistry',)),
    ('lease', ('NodeLease',)),
    ('etcd', ('EtcdRegistry',)),
    ('records', ('Admission', 'BaseRelation', 'Encoding', 'Manifest', 'ModelRecord', 'NodeRecord', 'ObjectRecord', 'Policy')),
    ('relations', ('RelationStore', 'find_relation')),
    ('url', ('default_registry_path', 'open_registry')),
) for name in names}

__all__ = [
    "Admission",
    "BaseRelation",
    "DEFAULT_PREFIX",
    "Compactable",
    "EmbeddedRegistry",
    "Encoding",
    "EtcdRegistry",
    "Event",
    "KVRegistry",
    "Manifest",
    "ManifestStore",
    "Membership",
    "ModelRecord",
    "ModelStore",
    "NodeLease",
    "NodeRecord",
    "ObjectRecord",
    "ObjectStore",
    "Policy",
    "PolicyStore",
    "Registry",
    "RelationStore",
    "Watchable",
    "default_registry_path",
    "find_relation",
    "follow",
    "open_registry",
]


def __getattr__(name: str) -> Any:
    """The public names, each imported when first used."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
