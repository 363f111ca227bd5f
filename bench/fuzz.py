"""Seeded mutation fuzzer over ``decode_object`` and every registered codec's ``decode``.

    python -P bench/fuzz.py [--inputs 100000] [--seed 7] [--jobs 2] [--targets decode_object,zstd,...]
    python -P bench/fuzz.py --seed 7 --targets zstd --index 1234 [--dump FILE]   # replay one input

Targets: ``decode_object`` (with ``read_header``, ``ObjectView`` and the
``expected_digest`` / ``names`` / ``out`` / ``max_decoded`` options) and each
codec registered once ``kdn.kernels`` is imported (raw, zstd, int8, int8z,
int4, cachegen, ans: 31). Input ``i`` of a target is built from
``random.Random(f"{seed}:{target}:{i}")`` alone, so a failure is replayed from
its seed, target and index (``--index``; ``--dump`` writes the input).

- ``decode_object``: blobs made by ``encode_object`` in every encoding (and one
  object per codec), mutated 1-3 times: byte flips, interesting bytes,
  truncation, insertion, deletion, duplication, splicing with another blob,
  the length prefix, the KDN header's JSON text (deep nesting, duplicate
  keys), structured header edits (huge/zero/negative/float/10^4000 dims, 1000
  dims, wrong dtypes, codec names, codec params set to random JSON,
  data_offsets out of range, fields and tensors added, dropped or renamed,
  a tensor swapped for another blob's), payloads mutated with their CRC-32
  fixed up (so corrupt payloads reach the lossy decoders' parsers) and valid
  zstd frames of the wrong size. Plus 4% pure random bytes.
- each codec: valid ``(payload, dtype, shape, params)`` from its own
  ``encode`` of small random tensors, then payload, params, shape and dtype
  mutations (CRC-32 fixed up for lossy codecs 70% of the time); ``out`` is
  passed half the time. Shapes are what ``decode_object`` may hand a codec:
  at most 64 non-negative dims whose non-zero ones multiply to < 2**63, and
  ``nbytes`` at most ``--max-codec-mib`` (a codec trusts the size its caller
  checked: an entropy-coded payload of a few bytes may decode to any size).

Per input: only KDN's own errors may be raised (``decode_object``:
``ObjectFormatError`` or ``CodecError``; a codec: ``CodecError``), each one
line of at most 1024 characters; a success must decode each tensor to exactly
``nbytes(dtype, shape)`` bytes (into ``out`` when given), and an object's total
within its cap (``max_decoded``, else ``MAX_EXPANSION`` x the blob, at least
``MIN_DECODED_CAP``). Exit 1 on any other exception or a broken contract, an
input taking over ``--slow-s`` of CPU, or a target's peak RSS (VmHWM, reset
per target) growing over ``--max-rss-mib``. A watchdog prints the input and
ends the run if one input runs ``--hang-s`` of wall time, so the run always
stops. Targets run in ``--jobs`` processes (one torch thread each); prints a
markdown table.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import struct
import sys
import threading
import time
import traceback
import zlib
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import zstandard

OBJECT_TARGET = "decode_object"
DEFAULT_INPUTS = 100_000
# A small blob may claim MIN_DECODED_CAP (16 MiB) of decoded bytes, and the lossy decoders' working memory
# is up to ~10x what they decode (int32 codes and float32 math for a BF16 tensor: ans-4 10x, cachegen-4 8x).
MAX_RSS_GROWTH_MIB = 256.0
MAX_MESSAGE = 1024  # characters in one error message
ADDR, MODEL, PARENT = "a1" * 32, "b2" * 32, "c3" * 32
DTYPES = ["BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64", "U64", "F64"]
FLOATS = ["F32", "BF16", "F16"]
PARAM_KEYS = ["shuffle", "frames", "level", "axis", "bits", "group", "crc32", "zstd"]
INTERESTING_INTS = [
    0, 1, -1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31,
    2**32 - 1, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 1, -(2**63), -(2**64), 10**30,
    10**300, 10**4000,
]
INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x2C, 0x5B, 0x5D, 0x7B, 0x7D, 0x30, 0x39, 0x2D]


# --- seeds --------------------------------------------------------------------------------


def _tensors(rng: np.random.Generator, n: int, odd: bool) -> dict:
    """Small KV-shaped tensors ([kv_heads, n, head_dim]) plus non-KV states, as RawTensors."""
    from kdn.format.objects import RawTensor

    def rt(name: str, dtype: str, shape: tuple[int, ...]) -> RawTensor:
        x = rng.standard_normal(int(np.prod(shape)), dtype=np.float32)
        if dtype == "BF16":
            data = (x.view(np.uint32) >> 16).astype("<u2").tobytes()
        elif dtype == "F16":
            data = x.astype("<f2").tobytes()
        elif dtype == "F32":
            data = x.astype("<f4").tobytes()
        else:
            data = rng.integers(0, 256, int(np.prod(shape)) * {"I32": 4, "U8": 1}[dtype], dtype=np.uint8).tobytes()
        return RawTensor(name, dtype, shape, data)

    d = 8 if not odd else 5
    out = {
        "L0.k": rt("L0.k", "BF16", (2, n, d)),
        "L0.v": rt("L0.v", "BF16", (2, n, d)),
        "L1.k": rt("L1.k", "F16", (1, n, d)),
        "L1.v": rt("L1.v", "F32", (1, n, d)),
    }
    if odd:
        out["L1.conv"] = rt("L1.conv", "BF16", (1, 6, 4))
        out["L1.ssm"] = rt("L1.ssm", "F32", (3,))
        out["pos"] = rt("pos", "I32", (n,))
        out["empty"] = rt("empty", "F16", (0, 3))
        out["scalar"] = rt("scalar", "F32", ())
    return out


def object_seeds(seed: int) -> list[bytes]:
    """Valid blobs: every object-level encoding, and one object per registered codec."""
    from kdn.format.codecs import codec_names
    from kdn.kernels import encode_as
    from kdn.kernels.codecs import FLOAT_DTYPES
    from kdn.format.objects import encode_object

    rng = np.random.default_rng(seed)
    fields = dict(kind="kv", address=ADDR, model_id=MODEL, namespace="public", start=32, end=64, position=32,
                  parent=PARENT)
    blobs = []
    for enc in ["raw", "zstd", "int8", "int8z", "int4-g32", "int4-g64", "cachegen-4", "cachegen-6-5-4", "ans-5",
                "ans-3-2-2"]:
        for n, odd in ((17, False), (33, True)):
            blobs.append(encode_as(enc, n_layers=2, tensors=_tensors(rng, n, odd), **fields))
    for name in filter(encodes_alone, codec_names()):
        def pick(t, name=name):
            return name if (t.dtype in FLOAT_DTYPES or name in ("raw", "zstd")) and t.shape != () else "zstd"
        blobs.append(encode_object(tensors=_tensors(rng, 9, True), encoding=name, codec_for=pick, **fields))
    return blobs


def encodes_alone(name: str) -> bool:
    """Whether a codec encodes from bytes, dtype and shape alone: kvtc does not (it needs a basis, the layer
    and the positions), so it is fuzzed from hostile payloads only, not from valid objects of its own."""
    from kdn.format.codecs import get_codec
    from kdn.errors import CodecError

    try:
        get_codec(name).encode(np.zeros(4, np.float32).tobytes(), "F32", (4,))
        return True
    except CodecError:
        return False


@dataclass
class CodecSeed:
    payload: bytes
    dtype: str
    shape: tuple[int, ...]
    params: dict


def codec_seeds(name: str, seed: int) -> list[CodecSeed]:
    """Valid encodings of small random tensors by codec ``name`` itself."""
    from kdn.format.codecs import get_codec, itemsize

    codec = get_codec(name)
    rng = np.random.default_rng(seed)
    if not encodes_alone(name):
        return [CodecSeed(rng.bytes(n), dtype, shape, {}) for n, dtype, shape in
                [(64, "BF16", (2, 17, 8)), (600, "F32", (1, 33, 5)), (0, "F16", (7,))]]
    lossy = not codec.lossless
    shapes = [(2, 17, 8), (1, 33, 5), (3, 4), (7,), (), (1, 1, 1), (2, 0, 3), (4, 16, 2), (2, 65, 3)]
    dtypes = FLOATS if lossy else DTYPES
    seeds = []
    for i, shape in enumerate(shapes):
        rotated = dtypes[i % len(dtypes) :] + dtypes[: i % len(dtypes)]
        for dtype in rotated if lossy else rotated[:3]:  # lossless: 3 of the 15 dtypes per shape
            count = int(np.prod(shape))
            if dtype in FLOATS:
                x = (rng.standard_normal(count, dtype=np.float32) * rng.uniform(0.01, 30)).astype(np.float32)
                if i % 3 == 0 and count:
                    x[rng.integers(0, count)] *= 100  # an outlier
                data = {"F32": x.astype("<f4").tobytes(), "F16": x.astype("<f2").tobytes(),
                        "BF16": (x.view(np.uint32) >> 16).astype("<u2").tobytes()}[dtype]
            else:
                data = rng.integers(0, 256, count * itemsize(dtype), dtype=np.uint8).tobytes()
                if i % 2:
                    data = bytes(len(data))  # all zeros: compressible
            payload, params = codec.encode(data, dtype, shape)
            seeds.append(CodecSeed(bytes(payload), dtype, tuple(shape), params))
    return seeds


# --- random values and byte mutations -----------------------------------------------------


def rand_int(r: random.Random) -> int:
    if r.random() < 0.7:
        v = r.choice(INTERESTING_INTS)
        return v if r.random() < 0.85 else v + r.choice((-1, 1))
    return r.randint(-(2**70), 2**70) if r.random() < 0.3 else r.randint(-300, 300)


def rand_json(r: random.Random, depth: int = 0):
    k = r.randrange(10 if depth < 3 else 7)
    if k == 0:
        return None
    if k == 1:
        return r.choice((True, False))
    if k in (2, 3):
        return rand_int(r)
    if k == 4:
        return r.choice((0.0, -0.0, 1.5, 2.0, 8.0, -1.0, 1e308, -1e308, 1e-308, float("nan"), float("inf"), 3.999))
    if k in (5, 6):
        return r.choice(("", "x", "U8", "BF16", "zstd", "raw", "int8-token", "cachegen-4", "\u00e9", "\x00",
                         "a" * 300, "1", "[]", "null"))
    if k in (7, 8):
        return [rand_json(r, depth + 1) for _ in range(r.randrange(5))]
    return {r.choice(PARAM_KEYS + ["x", ""]): rand_json(r, depth + 1) for _ in range(r.randrange(4))}


def mutate_bytes(r: random.Random, b: bytes, others: list[bytes]) -> bytes:
    b = bytearray(b)
    op = r.randrange(9)
    n = len(b)
    if op == 0 and n:  # flip bits
        for _ in range(r.randint(1, 8)):
            b[r.randrange(n)] ^= 1 << r.randrange(8)
    elif op == 1 and n:  # interesting bytes
        for _ in range(r.randint(1, 4)):
            b[r.randrange(n)] = r.choice(INTERESTING_BYTES)
    elif op == 2:  # truncate
        del b[r.randint(0, n) :]
    elif op == 3:  # insert random bytes
        i = r.randint(0, n)
        b[i:i] = r.randbytes(r.choice((1, 2, 4, 8, r.randint(1, 64))))
    elif op == 4 and n:  # delete a range
        i = r.randrange(n)
        del b[i : i + r.randint(1, 64)]
    elif op == 5 and n:  # duplicate a range
        i = r.randrange(n)
        j = min(n, i + r.randint(1, 64))
        b[j:j] = b[i:j]
    elif op == 6 and others:  # splice with another input
        o = r.choice(others)
        b = b[: r.randint(0, n)] + o[r.randint(0, len(o)) :]
    elif op == 7 and n >= 4:  # overwrite a little-endian u16/u32/u64 with an interesting value
        w = r.choice((2, 4, 8))
        if n >= w:
            i = r.randrange(n - w + 1)
            b[i : i + w] = (rand_int(r) % (1 << (8 * w))).to_bytes(w, "little")
    else:  # replace everything with random bytes
        b = bytearray(r.randbytes(r.choice((0, 1, 7, 8, 9, 16, r.randint(0, 4096)))))
    return bytes(b)


# --- structured object mutations ------------------------------------------------------------


def split_blob(blob: bytes) -> tuple[dict, dict, dict[str, bytes]]:
    """(safetensors header without metadata, KDN header, payload per tensor) of a valid blob."""
    (n,) = struct.unpack_from("<Q", blob)
    top = json.loads(blob[8 : 8 + n])
    kdn = json.loads(top.pop("__metadata__")["kdn"])
    data = blob[8 + n :]
    parts = {name: data[e["data_offsets"][0] : e["data_offsets"][1]] for name, e in top.items()}
    return top, kdn, parts


def join_blob(top: dict, kdn, parts: dict[str, bytes], relayout: bool = True, meta=None) -> bytes:
    order = [k for k in top if k in parts]
    if relayout:
        off = 0
        for k in order:
            if isinstance(top[k], dict):
                top[k]["data_offsets"] = [off, off + len(parts[k])]
            off += len(parts[k])
    head = {"__metadata__": meta if meta is not None else {"kdn": json.dumps(kdn, separators=(",", ":"))}, **top}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(parts[k] for k in order)


def mutate_shape(r: random.Random, shape) -> object:
    shape = list(shape) if isinstance(shape, list) else []
    op = r.randrange(9)
    if op == 0 and shape:
        shape[r.randrange(len(shape))] = rand_int(r)
    elif op == 1:
        shape.insert(r.randint(0, len(shape)), rand_int(r) if r.random() < 0.5 else r.choice((0, 1, 2)))
    elif op == 2 and shape:
        shape.pop(r.randrange(len(shape)))
    elif op == 3:
        shape = [0] + [r.choice((2**62, 2**63 - 1, 2**63, 2**64, 10**30, 10**4000)) for _ in range(r.randint(1, 3))]
    elif op == 4:
        shape = [1] * r.choice((33, 65, 70, 1000))
    elif op == 5:
        shape = [r.choice((2**62, 10**4000, 2**63 - 1))] * r.randint(2, 64) + ([0] if r.random() < 0.5 else [])
    elif op == 6 and shape:
        i = r.randrange(len(shape))
        shape[i] = shape[i] * r.choice((2, 3, 16, 1000)) + r.choice((0, 1, -1))
    elif op == 7:
        return rand_json(r)
    else:
        shape = shape[::-1] if shape else [r.randint(0, 9)]
    return shape


def mutate_params(r: random.Random, params) -> object:
    if not isinstance(params, dict) or r.random() < 0.05:
        return rand_json(r) if r.random() < 0.5 else {}
    params = dict(params)
    op = r.randrange(6)
    keys = list(params) or PARAM_KEYS
    if op == 0:
        params[r.choice(keys)] = rand_json(r)
    elif op == 1:
        params[r.choice(keys)] = rand_int(r)
    elif op == 2 and params:
        params.pop(r.choice(keys), None)
    elif op == 3:
        params[r.choice(PARAM_KEYS)] = rand_json(r) if r.random() < 0.5 else rand_int(r)
    elif op == 4 and isinstance(params.get("frames"), list) and params["frames"]:
        fr = [f if isinstance(f, int) else 0 for f in params["frames"]]
        i = r.randrange(len(fr))
        delta = r.choice((1, -1, 2, -2, 100, rand_int(r)))
        fr[i] += delta
        if r.random() < 0.5 and len(fr) > 1:  # keep the sum: move bytes between frames
            fr[(i + 1) % len(fr)] -= delta
        params["frames"] = fr
    else:
        for k in ("shuffle", "axis", "bits", "group", "level"):
            if k in params and r.random() < 0.5:
                params[k] = r.choice((0, 1, 2, 3, 4, 8, 16, 2.0, 4.0, -1, 1 << 16, 1 << 17, True, None, "2"))
    return params


def _fix_crc(params: object, payload: bytes) -> None:
    if isinstance(params, dict) and "crc32" in params:
        params["crc32"] = zlib.crc32(payload)


def mutate_object(r: random.Random, blob: bytes, seeds: list[bytes]) -> bytes:
    """One structured or byte-level mutation of ``blob``."""
    try:
        return _mutate_object(r, blob, seeds)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError):
        # An earlier mutation left JSON that parses but lacks what a structured edit needs
        # (a flipped byte renamed "shape"): mutate its bytes instead. Still a function of the seed.
        return mutate_bytes(r, blob, seeds)


def _mutate_object(r: random.Random, blob: bytes, seeds: list[bytes]) -> bytes:
    k = r.random()
    if k < 0.35:
        return mutate_bytes(r, blob, seeds)
    if k < 0.40:  # the length prefix
        b = bytearray(blob)
        if len(b) >= 8:
            (n,) = struct.unpack_from("<Q", b)
            b[:8] = struct.pack("<Q", r.choice((n + r.choice((-8, -1, 1, 8)), rand_int(r))) % (1 << 64))
        return bytes(b)
    try:
        top, kdn, parts = split_blob(blob)
    except Exception:  # already mutated beyond parsing: stay at the byte level
        return mutate_bytes(r, blob, seeds)
    if not isinstance(kdn, dict) or not isinstance(kdn.get("tensors"), dict) or not parts:
        return mutate_bytes(r, blob, seeds)
    infos = kdn["tensors"]
    name = r.choice(sorted(parts))
    info = infos.get(name)
    if not isinstance(info, dict) or not isinstance(top.get(name), dict):
        return mutate_bytes(r, blob, seeds)
    relayout, meta = True, None
    op = r.randrange(14)
    if op == 0:  # decoded shape
        info["shape"] = mutate_shape(r, info.get("shape"))
    elif op == 1:  # decoded dtype
        info["dtype"] = r.choice(DTYPES) if r.random() < 0.8 else rand_json(r)
    elif op == 2:  # codec name
        from kdn.format.codecs import codec_names
        info["codec"] = r.choice(codec_names()) if r.random() < 0.8 else rand_json(r)
    elif op in (3, 4):  # codec params
        info["params"] = mutate_params(r, info.get("params"))
    elif op == 5:  # stored entry
        e = top[name]
        key = r.choice(("dtype", "shape", "data_offsets"))
        e[key] = {"dtype": lambda: r.choice(DTYPES), "shape": lambda: mutate_shape(r, e["shape"]),
                  "data_offsets": lambda: [rand_int(r), rand_int(r)] if r.random() < 0.5
                  else [e["data_offsets"][0], e["data_offsets"][1] + r.choice((-1, 1, 2**64, -(2**64)))]}[key]()
        relayout = key != "data_offsets"
    elif op == 6:  # payload mutated, its CRC-32 (if any) fixed up: reaches a lossy decoder's parser
        parts[name] = mutate_bytes(r, parts[name], list(parts.values()))
        _fix_crc(info.get("params"), parts[name])
        top[name]["shape"] = [len(parts[name])] if info.get("codec") != "raw" else top[name]["shape"]
    elif op == 7:  # a valid zstd frame of the wrong size in a zstd tensor
        size = max(0, len(parts[name]) * r.choice((1, 2, 4)) + r.choice((0, 0, 1, -1, 100)))
        frame = zstandard.ZstdCompressor(write_content_size=r.random() < 0.8).compress(r.randbytes(size))
        parts[name] = frame
        top[name] = {"dtype": "U8", "shape": [len(frame)], "data_offsets": [0, 0]}
        if isinstance(info.get("params"), dict):
            info["params"]["frames"] = [len(frame)]
            _fix_crc(info["params"], frame)
    elif op == 8:  # header fields
        key = r.choice(list(kdn))
        kdn[key] = rand_json(r) if r.random() < 0.5 else rand_int(r)
    elif op == 9:  # a field dropped or added
        if r.random() < 0.5:
            kdn.pop(r.choice(list(kdn)), None)
        else:
            kdn[r.choice(("extra", "v2", "tensors2"))] = rand_json(r)
    elif op == 10:  # a tensor dropped, renamed or duplicated in one header or both
        w = r.randrange(3)
        if w in (0, 2):
            top.pop(name, None)
            parts.pop(name, None)
        if w in (1, 2):
            infos[r.choice((name + "x", "__metadata__", "", "L9.k"))] = infos.pop(name, info)
    elif op == 11:  # __metadata__ itself
        meta = r.choice(({}, {"kdn": rand_json(r)}, {"kdn": "{}", "x": 1}, None, [], {"kdn": json.dumps(kdn) + " x"}))
        if meta is None:
            meta = {"other": "x"}
    elif op == 12:  # a whole tensor swapped for another blob's
        other = r.choice(seeds)
        try:
            o_top, o_kdn, o_parts = split_blob(other)
        except Exception:
            return blob
        o_name = r.choice(sorted(o_parts))
        top[name], parts[name] = o_top[o_name], o_parts[o_name]
        if r.random() < 0.7:
            infos[name] = o_kdn["tensors"][o_name]
    else:  # kdn header as text, mutated bytewise (duplicate keys, deep nesting, bad escapes)
        text = json.dumps(kdn).encode()
        text = r.choice((
            lambda: mutate_bytes(r, text, []),
            lambda: b"[" * r.choice((100, 1000, 5000)) + text,
            lambda: text[:-1] + b',"v":1}',
            lambda: text.replace(b'"dtype"', b'"dtype":"U8","dtype"', 1),
            lambda: text.replace(b"[", b"[" + b"1," * r.choice((1, 100, 10000)), 1),
        ))()
        meta = {"kdn": text.decode("utf-8", "replace")}
    return join_blob(top, kdn, parts, relayout=relayout, meta=meta)


def representable(shape: object) -> bool:
    """What ``decode_object`` hands a codec: <= 64 non-negative ints whose non-zero dims multiply to < 2**63."""
    if not isinstance(shape, list) or len(shape) > 64 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return False
    n = 1
    for d in shape:
        n *= d or 1
        if n >= 1 << 63:
            return False
    return True


# --- one input: build it, then decode it ---------------------------------------------------


class Anomaly(Exception):
    """A decode that returned but broke its contract (wrong size, over its cap, ``out`` ignored)."""


@dataclass
class ObjectInput:
    blob: bytes
    mode: int  # 0: max_decoded, 1: out=, 2: names=, 3: expected_digest=
    via_view: bool  # ObjectView(...).decode instead of decode_object
    pick: random.Random  # the input's own stream, for choices that need the parsed header


def make_object_input(r: random.Random, seeds: list[bytes]) -> ObjectInput:
    if r.random() < 0.04:  # random bytes, sometimes behind a plausible length prefix
        blob = r.randbytes(r.choice((0, 5, 8, 64, r.randint(0, 2048))))
        if r.random() < 0.5 and len(blob) >= 8:
            blob = struct.pack("<Q", r.randint(0, len(blob) - 8)) + blob[8:]
    else:
        blob = r.choice(seeds)
        for _ in range(r.choice((1, 1, 1, 2, 3))):
            blob = mutate_object(r, blob, seeds)
    return ObjectInput(blob, r.randrange(4), r.random() < 0.2, r)


def check_object(inp: ObjectInput) -> None:
    """Decode one object through the public entry points; a success must respect every bound."""
    from kdn.format.codecs import nbytes
    from kdn.format.objects import (
        MAX_EXPANSION,
        MIN_DECODED_CAP,
        ObjectView,
        blob_digest,
        decode_object,
        decoded_nbytes,
        read_header,
    )

    blob, r = inp.blob, inp.pick
    header = read_header(blob)
    need = decoded_nbytes(header)
    max_decoded = out = names = digest = None
    if inp.mode == 0:
        # A caller's own bound (an engine: its model's chunk size): never more than a chunk could be.
        max_decoded = r.choice((0, 1, 1024, 1 << 20, min(need, 64 << 20)))
    elif inp.mode == 1 and need <= 64 << 20:
        out = bytearray(need + r.choice((0, 0, 64)))
    elif inp.mode == 2 and header.tensors:
        names = r.sample(sorted(header.tensors), r.randint(1, len(header.tensors)))
    elif inp.mode == 3:
        digest = blob_digest(blob)
    if inp.via_view:
        decoded = ObjectView(blob, max_decoded=max_decoded).decode(names, out=out)
    else:
        decoded = decode_object(blob, expected_digest=digest, max_decoded=max_decoded, out=out, names=names).tensors
    cap = max_decoded if max_decoded is not None else max(MIN_DECODED_CAP, MAX_EXPANSION * len(blob))
    if need > cap:
        raise Anomaly(f"header says {need} decoded bytes, over the cap {cap}, and decoding went ahead")
    if sorted(decoded) != sorted(names if names is not None else header.tensors):
        raise Anomaly(f"decoded tensors {sorted(decoded)[:4]}, asked for {sorted(names or header.tensors)[:4]}")
    for name, t in decoded.items():
        info = header.tensors[name]
        want = nbytes(info.dtype, info.shape)
        if memoryview(t.data).nbytes != want or t.dtype != info.dtype or t.shape != info.shape:
            raise Anomaly(f"tensor {name!r} decoded to {memoryview(t.data).nbytes} bytes {t.dtype}{list(t.shape)}, "
                          f"header says {want} bytes {info.dtype}{list(info.shape)}")


@dataclass
class CodecInput:
    payload: bytes
    dtype: str
    shape: tuple[int, ...]
    params: object
    out: str  # "none", "bytearray" or "memoryview"
    as_view: bool  # payload passed as a memoryview (as decode_object does)


def make_codec_input(r: random.Random, seeds: list[CodecSeed], lossy: bool, max_bytes: int) -> CodecInput:
    from kdn.format.codecs import nbytes

    s = r.choice(seeds)
    payload, dtype, shape, params = s.payload, s.dtype, s.shape, json.loads(json.dumps(s.params))
    for _ in range(r.choice((1, 1, 2, 3))):
        op = r.randrange(10)
        if op < 4:
            payload = mutate_bytes(r, payload, [x.payload for x in seeds])
            if lossy and r.random() < 0.7:
                _fix_crc(params, payload)
        elif op < 7:
            params = mutate_params(r, params)
        elif op < 9:
            new = mutate_shape(r, list(shape))
            if representable(new) and (0 in new or nbytes(dtype, tuple(new)) <= max_bytes):
                shape = tuple(new)
        else:
            dtype = r.choice(DTYPES if not lossy or r.random() < 0.3 else FLOATS)
            if 0 not in shape and nbytes(dtype, shape) > max_bytes:
                dtype = "U8"
    return CodecInput(payload, dtype, shape, params, r.choice(("none", "none", "bytearray", "memoryview")),
                      r.random() < 0.5)


def check_codec(name: str, inp: CodecInput) -> None:
    """Decode one payload; a success must be exactly ``nbytes(dtype, shape)`` bytes (written to ``out`` if given)."""
    from kdn.format.codecs import get_codec, nbytes

    want = nbytes(inp.dtype, inp.shape)
    out = None if inp.out == "none" else bytearray(want)
    if inp.out == "memoryview":
        out = memoryview(out)
    data = memoryview(inp.payload) if inp.as_view else inp.payload
    res = get_codec(name).decode(data, inp.dtype, inp.shape, inp.params, out=out)
    got = memoryview(res).nbytes
    if got != want:
        raise Anomaly(f"{name} decoded {got} bytes for {inp.dtype}{list(inp.shape)}, expected {want}")
    if out is not None and memoryview(res).cast("B").tobytes() != bytes(out):
        raise Anomaly(f"{name} was given out= but the bytes it returned are not in it")


# --- the loop ------------------------------------------------------------------------------


@dataclass
class Stats:
    target: str
    inputs: int = 0
    ok: int = 0
    refused: Counter = field(default_factory=Counter)
    unexpected: int = 0
    first_unexpected: list = field(default_factory=list)  # [(index, one line)]
    slowest_ms: float = 0.0  # CPU time of the input's thread: what the decoder itself costs, not the VM's noise
    slowest_index: int = -1
    slowest_wall_ms: float = 0.0
    rss_growth_mib: float = 0.0
    longest_message: int = 0  # characters in the longest refusal's message
    longest_message_index: int = -1
    bad_messages: int = 0  # refusals whose message is not one line of at most MAX_MESSAGE characters
    peak_reset: bool = False
    seconds: float = 0.0


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0), so a target's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def reproducer(seed: int, target: str, index: int) -> str:
    return f"python -P bench/fuzz.py --seed {seed} --targets {target} --index {index}"


class Watchdog(threading.Thread):
    """Prints the input being run and ends the process if one input outlives ``hang_s``."""

    def __init__(self, hang_s: float) -> None:
        super().__init__(daemon=True)
        self.hang_s, self.current, self.t0 = hang_s, None, 0.0

    def run(self) -> None:
        while True:
            time.sleep(min(0.5, self.hang_s / 4))
            cur, t0 = self.current, self.t0
            if cur is not None and time.perf_counter() - t0 > self.hang_s:
                print(f"\nHANG: input still running after {self.hang_s:g} s; replay: {reproducer(*cur)}",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(1)


_SETUP: dict = {}


def _setup(seed: int) -> list[bytes]:
    """Register every codec (``kdn.kernels``), one torch thread per process, and the object seeds."""
    if seed not in _SETUP:
        import torch

        import kdn.kernels  # noqa: F401  (registers the lossy codecs)

        torch.set_num_threads(1)
        _SETUP[seed] = object_seeds(seed)
    return _SETUP[seed]


def _builder(target: str, seed: int, max_codec_bytes: int):
    """(make input from a Random, check it, the exceptions that are refusals) for ``target``."""
    from kdn.format.codecs import get_codec
    from kdn.errors import CodecError, ObjectFormatError

    if target == OBJECT_TARGET:
        seeds = _setup(seed)
        return (lambda r: make_object_input(r, seeds)), check_object, (ObjectFormatError, CodecError)
    _setup(seed)
    seeds = codec_seeds(target, seed)
    lossy = not get_codec(target).lossless
    return (lambda r: make_codec_input(r, seeds, lossy, max_codec_bytes)), (lambda inp: check_codec(target, inp)), (CodecError,)


def fuzz_target(target: str, seed: int, inputs: int, max_codec_bytes: int, hang_s: float) -> Stats:
    from kdn.errors import KDNError

    make, check, refusals = _builder(target, seed, max_codec_bytes)
    for i in range(200):  # warm up (first calls import, allocate pools): the slowest input is then an input's own
        try:
            check(make(random.Random(f"warm:{seed}:{target}:{i}")))
        except Exception:  # noqa: BLE001, S110 - the timed loop below reports everything
            pass
    dog = Watchdog(hang_s)
    dog.start()
    st = Stats(target)
    st.peak_reset = _reset_peak()
    rss0 = _status_kib("VmRSS")
    t_start = time.perf_counter()
    seen: set = set()
    for i in range(inputs):
        if i % 1000 == 0:  # a hang inside C code that holds the GIL starves the watchdog; this still ends it
            faulthandler.dump_traceback_later(max(2 * hang_s, 60.0), exit=True)
        inp = make(random.Random(f"{seed}:{target}:{i}"))
        dog.current, dog.t0 = (seed, target, i), time.perf_counter()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            check(inp)
            st.ok += 1
        except refusals as e:
            st.refused[type(e).__name__] += 1
            msg = str(e)
            if len(msg) > st.longest_message:
                st.longest_message, st.longest_message_index = len(msg), i
            if len(msg) > MAX_MESSAGE or "\n" in msg:  # errors are one line (kdn/errors.py)
                st.bad_messages += 1
                if ("message", type(e)) not in seen and len(st.first_unexpected) < 8:
                    seen.add(("message", type(e)))
                    st.first_unexpected.append((i, f"message of {len(msg)} chars / {msg.count(chr(10)) + 1} lines: "
                                                   f"{type(e).__name__}: {msg[:120]}"))
        except Exception as e:  # noqa: BLE001 - anything else is a finding
            st.unexpected += 1
            kind = "contract" if isinstance(e, Anomaly) else "KDNError of the wrong kind" if isinstance(e, KDNError) else "crash"
            tb = traceback.extract_tb(e.__traceback__)
            where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else "?"
            if (type(e), where) not in seen and len(st.first_unexpected) < 8:
                seen.add((type(e), where))
                st.first_unexpected.append((i, f"{kind}: {type(e).__name__} at {where}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
        dt, wall = time.thread_time() - c0, time.perf_counter() - t0
        st.slowest_wall_ms = max(st.slowest_wall_ms, wall * 1e3)
        dog.current = None
        if dt * 1e3 > st.slowest_ms:
            st.slowest_ms, st.slowest_index = dt * 1e3, i
        st.inputs += 1
    faulthandler.cancel_dump_traceback_later()
    st.seconds = time.perf_counter() - t_start
    st.rss_growth_mib = max(0, _status_kib("VmHWM") - rss0) / 1024
    return st


def replay(target: str, seed: int, index: int, max_codec_bytes: int, dump: str | None) -> int:
    """Rebuild input ``index``, write it to ``dump`` if asked, decode it with the full traceback shown."""
    make, check, refusals = _builder(target, seed, max_codec_bytes)
    inp = make(random.Random(f"{seed}:{target}:{index}"))
    if dump:
        if isinstance(inp, ObjectInput):
            with open(dump, "wb") as f:
                f.write(inp.blob)
        else:
            with open(dump, "w") as f:
                json.dump({"codec": target, "payload_hex": inp.payload.hex(), "dtype": inp.dtype,
                           "shape": list(inp.shape), "params": inp.params, "out": inp.out}, f, default=str)
        print(f"input written to {dump}")
    t0 = time.perf_counter()
    try:
        check(inp)
        print(f"{target} #{index}: decoded fine ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
        return 0
    except refusals as e:
        print(f"{target} #{index}: refused, {type(e).__name__}: {e} ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
        return 0
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1


def _worker(args) -> Stats:
    return fuzz_target(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=DEFAULT_INPUTS, help="inputs per target")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--targets", default="", help="comma-separated (default: decode_object and every codec)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    ap.add_argument("--slow-s", type=float, default=2.0, help="fail if one input takes longer")
    ap.add_argument("--hang-s", type=float, default=30.0, help="stop (printing the input) if one input takes longer")
    ap.add_argument("--max-rss-mib", type=float, default=MAX_RSS_GROWTH_MIB, help="fail if a target's peak RSS grows more")
    ap.add_argument("--max-codec-mib", type=float, default=1.0, help="largest nbytes(dtype, shape) of a codec input")
    ap.add_argument("--index", type=int, default=None, help="replay this one input of the (first) target")
    ap.add_argument("--dump", default=None, help="with --index: write the input to this file")
    args = ap.parse_args()
    t_start = time.perf_counter()
    max_codec = int(args.max_codec_mib * (1 << 20))

    _setup(args.seed)
    from kdn.format.codecs import codec_names

    known = [OBJECT_TARGET, *codec_names()]
    targets = [t for t in args.targets.split(",") if t] or known
    if unknown := [t for t in targets if t not in known]:
        ap.error(f"unknown targets {unknown}; known: {known}")
    if args.index is not None:
        sys.exit(replay(targets[0], args.seed, args.index, max_codec, args.dump))

    print(f"{len(targets)} targets x {args.inputs:,} inputs, seed {args.seed}, {args.jobs} jobs; fails on an unexpected "
          f"exception, an input over {args.slow_s:g} s, a target's peak RSS growing over {args.max_rss_mib:g} MiB\n",
          flush=True)
    work = [(t, args.seed, args.inputs, max_codec, args.hang_s) for t in targets]
    results: list[Stats] = []

    def done(st: Stats) -> None:
        results.append(st)
        print(f"  {st.target}: {st.inputs:,} inputs, {st.seconds:.0f} s, {st.unexpected} unexpected", flush=True)

    if args.jobs > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
            for st in ex.map(_worker, work):
                done(st)
    else:
        for w in work:
            done(_worker(w))

    failed = []
    print("\n| target | inputs | decoded ok | refused, by error | unexpected | longest message, chars (#index) "
          "| slowest input, CPU ms (#index) | slowest, wall ms | peak RSS growth, MiB |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for st in results:
        refused = ", ".join(f"{k} {v:,}" for k, v in st.refused.most_common())
        print(f"| {st.target} | {st.inputs:,} | {st.ok:,} | {refused} | {st.unexpected} | {st.longest_message:,} (#{st.longest_message_index}) "
              f"| {st.slowest_ms:.1f} (#{st.slowest_index}) | {st.slowest_wall_ms:.1f} | {st.rss_growth_mib:.1f}{'' if st.peak_reset else '*'} |")
        if st.unexpected:
            failed.append(f"{st.target}: {st.unexpected} unexpected")
        if st.bad_messages:
            failed.append(f"{st.target}: {st.bad_messages} messages over {MAX_MESSAGE} chars or several lines")
        if st.slowest_ms > args.slow_s * 1e3:
            failed.append(f"{st.target}: input {st.slowest_index} took {st.slowest_ms:.0f} ms of CPU")
        if st.rss_growth_mib > args.max_rss_mib:
            failed.append(f"{st.target}: peak RSS grew {st.rss_growth_mib:.0f} MiB")
    if not all(st.peak_reset for st in results):
        print("\n* VmHWM could not be reset: growth over the process's earlier peak only")
    for st in results:
        for i, line in st.first_unexpected:
            print(f"\n{st.target} #{i}: {line}\n    replay: {reproducer(args.seed, st.target, i)}")
    total = sum(st.inputs for st in results)
    print(f"\n{total:,} inputs in {time.perf_counter() - t_start:.0f} s: "
          + ("FAILED: " + "; ".join(failed) if failed else "no unexpected exception, no slow input, RSS within bound"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
