"""TFRecord files and ``tf.train.Example`` records, without TensorFlow.

A TFRecord file is a sequence of records, each framed as::

    uint64 length (little endian) | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)

with ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 (mod 2**32)``. Both checksums
are verified on every read, so a flipped bit or a truncated file is an error naming the file,
the record and its byte offset, never a silently wrong sample.

The ``Example`` message classes are built at run time from a ``FileDescriptorProto`` written
here with protobuf's ``descriptor_pb2`` / ``message_factory`` APIs (no ``protoc`` step at
install time, no TensorFlow). They carry the field numbers of TensorFlow's ``example.proto`` and
``feature.proto`` (``Example.features = 1``; ``Features.feature = 1``, a map; ``Feature`` is a
oneof of ``bytes_list = 1``, ``float_list = 2``, ``int64_list = 3``; each list's ``value = 1``,
packed for floats and ints), so they parse the same bytes. They live in a private descriptor
pool under their own package name, so they never clash with TensorFlow's classes if both are
loaded in one process.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from parallax.data.extras import require
from parallax.data.stats import DatasetError

HEADER_BYTES = 12  # uint64 length + uint32 crc of the length
FOOTER_BYTES = 4  # uint32 crc of the data
MASK_DELTA = 0xA282EAD8
_PACKAGE = "parallax.tfexample"


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    crc = require("crc32c", "rlds", "reading TFRecord files").crc32c(data)
    return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & 0xFFFFFFFF


def _read_record(handle, path: Path, index: int, offset: int) -> bytes | None:
    """The record at the handle's position (``None`` at a clean end of file)."""
    header = handle.read(HEADER_BYTES)
    if not header:
        return None
    where = f"{path}: record {index} at byte {offset}"
    if len(header) < HEADER_BYTES:
        raise DatasetError(f"{where}: truncated shard (a {len(header)}-byte partial header)")
    (length,) = struct.unpack("<Q", header[:8])
    (length_crc,) = struct.unpack("<I", header[8:])
    if masked_crc32c(header[:8]) != length_crc:
        raise DatasetError(f"{where}: length CRC mismatch (corrupt or not a TFRecord file)")
    body = handle.read(length + FOOTER_BYTES)
    if len(body) < length + FOOTER_BYTES:
        raise DatasetError(
            f"{where}: truncated shard (record of {length} bytes, only "
            f"{max(len(body) - FOOTER_BYTES, 0)} present)"
        )
    data = body[:length]
    (data_crc,) = struct.unpack("<I", body[length:])
    computed = masked_crc32c(data)
    if computed != data_crc:
        raise DatasetError(
            f"{where}: data CRC mismatch (stored 0x{data_crc:08x}, computed 0x{computed:08x})"
        )
    return data


def iter_records(path: str | Path) -> Iterator[tuple[int, int, bytes]]:
    """``(record index, byte offset, data)`` of every record of a file, CRCs verified."""
    path = Path(path)
    with open(path, "rb") as handle:
        index, offset = 0, 0
        while True:
            data = _read_record(handle, path, index, offset)
            if data is None:
                return
            yield index, offset, data
            offset += HEADER_BYTES + len(data) + FOOTER_BYTES
            index += 1


def read_record(path: str | Path, offset: int, index: int = -1, handle=None) -> bytes:
    """The one record at ``offset`` (as :func:`iter_records` reported it), CRCs verified."""
    path = Path(path)
    if handle is None:
        with open(path, "rb") as own:
            return read_record(path, offset, index, own)
    handle.seek(offset)
    data = _read_record(handle, path, index, offset)
    if data is None:
        raise DatasetError(f"{path}: record {index} at byte {offset}: past the end of the file")
    return data


def _field(name: str, number: int, kind: str, type_name: str = "", repeated: bool = False):
    pb2 = require("google.protobuf.descriptor_pb2", "rlds", "reading tf.train.Example records")
    field = pb2.FieldDescriptorProto(name=name, number=number, json_name=name)
    field.type = getattr(pb2.FieldDescriptorProto, f"TYPE_{kind}")
    field.label = getattr(
        pb2.FieldDescriptorProto, "LABEL_REPEATED" if repeated else "LABEL_OPTIONAL"
    )
    if type_name:
        field.type_name = f".{_PACKAGE}.{type_name}"
    return field


@functools.cache
def example_class() -> type:
    """The ``tf.train.Example`` message class (see the module doc for how it is built)."""
    pb2 = require("google.protobuf.descriptor_pb2", "rlds", "reading tf.train.Example records")
    pool_mod = require("google.protobuf.descriptor_pool", "rlds", "reading tf.train.Example")
    factory = require("google.protobuf.message_factory", "rlds", "reading tf.train.Example")
    file = pb2.FileDescriptorProto(name="parallax_tfexample.proto", package=_PACKAGE)
    file.syntax = "proto3"
    for name, kind in (("BytesList", "BYTES"), ("FloatList", "FLOAT"), ("Int64List", "INT64")):
        msg = file.message_type.add(name=name)
        msg.field.append(_field("value", 1, kind, repeated=True))
        if kind != "BYTES":
            msg.field[0].options.packed = True
    feature = file.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, name, type_name in (
        (1, "bytes_list", "BytesList"),
        (2, "float_list", "FloatList"),
        (3, "int64_list", "Int64List"),
    ):
        feature.field.append(_field(name, number, "MESSAGE", type_name))
        feature.field[-1].oneof_index = 0
    features = file.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.append(_field("key", 1, "STRING"))
    entry.field.append(_field("value", 2, "MESSAGE", "Feature"))
    features.field.append(_field("feature", 1, "MESSAGE", "Features.FeatureEntry", True))
    example = file.message_type.add(name="Example")
    example.field.append(_field("features", 1, "MESSAGE", "Features"))
    pool = pool_mod.DescriptorPool()
    pool.Add(file)
    return factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Example"))


def parse_example(data: bytes, where: str = "record") -> dict[str, Any]:
    """An Example's features: float lists as float32 arrays, int64 lists as int64 arrays,
    bytes lists as lists of ``bytes``."""
    try:
        example = example_class().FromString(data)
    except Exception as err:  # protobuf's DecodeError, whatever the backend
        raise DatasetError(f"{where}: not a tf.train.Example ({err})") from None
    out: dict[str, Any] = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "float_list":
            out[key] = np.asarray(feature.float_list.value, dtype=np.float32)
        elif kind == "int64_list":
            out[key] = np.asarray(feature.int64_list.value, dtype=np.int64)
        elif kind == "bytes_list":
            out[key] = list(feature.bytes_list.value)
        else:
            out[key] = np.zeros(0, dtype=np.float32)  # an empty feature
    return out
