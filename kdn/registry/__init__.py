"""The registry: models, objects, manifests, nodes and policies, on etcd or in one SQLite file."""

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
from kdn.registry.follow import follow
from kdn.registry.etcd import EtcdRegistry
from kdn.registry.records import Admission, Encoding, Manifest, ModelRecord, NodeRecord, ObjectRecord, Policy
from kdn.registry.url import default_registry_path, open_registry

__all__ = [
    "Admission",
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
    "Watchable",
    "default_registry_path",
    "follow",
    "open_registry",
]
