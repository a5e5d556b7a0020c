"""Field aliases: several member extensions read as one logical field (``jpg``/``png`` → ``image``).

Tar members keep their real extension (``key.jpg``, ``key.png``), so webdataset and
``zstd -d | tar t`` see real files; arrow shards keep a column per extension.  The manifest's
``aliases`` (``{logical field: [member extensions]}``) says which logical field a member fills,
and a reader may add its own (``ReadOptions(aliases=...)``) over the manifest's.  Packing
(``--alias``, class folders), reading and ``verify`` all go through :class:`FieldMap`, so they
cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardloader.errors import ManifestError, ShardError, UsageError
from shardloader.manifest import FieldInfo

__all__ = ["Aliases", "FieldMap", "normalize", "merge", "parse_option"]

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
            for e in exts:
                member_of[e] = name
            if infos:
                fields[name] = infos.pop()
        for ext, info in members.items():
            if ext not in member_of:
                fields[ext] = info
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
