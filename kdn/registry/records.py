"""Registry records: what the registry stores under each key.

Each record is a frozen dataclass stored as msgpack of a plain dict
(``to_dict``/``from_dict``, ``pack``/``unpack``). Reading is tolerant of fields
it does not know (a newer writer may add some) and strict about fields it needs
(a missing one raises ``InvalidInput`` naming it). Every identifier that ends up
in a registry key is validated when the record is built, so a record that exists
is a record that can be stored. What every record shares (the round trips, the
field checks) is ``fields.py``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


from kdn.format.address import Address, Digest, ModelId, canonical_json, validate_address, validate_digest, validate_model_id, validate_name, validate_namespace
from kdn.emphasis import EmphasisMap
from kdn.errors import InvalidInput
from kdn.format.pieces import Pieces
from kdn.registry.fields import Record, check_dict, check_sig, check_str, is_int, is_number, require
from kdn.registry.schedule import Schedule

# "basis": a model-level object (a kvtc basis, kdn/kernels/transform.py) stored and served like a chunk
OBJECT_KINDS = frozenset({"kv", "ssm", "hybrid", "basis"})
POLICY_KINDS = frozenset({"pin", "warm", "push", "ttl", "quota", "upper"})

MAX_URL_LEN = 512
# Partial tails one object record may list: one per length below its chunk's, so a chunk of up to 4,097 tokens
# can list them all. Checked before each tail is, so a planted record of 200,000 tails is refused at once.
MAX_TAILS = 4096


def validate_node_url(url: object) -> str:
    """A node's base URL: ``http(s)://HOST[:PORT][/PATH]`` and nothing else.

    Edges send their upstream token to the URLs node records name, and clients
    follow them: no userinfo (``http://user@evil`` reads like a host), no query
    or fragment, no whitespace or control characters, a bounded length.
    """
    require(isinstance(url, str), f"node URL must be a string, got {type(url).__name__}")
    assert isinstance(url, str)
    require(0 < len(url) <= MAX_URL_LEN, f"node URL must be 1..{MAX_URL_LEN} characters")
    require(url.isprintable() and not any(c.isspace() for c in url), f"node URL {url[:80]!r} has spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise InvalidInput(f"node URL {url[:80]!r}: {e}") from None
    require(parts.scheme in ("http", "https"), f"node URL {url[:80]!r} must be http:// or https://")
    require(bool(parts.hostname), f"node URL {url[:80]!r} has no host")
    require(parts.username is None and parts.password is None and "@" not in parts.netloc,
             f"node URL {url[:80]!r} must not carry a user or password")
    require(not parts.query and not parts.fragment and "?" not in url and "#" not in url,
             f"node URL {url[:80]!r} must not carry a query or fragment")
    require(port is None or port > 0, f"node URL {url[:80]!r} has port 0")
    return url


def validate_manifest_ref(value: object) -> str:
    """``"namespace/name"``: how a policy names a manifest."""
    if not isinstance(value, str) or value.count("/") != 1:
        raise InvalidInput(f"invalid manifest reference {str(value)[:80]!r}: expected 'namespace/name'")
    ns, name = value.split("/")
    validate_namespace(ns)
    validate_name(name)
    return value


@dataclass(frozen=True)
class ModelRecord(Record):
    model_id: ModelId
    name: str
    architecture: str
    dtype: str
    chunk_tokens: int
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    sig: dict[str, str] = field(default_factory=dict)  # the origin's signature (kdn/registry/signing.py), as its objects'

    def __post_init__(self) -> None:
        validate_model_id(self.model_id)
        for n in ("name", "architecture", "dtype"):
            check_str("ModelRecord", n, getattr(self, n))
        require(is_int(self.chunk_tokens) and self.chunk_tokens > 0, "ModelRecord.chunk_tokens must be a positive int")
        check_dict("ModelRecord", "config", self.config)
        check_dict("ModelRecord", "extra", self.extra)
        check_sig("ModelRecord", self.sig)


MAX_RELATION_LAYERS = 4096


@dataclass(frozen=True)
class BaseRelation(Record):
    """A publisher's word that model ``variant`` derives from model ``base`` (a fine-tune, a merged LoRA), and
    how the variant reads the base's states: it recomputes layers ``recompute`` of its ``layers`` itself (its
    layer plan, measured once for the pair: ``kdn.adapters.hf.variants``) and takes the base's K/V for the rest,
    within ``budget`` of ``metric`` (``nll%``: continuation NLL increase in %; ``kl``: nats a token) measured on
    the plan's samples (``measured``). Signed (kdn/registry/signing.py); a consumer uses it only where it asked to."""

    variant: ModelId
    base: ModelId
    layers: int  # the models' decoder layers (the same architecture on both sides)
    recompute: list[int]  # ascending layer indices the variant recomputes; the others take the base's K/V
    metric: str  # "nll%" | "kl"
    budget: float  # the quality budget the plan was picked for, in ``metric``'s unit
    measured: dict[str, Any] = field(default_factory=dict)  # what the measurement found (small, numbers)
    name: str = ""  # a label for people ("smollm2-135m+handbook")
    created: float = field(default_factory=time.time)
    sig: dict[str, str] = field(default_factory=dict)
    # Per variant, rising with every relation its publisher issues (``issued``: ``kdn relation sign``); signed,
    # with ``created``, so a consumer that took version v refuses an older relation written back (0: signed
    # before versions, the lowest).
    version: int = 0
    # A signed tombstone (``kdn relation rm``): the publisher withdrew the relation at ``version``. Its plan is
    # every layer (the one that uses no base state) and it measured nothing.
    deleted: bool = False

    def __post_init__(self) -> None:
        validate_model_id(self.variant)
        validate_model_id(self.base)
        require(self.variant != self.base, "BaseRelation: a model is not its own variant")
        require(is_int(self.layers) and 0 < self.layers <= MAX_RELATION_LAYERS,
                 f"BaseRelation.layers must be an int in 1..{MAX_RELATION_LAYERS}")
        r = self.recompute
        require(isinstance(r, list) and all(is_int(i) and 0 <= i < self.layers for i in r)
                 and all(a < b for a, b in zip(r, r[1:])),
                 "BaseRelation.recompute must be ascending, distinct layer indices below layers")
        require(self.metric in ("nll%", "kl"), f"BaseRelation.metric must be 'nll%' or 'kl', got {self.metric!r}")
        require(is_number(self.budget) and self.budget >= 0, "BaseRelation.budget must be a number >= 0")
        check_dict("BaseRelation", "measured", self.measured)
        try:  # signed as canonical JSON: finite numbers, strings, lists and maps only
            size = len(canonical_json(self.measured))
        except (TypeError, ValueError):
            raise InvalidInput("BaseRelation.measured must hold JSON values (finite numbers)") from None
        require(size <= 4096, "BaseRelation.measured is over 4 KiB")
        require(isinstance(self.name, str) and len(self.name) <= 128, "BaseRelation.name must be a short string")
        require(is_number(self.created), "BaseRelation.created must be a number")
        check_sig("BaseRelation", self.sig)
        require(is_int(self.version) and 0 <= self.version < 1 << 63, "BaseRelation.version must be an int >= 0")
        require(isinstance(self.deleted, bool), "BaseRelation.deleted must be a bool")
        require(not self.deleted or (self.recompute == list(range(self.layers)) and not self.measured),
                "a deleted BaseRelation (a tombstone) recomputes every layer and measured nothing")

    def issued(self, above: int = 0, now: float | None = None) -> BaseRelation:
        """This relation as its publisher issues it, unsigned (sign it next): created ``now``, versioned in
        milliseconds of it, above its own version and ``above`` (the stored one's, where its publisher's key
        signed that one), so a later issue of a variant supersedes the earlier ones even where the clock went
        back."""
        t = time.time() if now is None else now
        version = max(int(t * 1000), self.version + 1, above + 1)
        return dataclasses.replace(self, version=version, created=t, sig={})

    def tombstone(self) -> BaseRelation:
        """What withdrawing this relation records (versioned when issued): the same variant and base, a plan
        of every layer, nothing measured."""
        return dataclasses.replace(self, recompute=list(range(self.layers)), measured={}, sig={}, deleted=True)

    @property
    def depth(self) -> int | None:
        """k when the plan is the first k layers (what a consumer without the base's hidden states can run:
        layers [0, k) recomputed from the embeddings); None for any other set."""
        return len(self.recompute) if self.recompute == list(range(len(self.recompute))) else None


@dataclass(frozen=True)
class Encoding(Record):
    """One stored encoding of an object (``raw``, ``zstd-planes``, ``int8``...)."""

    name: str
    size: int
    digest: Digest  # BLAKE3 hex of the blob in this encoding
    # The BLAKE3 of each ``piece_bytes`` piece of the blob, in order (kdn/format/pieces.py: verified streaming);
    # none for a blob of one piece and in records from before pieces (those are verified whole).
    piece_bytes: int = 0
    pieces: tuple[Digest, ...] = ()

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and bool(self.name), "Encoding.name must be a non-empty string")
        require(is_int(self.size) and self.size >= 0, "Encoding.size must be a non-negative int")
        validate_digest(self.digest)
        checked = Pieces.checked(self.size, self.piece_bytes, self.pieces)  # raises InvalidInput if inconsistent
        object.__setattr__(self, "pieces", checked.digests if checked else ())  # a list from msgpack: a tuple

    @property
    def piece_list(self) -> Pieces | None:
        """The blob's pieces as ``kdn.format.pieces`` verifies them (None: verified whole)."""
        return Pieces(self.piece_bytes, self.pieces) if self.pieces else None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "size": self.size, "digest": self.digest}
        if self.pieces:  # absent, not empty, when there are none: records stay as small as before
            d["piece_bytes"], d["pieces"] = self.piece_bytes, list(self.pieces)
        return d


@dataclass(frozen=True)
class ObjectRecord(Record):
    """One chunk's states: where it sits in a prefix chain and how it is stored."""

    address: Address
    model_id: ModelId
    namespace: str
    kind: str  # "kv" | "ssm" | "hybrid"
    start: int
    end: int
    parent: Address | None
    standalone: bool
    encodings: dict[str, Encoding]
    origin: str  # node id or URL that produced it
    tails: dict[int, Address] = field(default_factory=dict)  # partial child length -> its address
    created: float = field(default_factory=time.time)
    # The engine that computed the states, "transformers 5.19.0" / "vllm 0.32.0" ("" in records from
    # before it was kept). The model id pins the weights, but each engine's kernels round differently.
    engine: str = ""
    sig: dict[str, str] = field(default_factory=dict)  # {"key": key id, "ed25519": hex}: the origin's signature (kdn/registry/signing.py)

    def __post_init__(self) -> None:
        validate_address(self.address)
        validate_model_id(self.model_id)
        validate_namespace(self.namespace)
        require(self.kind in OBJECT_KINDS, f"ObjectRecord.kind must be one of {sorted(OBJECT_KINDS)}, got {self.kind!r}")
        require(
            is_int(self.start) and is_int(self.end) and 0 <= self.start < self.end,
            f"ObjectRecord span must be ints with 0 <= start < end, got [{self.start!r}, {self.end!r})",
        )
        if self.parent is not None:
            validate_address(self.parent, what="parent address")
        require(isinstance(self.standalone, bool), "ObjectRecord.standalone must be a bool")
        check_dict("ObjectRecord", "encodings", self.encodings)
        for k, enc in self.encodings.items():
            require(isinstance(enc, Encoding) and enc.name == k, f"ObjectRecord.encodings[{k!r}] must be an Encoding named {k!r}")
        check_str("ObjectRecord", "origin", self.origin)
        check_dict("ObjectRecord", "tails", self.tails)
        require(len(self.tails) <= MAX_TAILS, f"ObjectRecord.tails lists {len(self.tails)} tails, over {MAX_TAILS}")
        for length, addr in self.tails.items():
            # A tail continues this (full) chunk by fewer tokens than a chunk holds: its span is the chunk's size.
            require(is_int(length) and 0 < length < self.end - self.start,
                    f"ObjectRecord.tails key must be a token count in 1..{self.end - self.start - 1} (shorter than "
                    f"the chunk it continues), got {length!r}")
            validate_address(addr, what="tail address")
        require(is_number(self.created), "ObjectRecord.created must be a number")
        require(isinstance(self.engine, str) and len(self.engine) <= 64, "ObjectRecord.engine must be a short string")
        check_sig("ObjectRecord", self.sig)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["encodings"] = {k: e.to_dict() for k, e in self.encodings.items()}
        # String keys: msgpack readers default to strict map keys, and JSON has no int keys.
        d["tails"] = {str(k): v for k, v in self.tails.items()}
        return d

    @classmethod
    def from_dict(cls, d: object) -> ObjectRecord:
        f = cls.fields_from(d)
        encs = f["encodings"]
        check_dict("ObjectRecord", "encodings", encs)
        f["encodings"] = {k: v if isinstance(v, Encoding) else Encoding.from_dict(v) for k, v in encs.items()}
        tails = f.get("tails", {})
        check_dict("ObjectRecord", "tails", tails)
        require(len(tails) <= MAX_TAILS, f"ObjectRecord.tails lists {len(tails)} tails, over {MAX_TAILS}")
        try:
            f["tails"] = {int(k): v for k, v in tails.items()}
        except ValueError:
            raise InvalidInput("ObjectRecord.tails keys must be token counts") from None
        return cls(**f)

    def with_encoding(self, enc: Encoding) -> ObjectRecord:
        return dataclasses.replace(self, encodings={**self.encodings, enc.name: enc})

    def with_tail(self, length: int, address: Address) -> ObjectRecord:
        return dataclasses.replace(self, tails={**self.tails, length: address})

    def merged(self, newer: ObjectRecord) -> ObjectRecord:
        """``newer`` with this record's other encodings and its tails kept.

        Re-publishing an object must not drop an encoding or a tail that another
        writer added since; the record is content-addressed, so everything else
        is the same anyway. Where both name an encoding, ``newer``'s wins: it is
        what the writer holds now (an origin builds it from the blob in its own
        store), while a stored record may carry a digest planted by someone who
        can write the registry. (Rot in the origin's store is found by the digest
        written beside each blob, so a re-publish never re-hashes a rotten file.)
        """
        return dataclasses.replace(
            newer,
            encodings={**self.encodings, **newer.encodings},
            tails={**self.tails, **newer.tails},
            created=min(self.created, newer.created),
            # Stored blobs are never rewritten, so the bytes stay the first producer's.
            engine=self.engine or newer.engine,
        )


@dataclass(frozen=True)
class Manifest(Record):
    """One published item: its prefix chain, in order, and the exact tokens it covers."""

    namespace: str
    name: str
    model_id: ModelId
    addresses: list[Address]  # prefix chain, in order
    tokens: int  # total tokens published
    chunk_tokens: int
    prefix_tokens: list[int]  # the token ids published, template prefix included
    template: str | None = None
    standalone: list[Address] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    head_tokens: int = 0  # leading tokens of prefix_tokens that come from the template / prefix text
    extra: dict[str, Any] = field(default_factory=dict)
    sig: dict[str, str] = field(default_factory=dict)  # the origin's signature (kdn/registry/signing.py)
    # Which published tokens matter (kdn/emphasis.py, wire form); signed with the rest. None: no map.
    emphasis: dict[str, Any] | None = None
    # Per name, rising with every publish (the registry sets it: ``put_manifest``); signed, with ``created``,
    # so a consumer that saw version v refuses an older manifest replayed to it (0: from before versions).
    version: int = 0
    # A signed tombstone: the name was deleted (at ``version``). It names no objects and no tokens, so a
    # replay of an older manifest of the name is refused by version, like any superseded one.
    deleted: bool = False
    # A pointer (``pointer``): the whole manifest is stored where the object records are (an origin with
    # ``--records store``), under this BLAKE3 of its packed bytes; the registry keeps only the name, version
    # and sizes. None: this is the whole manifest.
    body: Digest | None = None

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        validate_name(self.name)
        require(isinstance(self.deleted, bool), "Manifest.deleted must be a bool")
        require(not self.deleted or not (self.addresses or self.prefix_tokens or self.standalone or self.tokens),
                 "a deleted Manifest (a tombstone) names no objects and no tokens")
        require(is_int(self.version) and 0 <= self.version < 1 << 63, "Manifest.version must be an int >= 0")
        if self.body is not None:
            validate_digest(self.body)
            require(not (self.addresses or self.prefix_tokens or self.standalone or self.emphasis or self.head_tokens),
                     "a Manifest pointer (body) carries no objects, tokens or map: they are in its body")
        if self.emphasis is not None:
            EmphasisMap.from_dict(self.emphasis, n_tokens=len(self.prefix_tokens)
                                  if isinstance(self.prefix_tokens, list) else 0)
        require(is_int(self.head_tokens) and 0 <= self.head_tokens <= len(self.prefix_tokens),
                 "Manifest.head_tokens must be an int within prefix_tokens")
        require(isinstance(self.extra, dict), "Manifest.extra must be a map")
        check_sig("Manifest", self.sig)
        validate_model_id(self.model_id)
        require(isinstance(self.addresses, list), "Manifest.addresses must be a list")
        for a in self.addresses:
            validate_address(a)
        require(is_int(self.tokens) and self.tokens >= 0, "Manifest.tokens must be a non-negative int")
        require(is_int(self.chunk_tokens) and self.chunk_tokens > 0, "Manifest.chunk_tokens must be a positive int")
        require(
            isinstance(self.prefix_tokens, list) and all(is_int(t) and t >= 0 for t in self.prefix_tokens),
            "Manifest.prefix_tokens must be a list of non-negative ints",
        )
        check_str("Manifest", "template", self.template, optional=True)
        require(isinstance(self.standalone, list), "Manifest.standalone must be a list")
        for a in self.standalone:
            validate_address(a, what="standalone address")
        require(is_number(self.created), "Manifest.created must be a number")

    def tombstone(self) -> Manifest:
        """What deleting this name records: the same name and model, nothing in it (versioned when stored)."""
        return Manifest(namespace=self.namespace, name=self.name, model_id=self.model_id, addresses=[], tokens=0,
                        chunk_tokens=self.chunk_tokens, prefix_tokens=[], deleted=True)

    def pointer(self, body: Digest) -> Manifest:
        """What the registry keeps of this manifest when its whole (``body``: the BLAKE3 of its ``pack()``) is
        stored beside the object records: name, model, version, sizes; unsigned until its writer signs it."""
        return dataclasses.replace(self, addresses=[], prefix_tokens=[], standalone=[], emphasis=None, head_tokens=0,
                                   sig={}, body=body)

    def points_at(self, full: Manifest) -> bool:
        """Whether ``full`` is the body this pointer names: same name, model, version (its digest was checked
        by whoever read it)."""
        return (self.body is not None and full.body is None
                and (full.namespace, full.name, full.model_id, full.version, full.tokens)
                == (self.namespace, self.name, self.model_id, self.version, self.tokens))

    @property
    def ref(self) -> str:
        """``"namespace/name"``, as policies name it."""
        return f"{self.namespace}/{self.name}"

    @property
    def emphasis_map(self) -> EmphasisMap | None:
        """The parsed emphasis map (validated when the record was built), or None."""
        return None if self.emphasis is None else EmphasisMap.from_dict(self.emphasis)


@dataclass(frozen=True)
class NodeRecord(Record):
    role: str  # "origin" | "edge" | ...
    region: str
    node_id: str
    url: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_node_names("NodeRecord", self)
        check_dict("NodeRecord", "extra", self.extra)


def _check_node_names(rec: str, node: NodeRecord | Admission) -> None:
    """A node's role, region and id are names, its URL a node URL (a node record and its admission)."""
    for n in ("role", "region", "node_id"):
        v = getattr(node, n)
        check_str(rec, n, v)
        validate_name(v)
    validate_node_url(node.url)


@dataclass(frozen=True)
class Admission(Record):
    """An operator's word that a node may serve: its role, region, id and URL, until ``expires``.

    Made by ``kdn node admit`` (signed by an operator key, kdn/registry/signing.py); a node started with
    ``--admission FILE`` carries it in its node record (``extra["admission"]``). Readers that
    require admissions (edges with ``--require-admission``, ``KDNClient.from_registry(admitted_by=)``)
    leave out every node record without one that verifies and names that record's own fields, so
    a registry writer without an operator key cannot point requests at a server of its choice.
    """

    role: str
    region: str
    node_id: str
    url: str
    expires: float  # Unix time; past it the node is left out until it is admitted again
    sig: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_node_names("Admission", self)
        require(isinstance(self.expires, (int, float)) and not isinstance(self.expires, bool)
                 and math.isfinite(self.expires) and self.expires > 0,
                 f"Admission.expires must be a positive, finite Unix time, got {self.expires!r}")
        check_sig("Admission", self.sig)

    def names(self, node: NodeRecord) -> bool:
        """Whether this admits exactly ``node`` (its role, region, id and URL)."""
        return (self.role, self.region, self.node_id, self.url.rstrip("/")) == (
            node.role, node.region, node.node_id, node.url.rstrip("/"))


@dataclass(frozen=True)
class Policy(Record):
    """An operator rule (pin, warm, push, ttl, quota), scoped by region, manifest and/or namespace; or the choice
    of the upper tier (``upper``: ``region`` names the region every other region fills through). A pin, warm or
    push may hold on a ``schedule`` only."""

    name: str
    kind: str  # "pin" | "warm" | "push" | "ttl" | "quota" | "upper"
    region: str | None = None
    manifest: str | None = None  # "namespace/name"
    namespace: str | None = None
    ttl_s: float | None = None
    quota_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # An operator key's signature (kdn/registry/signing.py; `kdn policy set --operator-key`): edges started with
    # --operator-keys apply only policies one of those keys signed.
    sig: dict[str, str] = field(default_factory=dict)
    # When it holds (kdn/registry/schedule.py; `kdn policy set --at --tz --for`): a pin, warm or push only;
    # None: always. Signed with the rest when present (a policy signed before schedules verifies as it did).
    schedule: Schedule | None = None

    def __post_init__(self) -> None:
        validate_name(self.name)
        require(self.kind in POLICY_KINDS, f"Policy.kind must be one of {sorted(POLICY_KINDS)}, got {self.kind!r}")
        require(self.schedule is None or isinstance(self.schedule, Schedule), "Policy.schedule must be a Schedule")
        if self.region is not None:
            validate_name(self.region)
        if self.manifest is not None:
            validate_manifest_ref(self.manifest)
        if self.namespace is not None:
            validate_namespace(self.namespace)
        require(self.ttl_s is None or (is_number(self.ttl_s) and self.ttl_s >= 0), "Policy.ttl_s must be a number >= 0")
        require(
            self.quota_bytes is None or (is_int(self.quota_bytes) and self.quota_bytes >= 0),
            "Policy.quota_bytes must be an int >= 0",
        )
        check_dict("Policy", "extra", self.extra)
        check_sig("Policy", self.sig)

    @classmethod
    def from_dict(cls, d: object) -> Policy:
        f = cls.fields_from(d)
        if f.get("schedule") is not None:  # the wire form (a map), made a Schedule and checked here
            f["schedule"] = Schedule.from_dict(f["schedule"])
        return cls(**f)
