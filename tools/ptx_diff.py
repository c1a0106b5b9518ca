"""Compares the PTX of the kernel instances of two versions of the tree, with no GPU.

A change to device code that should leave the kernels as they were (a refactor, a moved helper, a
comment, a host-callable work list) is checked here rather than on a device: each selected
instance that both versions launch is compiled to PTX by nvcc, and the instances whose PTX
differs are listed. Identical PTX means the same binary, so the GPU results of the old version
stand for the new one.

    python tools/ptx_diff.py BASE [HEAD] [--arch sm_90a] [--source F ...] [--features N ...]
                             [--match TEXT] [--per-instance] [--jobs N]

BASE and HEAD are git revisions; HEAD defaults to the working tree. Each version's own
cuflash/_kernels.py lists its instances and writes its compiled source (headers inlined, the
Params layout asserts), as the runtime does. By default the instances of one source are compiled
together, one unit per (version, source), and each entry is compared with what it uses (the
module's functions and variables that it names); an entry found different there is compiled again
alone, one unit per instance as the runtime's NVRTC compiles it, before it is reported, because
the front end can emit different PTX for one instance in different units (docs/perf/NOTES.md,
v16). --per-instance compiles every instance alone from the start. Exit status: 0 when every
compared instance is identical, 1 when one differs, 2 on a build failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKTREE = "WORKTREE"  # the HEAD argument's default: the files as they are now

# What a version's cuflash writes for the parent: its instances, or the units asked for.
_CHILD = r"""
import json, sys
from cuflash import _kernels, compile_check
arch, request = sys.argv[1], json.loads(sys.stdin.read())
if request is None:
    print(json.dumps({s.name_expression: (s.source, s.features) for s in _kernels.all_specs(arch)}))
else:
    specs = {s.name_expression: s for s in _kernels.all_specs(arch)}
    for path, names in request:
        chosen = [specs[n] for n in names]
        with open(path, "w") as f:
            f.write(compile_check.translation_unit(chosen[0].source, chosen))
"""


@dataclass(frozen=True)
class Version:
    label: str
    root: Path  # a tree holding cuflash/ and kernels_cu/ of this version

    def child(self, arch: str, request) -> str:  # noqa: ANN001
        env = dict(os.environ, PYTHONPATH=str(self.root))
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, arch],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            cwd=self.root,
            env=env,
        )
        if proc.returncode:
            raise RuntimeError(f"{self.label}: listing its instances failed:\n{proc.stderr}")
        return proc.stdout

    def instances(self, arch: str) -> dict[str, tuple[str, int]]:
        """name expression -> (source file, feature bits) of every instance this version launches
        on `arch`."""
        return json.loads(self.child(arch, None))

    def write_units(self, arch: str, units: list[tuple[Path, list[str]]]) -> None:
        self.child(arch, [(str(path), names) for path, names in units])


def checkout(rev: str, into: Path) -> Version:
    """The version `rev` (a git revision, or WORKTREE) as a tree of cuflash/ and kernels_cu/."""
    if rev == WORKTREE:
        return Version("the working tree", ROOT)
    into.mkdir(parents=True)
    archive = into / "tree.tar"
    with archive.open("wb") as f:
        subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "cuflash", "kernels_cu"], stdout=f, check=True
        )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return Version(rev, into)


# ---------------------------------------------------------------------------------------------
# PTX

_TOP = re.compile(r"^(?:\.visible |\.weak |\.extern )*\.(entry|func|global|shared|const)\b", re.M)
_FUNCTION = re.compile(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)")
_VARIABLE = re.compile(r"([\w$]+)\s*(?:\[[^\]]*\])*\s*(?:=|;)")
_NAME = re.compile(r"[A-Za-z_$][\w$]*")
# Names that only number things in the unit: branch labels carry the function's index in the
# module, local depots likewise.
_RENUMBERED = ((re.compile(r"\$L__BB\d+_"), "$L__BB_"), (re.compile(r"__local_depot\d+"), "__ld"))


def ptx_items(ptx: str) -> dict[str, str]:
    """The module's top-level functions and variables: name -> text, labels renumbered."""
    starts = [m for m in _TOP.finditer(ptx)]
    items = {}
    for m, end in zip(starts, [n.start() for n in starts[1:]] + [len(ptx)], strict=True):
        text = ptx[m.start() : end]
        if m.group(1) in ("entry", "func"):
            name = _FUNCTION.match(text[text.index("." + m.group(1)) :]).group(1)
            if "}" in text:  # a definition: up to its closing brace (a prototype has none)
                text = text[: text.rfind("}") + 1]
        else:
            text = text[: text.index(";") + 1]
            name = _VARIABLE.search(text).group(1)
        for pattern, replacement in _RENUMBERED:
            text = pattern.sub(replacement, text)
        items[name] = text
    return items


def entry_closure(items: dict[str, str], entry: str) -> str:
    """An entry's text followed by everything of the module that it names, transitively: what
    decides its binary."""
    seen, order, todo = {entry}, [entry], [entry]
    while todo:
        for name in _NAME.findall(items[todo.pop()]):
            if name in items and name not in seen:
                seen.add(name)
                order.append(name)
                todo.append(name)
    return "\n".join(items[name] for name in [entry] + sorted(order[1:]))


def mangled_entries(ptx: str) -> dict[str, str]:
    """Each entry's mangled name -> the hash of its closure."""
    items = ptx_items(ptx)
    entries = re.findall(r"^\.visible \.entry ([\w$]+)", ptx, re.M)
    return {
        name: hashlib.sha256(entry_closure(items, name).encode()).hexdigest() for name in entries
    }


def to_ptx(nvcc: str, unit: Path, arch: str) -> str:
    out = unit.with_suffix(".ptx")
    # -ftz=true as the runtime compiles (CuPy adds it: cuflash/_kernels.py, FLUSH_DENORMALS)
    cmd = [nvcc, "-std=c++17", "-ftz=true", "-ptx", f"-arch=compute_{arch[3:]}", "-o", str(out)]
    cmd.append(str(unit))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed on {unit.name}:\n{proc.stdout}{proc.stderr}"[-4000:])
    return out.read_text()


# ---------------------------------------------------------------------------------------------


def compile_units(
    version: Version, arch: str, units: list[tuple[Path, list[str]]], nvcc: str, jobs: int
) -> dict[str, str]:
    """Compiles the units (written by the version's own cuflash): each entry's name expression
    -> the hash of its closure."""
    version.write_units(arch, units)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ptxs = list(pool.map(lambda unit: to_ptx(nvcc, unit[0], arch), units))
    hashes: dict[str, str] = {}
    for ptx in ptxs:
        entries = mangled_entries(ptx)
        for mangled, expression in demangle(list(entries)).items():
            hashes[canonical(expression)] = entries[mangled]
    return hashes


def canonical(expression: str) -> str:
    """A name expression with its bool template arguments as 0 and 1: c++filt writes true and
    false, and _kernels spells some as 0 and 1 (the fused kernel's BOUNDED), others as true and
    false (the decoding kernels')."""
    return re.sub(r"\btrue\b", "1", re.sub(r"\bfalse\b", "0", expression))


def demangle(mangled: list[str]) -> dict[str, str]:
    """Mangled entry names -> the name expressions of cuflash/_kernels.py (``ns::kernel<args>``,
    as c++filt writes them without the return type and the parameters)."""
    filt = shutil.which("cu++filt") or shutil.which("c++filt")
    if filt is None:
        raise RuntimeError("neither cu++filt nor c++filt is on the PATH")
    out = subprocess.run([filt], input="\n".join(mangled), capture_output=True, text=True).stdout
    names = {}
    for name, text in zip(mangled, out.splitlines(), strict=True):
        text = text.removeprefix("void ")
        names[name] = text[: text.rfind("(")] if text.endswith(")") else text
    return names


def compare(
    versions: tuple[Version, Version],
    arch: str,
    groups: dict[str, list[str]],
    work: Path,
    nvcc: str,
    jobs: int,
    alone: bool,
) -> list[str]:
    """The name expressions among `groups` (source -> instances of both versions) whose PTX
    differs between the versions."""

    def differing(kind: str, units: list[tuple[str, list[str]]]) -> list[str]:
        hashes = []
        for i, version in enumerate(versions):
            folder = work / f"v{i}" / kind
            folder.mkdir(parents=True, exist_ok=True)
            placed = [(folder / f"{stem}.cu", members) for stem, members in units]
            hashes.append(compile_units(version, arch, placed, nvcc, jobs))
        wanted = [n for _, members in units for n in members]
        for label, found in zip((v.label for v in versions), hashes, strict=True):
            if missing := [n for n in wanted if canonical(n) not in found]:
                raise RuntimeError(f"{label}: no entry for {missing[:3]} ({len(missing)})")
        return sorted(n for n in wanted if hashes[0][canonical(n)] != hashes[1][canonical(n)])

    names = [n for members in groups.values() for n in members]
    if not alone:
        names = differing("shared", [(Path(s).stem, m) for s, m in groups.items()])
    if not names:
        return []
    return differing("alone", [(f"i{k}", [n]) for k, n in enumerate(names)])


@dataclass(frozen=True)
class Differences:
    compared: int  # instances of both versions that the filters selected
    differing: list[str]  # their name expressions whose PTX differs
    only: tuple[int, int]  # instances that one version launches and the other does not


def differences(
    versions: tuple[Version, Version],
    arch: str,
    work: Path,
    *,
    sources: list[str] | None = None,
    features: list[int] | None = None,
    match: str | None = None,
    per_instance: bool = False,
    jobs: int = 1,
) -> Differences:
    """The selected instances of both versions, compiled in `work` (an empty folder) and
    compared."""
    listed = [v.instances(arch) for v in versions]
    groups: dict[str, list[str]] = {}
    for name in sorted(listed[0].keys() & listed[1].keys()):
        source, bits = listed[1][name]
        if sources and source not in sources or match and match not in name:
            continue
        if features is not None and bits not in features:
            continue
        groups.setdefault(source, []).append(name)
    differing = compare(versions, arch, groups, work, _nvcc(), jobs, per_instance)
    only = (len(listed[0].keys() - listed[1].keys()), len(listed[1].keys() - listed[0].keys()))
    return Differences(sum(map(len, groups.values())), differing, only)


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).is_file():
        raise RuntimeError("nvcc not found (put it on the PATH)")
    return nvcc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="git revision of the old version")
    parser.add_argument("head", nargs="?", default=WORKTREE, help="git revision (default: files)")
    parser.add_argument("--arch", default="sm_90a", help="sm_80, sm_90a, ... (default sm_90a)")
    parser.add_argument("--source", nargs="+", help="only these kernels_cu/ sources")
    parser.add_argument("--features", type=int, nargs="+", help="only these feature bits")
    parser.add_argument("--match", help="only instances whose name expression holds this text")
    parser.add_argument("--per-instance", action="store_true", help="one unit per instance")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cuflash-ptx-") as tmp:
        work = Path(tmp)
        versions = (checkout(args.base, work / "base"), checkout(args.head, work / "head"))
        try:
            found = differences(
                versions,
                args.arch,
                work / "units",
                sources=args.source,
                features=args.features,
                match=args.match,
                per_instance=args.per_instance,
                jobs=args.jobs,
            )
        except RuntimeError as error:
            print(error)
            return 2
    for name in found.differing:
        print("differs:", name)
    print(
        f"{args.arch}: {found.compared} instances compared, {len(found.differing)} differ "
        f"({found.only[0]} only in {versions[0].label}, {found.only[1]} only in "
        f"{versions[1].label})"
    )
    return 1 if found.differing else 0


if __name__ == "__main__":
    sys.exit(main())
