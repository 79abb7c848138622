"""A small reader of R's serialization format (XDR, versions 2 and 3) and of lazy-load databases (``.rdx`` / ``.rdb``),
enough to read the character, integer, real and list vectors of an R data package (janeaustenr's ``austen_books``)
without R and without an extra Python package.

Format (R Internals, "Serialization Formats"): a header ``X\\n``, three big-endian ints (format version, writer and
minimal reader R versions; version 3 adds the native encoding), then one item. An item starts with an int of flags:
type ``flags & 0xFF``, "is object" bit 8, "has attributes" bit 9, "has tag" bit 10, and for a CHARSXP the encoding
levels in the upper bits. A lazy-load index (``.rdx``, gzip) is a serialized list ``variables`` of ``c(offset,
length)`` into the ``.rdb``, where each object is a 4-byte length followed by its zlib-compressed serialization.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

# SEXP types (R Internals, "SEXPTYPEs") and the pseudo-types of the serialization format.
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, LANGSXP, CHARSXP = 0, 1, 2, 3, 4, 6, 9
LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, RAWSXP = 10, 13, 14, 16, 19, 24
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP, BASENAMESPACE_SXP = 255, 254, 253, 252, 251, 247
EMPTYENV_SXP, BASEENV_SXP, ALTREP_SXP = 242, 241, 238
_SINGLETONS = (NILVALUE_SXP, GLOBALENV_SXP, UNBOUNDVALUE_SXP, MISSINGARG_SXP, BASENAMESPACE_SXP, EMPTYENV_SXP,
               BASEENV_SXP)
NA_INTEGER = -(2**31)


@dataclass
class RObject:
    """An R vector or pairlist: ``value`` (a Python list, or a dict for a pairlist) and its ``attributes``."""

    type: int
    value: Any
    attributes: Dict[str, Any] = field(default_factory=dict)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.refs = data, 0, []

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated R serialization")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.read(4))[0]

    def header(self) -> None:
        if self.read(2) != b"X\n":
            raise ValueError("not an R XDR serialization (only the binary big-endian 'X' format is supported)")
        version = self.int()
        self.int(), self.int()  # writer version, minimal reader version
        if version == 3:
            self.read(self.int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization format version {version}")

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in _SINGLETONS:
            return None
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == CHARSXP:
            length = self.int()
            return None if length == -1 else self.read(length).decode("utf-8", errors="replace")
        if kind in (LISTSXP, LANGSXP):
            return self._pairlist(kind, has_attr, has_tag)
        if kind == ALTREP_SXP:
            info, state, attributes = self.item(), self.item(), self.item()
            return _expand_altrep(info, state, attributes)
        if kind in (LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP, RAWSXP):
            value = self._vector(kind)
            attributes = self._attributes() if has_attr else {}
            return RObject(kind, value, attributes)
        raise ValueError(f"unsupported R object type {kind} in serialization (data vectors and lists only)")

    def _pairlist(self, kind: int, has_attr: bool, has_tag: bool) -> RObject:
        """A pairlist (CAR / CDR chain), read iteratively: ``{tag: value}`` (untagged entries under their index)."""
        entries: Dict[Any, Any] = {}
        attributes = self._attributes() if has_attr else {}
        while True:
            tag = self.item() if has_tag else len(entries)
            entries[tag] = self.item()
            flags = self.int()  # the CDR: another pairlist cell or the end
            if flags & 0xFF != kind:
                if flags & 0xFF != NILVALUE_SXP:
                    raise ValueError("pairlist ending in a non-NULL CDR is unsupported")
                return RObject(kind, entries, attributes)
            has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
            if has_attr:
                self._attributes()

    def _attributes(self) -> Dict[str, Any]:
        attributes = self.item()
        return dict(attributes.value) if isinstance(attributes, RObject) else {}

    def _vector(self, kind: int) -> List[Any]:
        n = self.int()
        if n == -1:  # long vector: the length as two ints
            n = (self.int() << 32) + self.int()
        if kind in (LGLSXP, INTSXP):
            return list(struct.unpack(f">{n}i", self.read(4 * n)))
        if kind == REALSXP:
            return list(struct.unpack(f">{n}d", self.read(8 * n)))
        if kind == RAWSXP:
            return list(self.read(n))
        return [self.item() for _ in range(n)]  # STRSXP: CHARSXPs; VECSXP: any items


def _expand_altrep(info: Any, state: Any, attributes: Any) -> RObject:
    """The compact integer / real sequences R writes as ALTREP (``1:n`` row names); other classes are refused."""
    name = info.value.get(0) if isinstance(info, RObject) else None
    if name in ("compact_intseq", "compact_realseq") and isinstance(state, RObject):
        n, start, step = state.value[:3]
        values = [start + i * step for i in range(int(n))]
        kind = INTSXP if name == "compact_intseq" else REALSXP
        return RObject(kind, [int(v) for v in values] if kind == INTSXP else values)
    if name == "wrap_integer" or name == "wrap_real" or name == "wrap_string":
        return state.value[0]
    raise ValueError(f"unsupported ALTREP class {name!r} in serialization")


def unserialize(data: bytes) -> Any:
    """One R object from its XDR serialization (``saveRDS(compress = FALSE)`` bytes)."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def read_rds(path: str | Path) -> Any:
    """An ``.rds`` file (gzip-compressed or plain)."""
    raw = Path(path).read_bytes()
    return unserialize(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def read_lazy_load(rdx: str | Path, name: Optional[str] = None) -> Dict[str, Any]:
    """The objects of an R lazy-load database (``<db>.rdx`` index beside ``<db>.rdb``): ``{name: object}``, or only
    `name`'s when given (a KeyError listing the names if it is missing)."""
    rdx = Path(rdx)
    index = read_rds(rdx).value  # list(variables = list(name = c(offset, length)), references, compressed)
    names = index[0].attributes.get("names").value
    entries = dict(zip(names, index[0].value))
    if name is not None:
        if name not in entries:
            raise KeyError(f"{name!r} is not in {rdx}; it holds {sorted(entries)}")
        entries = {name: entries[name]}
    blob = rdx.with_suffix(".rdb").read_bytes()
    out = {}
    for key, location in entries.items():
        offset, length = (int(v) for v in location.value[:2])
        chunk = blob[offset : offset + length]
        out[key] = unserialize(zlib.decompress(chunk[4:]))  # 4 bytes: the uncompressed length
    return out


def data_frame_columns(frame: RObject) -> Dict[str, List[Any]]:
    """``{column: values}`` of a data.frame; a factor column becomes its labels."""
    names = frame.attributes["names"].value
    columns = {}
    for name, column in zip(names, frame.value):
        values = column.value
        levels = column.attributes.get("levels")
        if levels is not None:
            values = [None if v == NA_INTEGER else levels.value[v - 1] for v in values]
        columns[name] = values
    return columns
