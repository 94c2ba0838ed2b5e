"""Which part of the model a value belongs to: the embedding, block i, the head, or a
sub-part of a split MoE block (its router part, or group j of its experts).

    p = PartId("block.3/experts.1")   # from a name (a store key, the config's stream.resident)
    p.kind, p.block, p.sub, p.group   # "block", 3, 1, 1
    p.owner, p.owner.router()         # PartId("block.3"), PartId("block.3/router")
    partid.block(3).experts(1) == p   # built from its fields

The package passes PartIds and reads their fields; no other module parses or formats a
part's name. A PartId is its name ("embed", "block.3", "head", "block.3/router",
"block.3/experts.1"): a str, so store keys, manifests, run-directory files, trace labels
and messages keep these exact strings, and a name given at the boundary finds the same
dict entry. It sorts as its name; `forward_order` sorts PartIds in forward order.
"""

from __future__ import annotations

import functools

KINDS = ("embed", "block", "head")
ROUTER = -1  # `sub` of a split block's router part; its expert groups are 0, 1, ...


class PartId(str):
    """A part's name with its fields: `kind` ("embed", "block", "head"), `block` (the
    block's index, None for embed and head), `sub` (a split block's sub-part: ROUTER or
    its expert group's index; None for a whole part)."""

    kind: str
    block: int | None
    sub: int | None

    def __new__(cls, name: str) -> PartId:
        if isinstance(name, PartId):
            return name
        if not isinstance(name, str):
            raise TypeError(f"a part is named by a str, not {type(name).__name__}")
        fields = _read(name)
        if fields is None or _format(*fields) != name:  # one name per part: "block.03" is none
            raise ValueError(f"no part named {name!r}; parts are embed, block.I, head and a split block's "
                             "block.I/router, block.I/experts.J")
        return _new(*fields)

    def __setattr__(self, name, value):
        raise AttributeError("a PartId is immutable")

    def __reduce__(self):
        return PartId, (str(self),)

    def __repr__(self) -> str:
        return f"PartId({str(self)!r})"

    @property
    def is_block(self) -> bool:
        """A block or one of its sub-parts."""
        return self.kind == "block"

    @property
    def is_sub(self) -> bool:
        return self.sub is not None

    @property
    def owner(self) -> PartId:
        """The whole part a sub-part belongs to (a whole part is its own owner)."""
        return self if self.sub is None else block(self.block)

    @property
    def group(self) -> int | None:
        """The expert group's index of a group sub-part; None otherwise."""
        return None if self.sub is None or self.sub == ROUTER else self.sub

    def router(self) -> PartId:
        """This block's router part."""
        return _new("block", self.block, ROUTER)

    def experts(self, j: int) -> PartId:
        """This block's expert group j."""
        return _new("block", self.block, j)

    def in_block(self, i: int) -> PartId:
        """The same (sub-)part of block i."""
        return _new("block", i, self.sub)


def block(i: int) -> PartId:
    return _new("block", i, None)


def forward_order(p: PartId) -> tuple:
    """A sort key: embed, block 0 (whole, its router part, its groups), block 1, ..., head."""
    return KINDS.index(p.kind), -1 if p.block is None else p.block, -2 if p.sub is None else p.sub


@functools.lru_cache(maxsize=None)  # one object per part: a planner's schedules name each part thousands of times
def _new(kind: str, block_: int | None, sub: int | None) -> PartId:
    if kind not in KINDS or (kind == "block") != (block_ is not None) or block_ is not None and block_ < 0 or (
            sub is not None and (block_ is None or sub < ROUTER)):
        raise ValueError(f"no such part: kind={kind!r} block={block_!r} sub={sub!r}")
    p = str.__new__(PartId, _format(kind, block_, sub))
    object.__setattr__(p, "kind", kind)
    object.__setattr__(p, "block", block_)
    object.__setattr__(p, "sub", sub)
    return p


def _format(kind: str, block_: int | None, sub: int | None) -> str:
    if kind != "block":
        return kind
    if sub is None:
        return f"block.{block_}"
    return f"block.{block_}/router" if sub == ROUTER else f"block.{block_}/experts.{sub}"


def _read(name: str) -> tuple | None:
    """(kind, block, sub) of a name, or None."""
    if name in ("embed", "head"):
        return name, None, None
    whole, _, sub = name.partition("/")
    kind, _, index = whole.partition(".")
    if kind != "block" or not index.isdigit():
        return None
    if not sub:
        return "block", int(index), None
    if sub == "router":
        return "block", int(index), ROUTER
    group, _, j = sub.partition(".")
    return ("block", int(index), int(j)) if group == "experts" and j.isdigit() else None


EMBED = PartId("embed")
HEAD = PartId("head")
