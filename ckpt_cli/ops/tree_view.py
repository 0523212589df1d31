"""`inspect --tree`: the module tree of a checkpoint's tensors, from metadata alone.

Names split on '.'; every node carries its parameter count, bytes, tensor count and dtype mix. Numbered
children with the same structure (names, shapes, dtypes below them) fold into one node, `layers.{0..31}`
x32, and so do MoE experts (`experts.{0..7}`); numbered children that differ stay apart, in groups of equal
structure, and a note says what differs. A chain of single children is one line (`embed.weight`).

Each role is a tree of its own: model weights, then `[optimizer]` and `[other]`. Tied weights (one stored
array under two names) count once, at their first name. The rendering (text, Markdown) lives here too, so
that the Python API prints the same tree as the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_cli.core.model import ROLES, Checkpoint, TensorEntry
from ckpt_cli.core.sizes import human_bytes
from ckpt_cli.errors import UsageError
from ckpt_cli.ops import quantized
from ckpt_cli.ops.transform import matches


@dataclass
class TreeNode:
    """A module (or a tensor, at a leaf). `params`, `bytes`, `tensors` and `dtypes` count one instance; a folded
    node stands for `repeat` instances (`indices`) of the same structure, and its children describe one."""

    name: str  # the label: one or more name components, `{0..31}` where folded
    path: str  # the full dotted name of the node, folds included
    params: int = 0  # elements (parameters, for model weights); tied aliases count 0
    bytes: int = 0
    tensors: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes
    repeat: int = 1
    indices: list[int] | None = None
    shape: tuple[int, ...] | None = None  # leaves (tensors) only
    dtype: str | None = None
    tied_to: str | None = None  # a tied alias: the name whose data it shares
    children: list[TreeNode] = field(default_factory=list)

    @property
    def total_params(self) -> int:
        return self.params * self.repeat

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.repeat

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "path": self.path,
            "params": self.total_params,
            "bytes": self.total_bytes,
            "tensors": self.tensors * self.repeat,
            "dtypes": {k: v * self.repeat for k, v in self.dtypes.items()},
        }
        if self.repeat > 1:
            doc.update(repeat=self.repeat, indices=self.indices, each={"params": self.params, "bytes": self.bytes, "tensors": self.tensors})
        if self.shape is not None:
            doc.update(shape=list(self.shape), dtype=self.dtype)
        if self.tied_to:
            doc["tied_to"] = self.tied_to
        if self.children:
            doc["children"] = [c.to_json() for c in self.children]
        return doc


@dataclass
class Tree:
    """The tree of each role present (model first), the notes on numbered blocks that did not fold, and how it was cut."""

    path: str
    format: str
    roles: dict[str, TreeNode]
    notes: list[tuple[str, str]] = field(default_factory=list)  # (role, note); role "": how it was opened (always shown)
    depth: int | None = None
    expanded: tuple[str, ...] = ROLES  # roles the text and Markdown renderings open (the others: one line each)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "depth": self.depth,
            "roles": {role: node.to_json() for role, node in self.roles.items()},
            "notes": [note for _, note in self.notes],
        }

    def text(self) -> str:
        """One line per node, indented; a folded line (×N) counts all its blocks, the lines under it one block."""
        rows: list[tuple[str, str, str, str, str]] = [("name", "shape", "params", "bytes", "dtype")]
        for role, node in self.roles.items():
            if role in self.expanded:
                _rows(node, 0, rows)
            else:
                label = f"{node.name} {node.tensors} tensor{'s' if node.tensors != 1 else ''}"
                rows.append((label, "", f"{node.total_params:,}", human_bytes(node.total_bytes), dtype_mix(node.dtypes)))
        if len(rows) == 1:
            return "no tensors"
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}".rstrip() for r in rows]
        lines += [f"note: {n}" for role, n in self.notes if not role or role in self.expanded]
        return "\n".join(lines)

    def markdown(self) -> str:
        """A Markdown table for a model card: one row per node, by full name."""
        lines = ["| module | shape | parameters | bytes | dtype |", "|---|---|--:|--:|---|"]
        for role, node in self.roles.items():
            if role in self.expanded:
                _md_rows(node, lines, True)
            else:
                count = f"{node.tensors} tensor{'s' if node.tensors != 1 else ''}"
                size = f"{node.total_params:,} | {human_bytes(node.total_bytes)} | {dtype_mix(node.dtypes)}"
                lines.append(f"| **{node.name}** ({count}) | | {size} |")
        notes = [note for role, note in self.notes if role in self.expanded]  # not how it was opened: a card has no local paths
        lines += ["", *(f"Note: {n}" for n in notes)] if notes else []
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


@dataclass
class _Trie:
    children: dict[str, _Trie] = field(default_factory=dict)
    entry: TensorEntry | None = None
    signature: Any = None


SELF = "(tensor)"  # a tensor whose name is also the prefix of others ('a' and 'a.b'): shown as a child of 'a'
MAX_LEVELS = 64  # name components split into levels; the rest of a longer name stays one label (no deep recursion)


def build(ckpt: Checkpoint, filters: tuple[str, ...] = (), depth: int | None = None, expand: tuple[str, ...] | None = None) -> Tree:
    """The tree of `ckpt`'s tensors (those matching `filters`), cut at `depth` levels below each role.

    `expand`: roles whose tree the text rendering opens; default the model weights alone, or every role when
    `filters` are given (`--filter 'optimizer.*'` shows the optimizer's tree). A run checkpoint's model weights are
    under the names its exports write (ops/runs.shown), as inspect shows them."""
    from ckpt_cli.ops import runs as run_roots

    ckpt = run_roots.shown(ckpt)
    tied = {alias: group[0] for group in ckpt.tied_groups() for alias in group[1:]}
    roots: dict[str, _Trie] = {}
    for entry in ckpt.tensors.values():
        if matches(entry.name, filters):
            _insert(roots.setdefault(entry.role, _Trie()), entry)
    if filters and not roots:  # as inspect without --tree: an empty selection is a wrong call
        raise UsageError(f"--filter {' '.join(filters)} matches no tensor of {ckpt.path}")
    notes: list[tuple[str, str]] = [("", n) for n in ckpt.notes]  # which checkpoint of a run, which tag
    scheme = quantized.scheme_of(ckpt) if quantized.may_be_quantized(ckpt) else None
    params = quantized.param_counts(ckpt, scheme)  # quantized weights: scales hold no parameters, a packed byte two
    roles = {}
    for role in sorted(roots, key=lambda r: ROLES.index(r) if r in ROLES else len(ROLES)):
        trie = roots[role]
        _sign(trie, tied)
        label = "model weights" if role == "model" else f"[{role}]"
        role_notes: list[str] = []
        node = _node(trie, label, "", tied, role_notes, params)
        notes += [(role, n) for n in role_notes]
        node.children = [_compress(c) for c in node.children]
        if depth is not None:
            _cut(node, depth)
        roles[role] = node
    if expand is None:
        expand = ROLES if filters else ("model",)
    return Tree(ckpt.path, ckpt.format, roles, notes, depth, expand)


def _insert(root: _Trie, entry: TensorEntry) -> None:
    node = root
    for part in entry.name.split(".", MAX_LEVELS):
        node = node.children.setdefault(part, _Trie())
    if node.children:  # 'a.b' came first: 'a' is a child of its own (_sign does the same when 'a' comes first)
        node = node.children.setdefault(SELF, _Trie())
    node.entry = entry


def _sign(trie: _Trie, tied: dict[str, str]) -> Any:
    """A hashable structure of the subtree (names, shapes, dtypes, tied aliases), computed bottom-up once."""
    if trie.signature is None:
        own = None
        if trie.entry is not None:
            own = (trie.entry.dtype.name, trie.entry.shape, trie.entry.name in tied)
        if trie.entry is not None and trie.children:  # the tensor came first: keep it as a child like the others
            trie.children[SELF] = _Trie(entry=trie.entry)
            trie.entry, own = None, None
        trie.signature = (own, tuple(sorted((k, _sign(c, tied)) for k, c in trie.children.items())))
    return trie.signature


def _node(trie: _Trie, name: str, path: str, tied: dict[str, str], notes: list[str], params: dict[str, int]) -> TreeNode:
    node = TreeNode(name, path)
    entry = trie.entry
    if entry is not None:
        node.shape, node.dtype, node.tensors = entry.shape, entry.dtype.name, 1
        node.tied_to = tied.get(entry.name)
        if node.tied_to is None:
            node.params, node.bytes = params.get(entry.name, entry.numel), entry.nbytes
            node.dtypes = {entry.dtype.name: entry.nbytes}
        return node
    for key, group in _groups(trie, path, notes):
        child_path = f"{path}.{key}" if path else key
        child = _node(trie.children[group[0]], key, child_path, tied, notes, params)
        if len(group) > 1:
            child.repeat, child.indices = len(group), [int(k) for k in group]
        node.children.append(child)
        _add_stats(node, child)
    return node


def _add_stats(node: TreeNode, child: TreeNode) -> None:
    node.params += child.total_params
    node.bytes += child.total_bytes
    node.tensors += child.tensors * child.repeat
    for dtype, n in child.dtypes.items():
        node.dtypes[dtype] = node.dtypes.get(dtype, 0) + n * child.repeat


def _is_index(key: str) -> bool:
    return key.isascii() and key.isdigit() and (key == "0" or not key.startswith("0"))


def _groups(trie: _Trie, path: str, notes: list[str]) -> list[tuple[str, list[str]]]:
    """(label, keys) for each child to show: numbered children of the same structure grouped (at the place of
    their first), the rest alone. A note says how numbered children that did not all fold differ."""
    by_sig: dict[Any, list[str]] = {}
    for key, child in trie.children.items():
        if _is_index(key):
            by_sig.setdefault(child.signature, []).append(key)
    out: list[tuple[str, list[str]]] = []
    placed: set[Any] = set()
    for key, child in trie.children.items():
        if not _is_index(key):
            out.append((key, [key]))
        elif child.signature not in placed:
            placed.add(child.signature)
            keys = by_sig[child.signature]
            out.append((key if len(keys) == 1 else "{" + index_ranges([int(k) for k in keys]) + "}", keys))
    groups = list(by_sig.values())
    if len(groups) > 1 and max(len(g) for g in groups) > 1:
        notes.append(_difference_note(trie, path, groups))
    return out


def index_ranges(indices: list[int]) -> str:
    """0..31 for a run, 0,2,4 for a scatter, 0..3,7 for both."""
    parts: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def _difference_note(trie: _Trie, path: str, groups: list[list[str]]) -> str:
    """`layers.31 differs from layers.{0..30}: mlp.weight is float32 [10, 4], not float32 [12, 4]` (against the largest group)."""

    def label(keys: list[str]) -> str:
        name = "{" + index_ranges([int(k) for k in keys]) + "}" if len(keys) > 1 else keys[0]
        return f"{path}.{name}" if path else name

    main = max(groups, key=len)
    first = trie.children[main[0]]
    diffs = [f"{label(g)} differs from {label(main)}: {_first_difference(first, trie.children[g[0]], '')}" for g in groups if g is not main]
    return "; ".join(diffs[:3]) + (f"; ... ({len(diffs) - 3} more)" if len(diffs) > 3 else "")


def _first_difference(a: _Trie, b: _Trie, prefix: str) -> str:
    """The first name where `b` differs from `a`: missing, extra, or another shape or dtype."""
    if a.entry is not None or b.entry is not None:
        if a.entry is None or b.entry is None:
            return f"{prefix or 'it'} is a tensor in one and a module in the other"
        sa, sb = f"{a.entry.dtype.name} {list(a.entry.shape)}", f"{b.entry.dtype.name} {list(b.entry.shape)}"
        return f"{prefix} is {sb}, not {sa}" if sa != sb else f"{prefix} is tied in one only"
    for key in [*a.children, *(k for k in b.children if k not in a.children)]:
        name = f"{prefix}.{key}" if prefix else key
        if key not in b.children:
            return f"{name} missing"
        if key not in a.children:
            return f"{name} extra"
        if a.children[key].signature != b.children[key].signature:
            return _first_difference(a.children[key], b.children[key], name)
    return "the same names in another order"


def _compress(node: TreeNode) -> TreeNode:
    """A single child under a module shown once is the same line: `embed` + `weight` -> `embed.weight`."""
    node.children = [_compress(c) for c in node.children]
    if node.repeat == 1 and len(node.children) == 1:
        child = node.children[0]
        child.name = f"{node.name}.{child.name}"
        return child
    return node


def _cut(node: TreeNode, depth: int) -> None:
    if depth <= 0:
        node.children = []
        return
    for child in node.children:
        _cut(child, depth - 1)


# Rendering -------------------------------------------------------------------------------------------------


def dtype_mix(dtypes: dict[str, int]) -> str:
    """`float32` alone, or each dtype's share of the bytes: `bfloat16 96%, float32 4%`."""
    if len(dtypes) <= 1:
        return next(iter(dtypes), "-")
    total = sum(dtypes.values()) or 1
    ordered = sorted(dtypes.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} {_percent(v, total)}" for k, v in ordered)


def _percent(part: int, total: int) -> str:
    share = 100 * part / total
    return f"{share:.0f}%" if share >= 1 or part == 0 else "<1%"


def _shape(node: TreeNode) -> str:
    return str(list(node.shape)) if node.shape is not None else ""


def _rows(node: TreeNode, indent: int, out: list[tuple[str, str, str, str, str]]) -> None:
    label = "  " * indent + node.name + (f" ×{node.repeat}" if node.repeat > 1 else "")
    if node.tied_to:
        out.append((label, _shape(node), "-", "-", f"tied to {node.tied_to}"))
    else:
        out.append((label, _shape(node), f"{node.total_params:,}", human_bytes(node.total_bytes), dtype_mix(node.dtypes)))
    for child in node.children:
        _rows(child, indent + 1, out)


def _md_rows(node: TreeNode, out: list[str], top: bool) -> None:
    name = f"**{node.name}**" if top else f"`{node.path}`"
    if node.repeat > 1:
        name += f" ×{node.repeat}"
    shape = " × ".join(map(str, node.shape)) if node.shape else ""
    if node.tied_to:
        out.append(f"| {name} | {shape} | - | - | tied to `{node.tied_to}` |")
    else:
        params = f"{node.total_params:,}" + (f" ({node.params:,} each)" if node.repeat > 1 else "")
        out.append(f"| {name} | {shape} | {params} | {human_bytes(node.total_bytes)} | {dtype_mix(node.dtypes)} |")
    for child in node.children:
        _md_rows(child, out, False)
