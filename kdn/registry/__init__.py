"""The registry: models, base relations, objects, manifests, nodes and policies, on etcd or in one SQLite file."""

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
from kdn.registry.records import Admission, BaseRelation, Encoding, Manifest, ModelRecord, NodeRecord, ObjectRecord, Policy
from kdn.registry.relations import RelationStore, find_relation
from kdn.registry.url import default_registry_path, open_registry

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
