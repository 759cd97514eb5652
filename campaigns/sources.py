"""A lever's source code as far as its behaviour goes: what a verdict's staleness compares.

A lever file's ``paths:`` lists the lever's sources. An entry is a repository-relative file
(``vtengine/kernels/attention.py``: the whole file counts) or, in a Python file that holds several levers' code, one
definition in it (``vtengine/backends/triton_backend.py::TritonBackend.rope_out``): then only the code that the
lever's definitions there can reach counts, so a change to another lever's method of the same class no longer stales
this lever's verdicts (prefill_splits' one-line wiring in ``TritonBackend.prefill_attention`` staled fuse_rope's).

What counts in a file listed by its definitions, found statically and on the safe side (``counted``):

- each definition, and every module-level name its code loads (a function, a class, a constant, an import: the
  name alone, not the other names of its ``from m import a, b``), and theirs in turn; a name bound in a
  module-level ``if``/``try`` block takes the whole block;
- inside a class: every member named through ``self.``, ``cls.`` or the class's name; for an instance attribute
  (``self.levers``), every method of the class that assigns it; always what shapes every instance (``__init__``,
  ``__post_init__``, ``__new__``, a method calling ``setattr(self, ...)``: the Triton backend's constructor routes
  ops by it) and every dunder member (``__call__``, ``__getitem__``, ``__slots__``: the language calls them
  implicitly, ``self(x)``, ``self[i]``, which no ``self.<name>`` shows); the class's bases, decorators and
  keywords; the whole class where a method uses the class itself otherwise (builds one, passes it on);
- module-level statements that bind no name (a call at import time), always;
- every name of the file that the counted code of the lever's other listed files imports (``from
  vtengine.kernels.fused import RopeOut``, ``fused.RopeOut``), to a fixed point.

The whole file counts where a definition cannot be found (in the working tree or at the campaign's commit: a rename
is a change), the file does not parse, or another listed file uses the module object in a way that cannot be told.
What reaches the lever's code from a file it does not list (a call through an object: ``self.backend.rope_out``)
is not followed: list that definition. Python is compared as parsed (comments, formatting and docstrings dropped).
"""
from __future__ import annotations

import ast
import copy
import difflib
import hashlib

from vtengine.levers import split_entry


def files_of(entries) -> list[str]:
    """The distinct files the entries name, in their order."""
    return list(dict.fromkeys(split_entry(e)[0] for e in entries))


def by_file(entries) -> dict[str, list[str] | None]:
    """file -> the definitions declared in it, or None where the whole file is listed (which wins)."""
    out: dict[str, list[str] | None] = {}
    for e in entries:
        path, symbol = split_entry(e)
        if symbol is None:
            out[path] = None
        elif path not in out:
            out[path] = [symbol]
        elif out[path] is not None:
            out[path].append(symbol)
    return out


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]


def normalized(path: str, data: bytes | None) -> bytes | None:
    """A source file as far as its behaviour goes: Python parsed (comments and formatting gone) with its module,
    class and function docstrings dropped, as ``ast.dump``; any other file, or Python that does not parse, as is."""
    tree = _parse(data) if path.endswith(".py") else None
    return data if tree is None else ast.dump(tree, include_attributes=False).encode()


def _child_blocks(stmt: ast.stmt):
    """The statement lists nested in a compound statement (not in a def or class: those are their own scope)."""
    for field in ("body", "orelse", "finalbody"):
        yield getattr(stmt, field, None) or []
    for h in getattr(stmt, "handlers", None) or []:
        yield h.body
    for c in getattr(stmt, "cases", None) or []:
        yield c.body


def _target_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _binds(stmt: ast.stmt) -> set[str]:
    """The names a statement binds in its scope."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, ast.Assign):
        return set().union(*(_target_names(t) for t in stmt.targets))
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return _target_names(stmt.target)
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    out: set[str] = set()
    if isinstance(stmt, (ast.For, ast.AsyncFor)):
        out |= _target_names(stmt.target)
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        out |= set().union(*(_target_names(i.optional_vars) for i in stmt.items if i.optional_vars is not None))
    for block in _child_blocks(stmt):
        for s in block:
            out |= _binds(s)
    return out


def _loaded_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _Module:
    def __init__(self, tree: ast.Module):
        self.body = tree.body
        self.top: dict[str, list[int]] = {}        # name -> indices of the module statements binding it
        self.members: dict[str, dict[str, list[int]]] = {}     # class -> member -> indices in its body
        for i, stmt in enumerate(self.body):
            for name in _binds(stmt):
                self.top.setdefault(name, []).append(i)
            if isinstance(stmt, ast.ClassDef):
                mem: dict[str, list[int]] = {}
                for j, s in enumerate(stmt.body):
                    for name in _binds(s):
                        mem.setdefault(name, []).append(j)
                self.members[stmt.name] = mem

    def class_index(self, name: str) -> int | None:
        """The index of the (last) class statement binding ``name``."""
        found = [i for i in self.top.get(name, []) if isinstance(self.body[i], ast.ClassDef)]
        return found[-1] if found else None

    def cls(self, name: str) -> ast.ClassDef | None:
        i = self.class_index(name)
        return None if i is None else self.body[i]

    def defines(self, symbol: str) -> bool:
        head, _, member = symbol.partition(".")
        if not member:
            return head in self.top
        return self.cls(head) is not None and member in self.members.get(head, {})


def _assigners(cls: ast.ClassDef, attr: str) -> list[int]:
    """Indices of the class's members that assign ``self.<attr>``."""
    out = []
    for j, s in enumerate(cls.body):
        for n in ast.walk(s):
            if (isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.ctx, (ast.Store, ast.Del))
                    and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                out.append(j)
                break
    return out


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _constructors(cls: ast.ClassDef) -> list[int]:
    """Indices of the members that shape every instance or that the language calls on it implicitly: every dunder
    member (__init__, __post_init__, __new__, __call__, __getitem__, __slots__, ...), and any method that sets
    attributes by computed name (``setattr(self, name, ...)``: it may replace a method the lever calls)."""
    out = []
    for j, s in enumerate(cls.body):
        if any(map(_dunder, _binds(s))):
            out.append(j)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr"
                and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in ("self", "cls")
                for n in ast.walk(s)):
            out.append(j)
    return out


def _reachable_tree(tree: ast.Module, symbols) -> ast.Module | None:
    """The part of ``tree`` (docstrings dropped) that the declared definitions reach in it (the module's
    docstring says how); None where a definition is not in it."""
    mod = _Module(tree)
    if not all(mod.defines(s) for s in symbols):
        return None
    whole: set[int] = {i for i, s in enumerate(mod.body) if not _binds(s)}     # import-time side effects
    parts: dict[int, set[int]] = {}         # class statement index -> member indices taken
    imported: dict[int, set[str]] = {}      # import statement index -> the names of it taken
    work: list[tuple] = [("node", mod.body[i], None) for i in whole]

    def take_top(name: str) -> None:
        for i in mod.top.get(name, []):
            if isinstance(mod.body[i], (ast.Import, ast.ImportFrom)):
                imported.setdefault(i, set()).add(name)     # one name of `from m import a, b`: not the others
            elif i not in whole:
                whole.add(i)
                stmt = mod.body[i]
                work.append(("node", stmt, stmt.name if isinstance(stmt, ast.ClassDef) else None))

    def take_member(cname: str, j: int) -> None:
        i = mod.class_index(cname)
        if i in whole or j in parts.setdefault(i, set()):
            return
        cls = mod.body[i]
        first = not parts[i]
        parts[i].add(j)
        work.append(("node", cls.body[j], cname))
        if first:               # the class's header (bases, decorators, keywords) and what builds its instances
            work.append(("header", cls, cname))
            for k in _constructors(cls):
                take_member(cname, k)

    for s in symbols:
        head, _, member = s.partition(".")
        if not member:
            take_top(head)
        else:
            for j in mod.members[head][member]:
                take_member(head, j)
    while work:
        kind, node, cname = work.pop()
        if kind == "header":
            for n in [*node.bases, *node.keywords, *node.decorator_list]:
                for name in _loaded_names(n):
                    take_top(name)
            continue
        for name in _loaded_names(node):
            if name not in ("self", "cls") and name != cname:
                take_top(name)
        if cname is None:
            continue
        cls, named_member = mod.cls(cname), 0          # uses of the class's own name as `Class.member`
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls",
                                                                                                 cname):
                named_member += n.value.id == cname
                # the member itself (a class-level default too) and every method that assigns it (self.x = ...)
                for j in {*(mod.members[cname].get(n.attr) or ()), *_assigners(cls, n.attr)}:
                    take_member(cname, j)
        if sum(isinstance(n, ast.Name) and n.id == cname for n in ast.walk(node)) > named_member:
            take_top(cname)     # the class itself (an instance built, passed on): all of it
    out = []
    for i, stmt in enumerate(mod.body):
        if i in whole:
            out.append(stmt)
        elif i in imported:
            part = copy.copy(stmt)
            part.names = [a for a in stmt.names if (a.asname or a.name).split(".")[0] in imported[i]]
            out.append(part)
        elif parts.get(i):
            part = copy.copy(stmt)
            part.body = [s for j, s in enumerate(stmt.body) if j in parts[i]]
            out.append(part)
    return ast.Module(body=out, type_ignores=[])


_TREES: dict[bytes, ast.Module | None] = {}
_TREES_MAX = 256


def _parse(data: bytes | None) -> ast.Module | None:
    """Python source parsed with its docstrings dropped; None where there is none or it does not parse. Remembered by
    the bytes' digest: the trees are only read after this (a part of one is built of copies), and the same file at
    many commits is mostly the same bytes."""
    if data is None:
        return None
    key = hashlib.sha256(data).digest()
    if key in _TREES:
        return _TREES[key]
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        tree = None
    else:
        _strip_docstrings(tree)
    if len(_TREES) >= _TREES_MAX:
        _TREES.clear()
    _TREES[key] = tree
    return tree


def module_name(path: str) -> str:
    """``vtengine/kernels/fused.py`` -> ``vtengine.kernels.fused`` (a package's ``__init__.py``: the package)."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


ALL = "*"


def _imported(tree: ast.Module, here_path: str, target: str) -> set[str]:
    """The names of module ``target`` that ``tree`` (the module at ``here_path``) uses: ``from target import a``,
    ``target_alias.a``; ``ALL`` where it uses the module in a way that cannot be told (``import *``, the module
    object passed on)."""
    here, is_package = module_name(here_path), here_path.endswith("__init__.py")
    parent, _, last = target.rpartition(".")
    names: set[str] = set()
    aliases: set[str] = set()           # local names bound to the module object
    dotted: set[str] = set()            # `import a.b.c`: used as a.b.c.x
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node, here, is_package)
            for a in node.names:
                if mod == target:
                    names.add(ALL if a.name == "*" else a.name)
                elif mod == parent and a.name == last:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == target:
                    if a.asname:
                        aliases.add(a.asname)
                    else:
                        dotted.add(target)
    if not aliases and not dotted:
        return names
    used_as_value = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _dotted(node.value)
            if chain in aliases or chain in dotted:
                names.add(node.attr)
                used_as_value.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in aliases and id(node) not in used_as_value:
            names.add(ALL)
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _reach(entries, read) -> tuple[dict[str, bytes | None], dict[str, ast.Module | None], dict[str, set[str]]]:
    """(each file's bytes, the part of it that counts, the definitions it counts from: ALL where the whole file)."""
    spec = by_file(entries)
    data = {f: read(f) for f in spec}
    trees = {f: _parse(data[f]) if f.endswith(".py") else None for f in spec}
    seeds = {f: set(syms) for f, syms in spec.items() if syms is not None}
    while True:
        parts: dict[str, ast.Module | None] = {}
        for f, tree in trees.items():
            part = None
            if f in seeds and ALL not in seeds[f]:
                part = None if tree is None else _reachable_tree(tree, sorted(seeds[f]))
                if part is None:            # no file, no parse, or a definition not there: the whole file
                    seeds[f].add(ALL)
            parts[f] = tree if part is None else part
        grew = False
        for g, part in parts.items():
            if part is None:
                continue
            for f in seeds:
                if f == g or ALL in seeds[f]:
                    continue
                new = _imported(part, g, module_name(f)) - seeds[f]
                if new:
                    seeds[f] |= new
                    grew = True
        if not grew:
            break
    return data, parts, {f: seeds.get(f, {ALL}) for f in spec}


_COUNTED: dict[tuple, dict[str, bytes | None]] = {}
_COUNTED_MAX = 1024


def counted(entries, read) -> dict[str, bytes | None]:
    """file -> the code of it that counts for these ``paths:`` entries, normalized; ``read(file)`` gives a file's
    bytes (None: absent). A file listed by its definitions also counts every name of it that the counted code of
    the lever's other files imports (``from vtengine.kernels.fused import RopeOut``, ``fused.RopeOut``), to a fixed
    point: a helper another listed file calls is the lever's code too. The whole file counts where a definition is
    not there, the file does not parse, or another file uses the module object in a way that cannot be told.

    Remembered by the entries and the files' bytes (a digest of each): `vtcampaign status` asks it of the same
    commits and working tree for every verdict, and parsing and walking the sources is most of its time."""
    entries = tuple(entries)
    data = {f: read(f) for f in by_file(entries)}
    key = (entries, tuple((f, None if b is None else hashlib.sha256(b).digest()) for f, b in sorted(data.items())))
    hit = _COUNTED.get(key)
    if hit is None:
        hit = _counted(entries, data)
        if len(_COUNTED) >= _COUNTED_MAX:
            _COUNTED.clear()
        _COUNTED[key] = hit
    return dict(hit)


def _counted(entries, files: dict[str, bytes | None]) -> dict[str, bytes | None]:
    data, parts, seeds = _reach(entries, files.__getitem__)
    out = {}
    for f, part in parts.items():
        if ALL not in seeds[f]:
            out[f] = b"reachable " + ",".join(sorted(seeds[f])).encode() + b"\0" + ast.dump(
                part, include_attributes=False).encode()
        else:
            out[f] = normalized(f, data[f])
    return out


def reached(entries, read) -> dict[str, list[str] | None]:
    """file -> the definitions whose code counts for the entries (functions, ``Class.member``, constants; imports
    left out), or None where the whole file counts: what ``vtcampaign sources`` shows."""
    _, parts, seeds = _reach(entries, read)
    out: dict[str, list[str] | None] = {}
    for f, part in parts.items():
        if ALL in seeds[f] or part is None:
            out[f] = None
            continue
        names: list[str] = []
        for stmt in part.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(stmt, ast.ClassDef):            # its members that count (a whole class: all)
                names += [f"{stmt.name}.{m}" for s in stmt.body for m in sorted(_binds(s))]
            else:
                names += sorted(_binds(stmt)) or [type(stmt).__name__.lower()]
        out[f] = names
    return out


def counted_text(entries, read) -> dict[str, str]:
    """file -> the code that counts, as Python source again (``ast.unparse``: comments and docstrings gone); a file
    that is absent or does not parse, as it is."""
    data, parts, seeds = _reach(entries, read)
    out = {}
    for f, part in parts.items():
        if part is not None:
            out[f] = ast.unparse(part) + "\n"
        else:
            out[f] = "" if data[f] is None else data[f].decode(errors="replace")
    return out


def diff(entries, read_then, read_now, then_label: str = "then", now_label: str = "now") -> str:
    """A unified diff of the code that counts, per file whose counted code changed: what made a verdict STALE by its
    own sources, without the comments, formatting and other levers' definitions that did not count."""
    then, now = counted_text(entries, read_then), counted_text(entries, read_now)
    return "".join(
        "".join(difflib.unified_diff(then[f].splitlines(keepends=True), now[f].splitlines(keepends=True),
                                     f"{f} ({then_label})", f"{f} ({now_label})", n=2))
        for f in then if then[f] != now[f])


def changed(entries, read_then, read_now) -> list[str]:
    """The entries whose code differs between two readings (a commit's and the working tree's): in each file whose
    counted code differs, the definitions whose own reach changed (all of the file's where none did alone: the change
    came through what another listed file imports)."""
    then, now = counted(entries, read_then), counted(entries, read_now)
    out: set[str] = set()
    for f in (f for f in then if then[f] != now[f]):
        mine = [e for e in entries if split_entry(e)[0] == f]
        alone = [e for e in mine if split_entry(e)[1] is not None
                 and counted([e], read_then)[f] != counted([e], read_now)[f]]
        out |= set(alone or mine)
    return [e for e in entries if e in out]


def undefined(data: bytes | None, symbols: list[str]) -> list[str]:
    """The declared definitions that ``data`` (a Python source) does not hold at module or class level."""
    tree = _parse(data)
    if tree is None:
        return list(symbols)
    mod = _Module(tree)
    return [s for s in symbols if not mod.defines(s)]
