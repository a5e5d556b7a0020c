"""Field aliases: several member extensions read as one logical field (``jpg``/``png`` → ``image``).

Tar members keep their real extension (``key.jpg``, ``key.png``), so webdataset and
``zstd -d | tar t`` see real files; arrow shards keep a column per extension.  The manifest's
``aliases`` (``{logical field: [member extensions]}``) says which logical field a member fills,
and a reader may add its own (``ReadOptions(aliases=...)``) over the manifest's.  Packing
(``--alias``, class folders), reading and ``verify`` all go through :class:`FieldMap`, so they
cannot disagree.

Optional fields: a sample may lack a field (a pair without its caption) or hold a null (JSON
``null``, a Parquet null).  :func:`complete` applies ``Decoder(fill=..., required=...)`` to each
sample as it is decoded; the collates keep what is still missing as ``None``, or say which field
a tensor batch lacks (NOTE [missing values] in :mod:`shardloader.batching.default`), and
the pass adds the shard to that error (``shardloader/read/samplepass.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardloader.errors import ManifestError, MissingFieldError, ShardError, UsageError
from shardloader.manifest import FieldInfo

__all__ = [
    "Aliases",
    "FieldMap",
    "complete",
    "merge",
    "normalize",
    "parse_option",
    "presence",
]

Aliases = Mapping[str, tuple[str, ...]]


def normalize(
    aliases: Mapping[str, Iterable[str]] | None, where: str = "aliases"
) -> dict[str, tuple[str, ...]]:
    """Check and canonicalise ``{logical: extensions}``: names sorted, extensions sorted, unique.

    An extension may belong to one logical field only; names starting with ``__`` are the
    sample's own keys (``__key__``...) and cannot be fields.
    """
    out: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    if not aliases:
        return out
    if not isinstance(aliases, Mapping):
        raise UsageError(f"{where} must map a field name to extensions, got {aliases!r}")
    for name, members in sorted(aliases.items()):
        if not isinstance(name, str) or not name or name.startswith("__"):
            raise UsageError(f"{where}: {name!r} is not a usable field name")
        if isinstance(members, str) or not isinstance(members, Iterable):
            raise UsageError(f"{where}: {name!r} needs a list of extensions, got {members!r}")
        exts = tuple(sorted(set(members)))
        if not exts or not all(isinstance(e, str) and e for e in exts):
            raise UsageError(f"{where}: {name!r} needs non-empty extensions, got {members!r}")
        for ext in exts:
            if ext in owner:
                raise UsageError(
                    f"{where}: extension {ext!r} is in both {owner[ext]!r} and {name!r}"
                )
            owner[ext] = name
        out[name] = exts
    return out


def merge(base: Aliases, override: Aliases) -> dict[str, tuple[str, ...]]:
    """``override``'s groups win: a name it gives replaces the base group of that name, and an
    extension it claims leaves whichever base group held it (a group left empty disappears)."""
    claimed = {ext for exts in override.values() for ext in exts}
    out = {
        name: kept
        for name, exts in base.items()
        if name not in override and (kept := tuple(e for e in exts if e not in claimed))
    }
    out.update(override)
    return dict(sorted(out.items()))


def parse_option(values: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """``--alias image=jpg,jpeg,png`` (repeatable) → ``{"image": ("jpeg", "jpg", "png")}``."""
    out: dict[str, list[str]] = {}
    for value in values:
        name, sep, exts = value.partition("=")
        members = [e.strip().lstrip(".") for e in exts.split(",") if e.strip()]
        if not sep or not name.strip() or not members:
            raise UsageError(
                f"--alias {value!r}: give FIELD=EXT[,EXT...], e.g. --alias image=jpg,jpeg,png"
            )
        out.setdefault(name.strip(), []).extend(members)
    return normalize(out, "--alias")


@dataclass(frozen=True)
class FieldMap:
    """Member extension → logical field, and the logical fields' codecs.

    ``fields`` are the logical fields (the manifest's ``fields``); ``member_of`` maps each
    aliased member extension to its logical field (unaliased extensions are their own field).
    """

    fields: Mapping[str, FieldInfo]
    member_of: Mapping[str, str]
    projected: bool = False  # ``fields`` is what ReadOptions.fields kept: drop the rest

    def only(self, names: Sequence[str] | None) -> FieldMap:
        """The map keeping the logical fields ``names`` (``ReadOptions.fields``; None: all)."""
        if names is None:
            return self
        unknown = [n for n in names if n not in self.fields]
        if unknown:
            raise UsageError(
                f"ReadOptions.fields names {unknown[0]!r}, which is not a field of the dataset "
                f"(its fields: {', '.join(self.fields) or 'none'}); name fields from that list"
            )
        kept = {n: info for n, info in self.fields.items() if n in names}
        return FieldMap(kept, self.member_of, projected=True)

    @classmethod
    def build(
        cls, members: Mapping[str, FieldInfo], aliases: Aliases, where: str = "aliases"
    ) -> FieldMap:
        """From per-extension fields (what the shards hold) and aliases over them.

        Extensions an alias names but the data does not have are ignored.  Members of one
        logical field must share a codec; a logical name may not be another field's extension.
        """
        fields: dict[str, FieldInfo] = {}
        member_of: dict[str, str] = {}
        for name, exts in aliases.items():
            present = [e for e in exts if e in members]
            if name in members and name not in exts:
                raise UsageError(
                    f"{where}: {name!r} is already a field of the data; alias it under "
                    "another name, or list it among its own extensions"
                )
            infos = {members[e] for e in present}
            if len(infos) > 1:
                codecs = ", ".join(f"{e}: {members[e].codec}" for e in present)
                raise UsageError(f"{where}: {name!r} joins fields of different codecs ({codecs})")
            member_of.update(dict.fromkeys(exts, name))
            if infos:
                fields[name] = infos.pop()
        fields.update({ext: info for ext, info in members.items() if ext not in member_of})
        return cls(dict(sorted(fields.items())), member_of)

    @classmethod
    def of_manifest(
        cls, manifest: Any, extra: Mapping[str, Iterable[str]] | None = None
    ) -> FieldMap:
        """The map a reader uses: the manifest's aliases, with ``extra`` (the reader's own)
        merged over them."""
        members: dict[str, FieldInfo] = {}
        for name, info in manifest.fields.items():
            for ext in manifest.aliases.get(name, (name,)):
                if ext in members:
                    raise ManifestError(
                        f"manifest: extension {ext!r} is both a field and a member of an alias"
                    )
                members[ext] = info
        aliases = merge(manifest.aliases, normalize(extra)) if extra else manifest.aliases
        return cls.build(members, aliases, "aliases=" if extra else "manifest aliases")

    @property
    def aliases(self) -> dict[str, tuple[str, ...]]:
        """The groups as ``{logical: sorted extensions}`` (what the manifest records)."""
        out: dict[str, list[str]] = {}
        for ext, name in sorted(self.member_of.items()):
            out.setdefault(name, []).append(ext)
        return {name: tuple(exts) for name, exts in sorted(out.items())}

    def clash(self, fields: Mapping[str, bytes], name: str) -> ShardError:
        """The error for a sample whose members fill the logical field ``name`` twice."""
        both = " and ".join(repr(e) for e in sorted(fields) if self.member_of.get(e, e) == name)
        return ShardError(
            f"members {both} both fill field {name!r} (aliases); a sample may hold only one"
        )


# -- optional fields ---------------------------------------------------------------------------


def _lookup(sample: Mapping[str, Any], name: str) -> tuple[dict[str, Any] | None, str, Any]:
    """(the dict holding field ``name``, its key there, its value or None).  A dotted name
    reaches into a decoded dict (``json.caption``) unless the sample has a field of that very
    name (extensions may hold dots: ``seg.png``)."""
    if name in sample or "." not in name:
        return sample, name, sample.get(name)  # type: ignore[return-value]
    head, _, rest = name.partition(".")
    inner = sample.get(head)
    if not isinstance(inner, dict):
        return None, rest, None
    return _lookup(inner, rest)


def complete(
    sample: dict[str, Any], fill: Mapping[str, Any], required: Iterable[str]
) -> dict[str, Any]:
    """``sample`` with ``fill``'s value wherever a field is missing (absent or None), the same
    object each time; a field of ``required`` still missing is a :class:`MissingFieldError`
    (the caller adds the place, and ``on_error="skip"`` skips the sample)."""
    for name in required:
        if _lookup(sample, name)[2] is None:
            present = ", ".join(k for k in sample if not k.startswith("__"))
            raise MissingFieldError(
                f"required field {name!r} is missing (absent or null; the sample has: "
                f"{present or 'no fields'}); pass on_error='skip' to skip such samples, or "
                f"fill it instead (Decoder(fill={{{name!r}: ...}}))",
                field=name,
                missing=1,
                key=str(sample.get("__key__")),
            )
    for name, value in fill.items():
        holder, key, found = _lookup(sample, name)
        if found is not None:
            continue
        if holder is None:  # json.caption where the sample has no json (or not a dict)
            head, _, rest = name.partition(".")
            if sample.get(head) is not None:
                continue  # a value that is not a dict: nothing to fill inside it
            sample[head] = holder = {}
            key = rest
            while "." in key:  # a.b.c: build the dicts down to c
                head, _, key = key.partition(".")
                holder[head] = holder = {}
        holder[key] = value
    return sample


def presence(counts: Any, field_map: FieldMap) -> dict[str, int] | None:
    """Samples holding each logical field, from pack's per-extension counts (the manifest's
    ``extra.field_samples``); None when pack recorded none or they are not counts."""
    if not isinstance(counts, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in counts.items()
    ):
        return None
    out: dict[str, int] = dict.fromkeys(field_map.fields, 0)
    for ext, n in counts.items():
        name = field_map.member_of.get(ext, ext)
        out[name] = out.get(name, 0) + n
    return out
