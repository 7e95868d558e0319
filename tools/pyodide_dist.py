"""Pyodide for the site's calculators: npm's `pyodide` package, pinned, checked, never from a CDN.

The tarball comes from the npm registry (`npm pack pyodide@VERSION`) into `.cache/pyodide/`
(git-ignored), its sha512 is checked against the pinned `INTEGRITY` (npm's `dist.integrity`)
before anything is unpacked, and only the files Pyodide loads at run time (`RUNTIME`) are used.
The build copies them into `_build/html/_static/pyodide/` (tools/calculators.py), so the reader's
browser loads Python from the site itself. A tarball already in the cache is checked and reused:
a machine without network builds from a cache filled once (`python tools/pyodide_dist.py`).

    python tools/pyodide_dist.py     # fetch (if needed), check, unpack; prints the folder
"""
import base64
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = "314.0.7"
# `npm view pyodide@314.0.7 dist.integrity`
INTEGRITY = "sha512-0YvXxEhfEdpLfb/XkM2BFAeMROq0iMUX2bzzH9pOttyMcWkwq+HbE5uyuGD82LN7y2q+SNvi/6V5JEsOlD2R1A=="
# What pyodide.mjs loads: itself, the Emscripten module and its wasm, the standard library, the lock
# file (read at start even when no package is loaded).
RUNTIME = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
CACHE = os.path.join(ROOT, ".cache", "pyodide")


class PyodideError(RuntimeError):
    """Pyodide could not be fetched or failed its check; the message says what to run."""


def integrity_of(data):
    """npm's integrity string (sha512, base64) of ``data``."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def verify(data, integrity=INTEGRITY):
    """Raise PyodideError unless ``data`` has the pinned sha512."""
    found = integrity_of(data)
    if found != integrity:
        raise PyodideError(f"the Pyodide tarball does not have the pinned sha512 ({integrity[:27]}..., "
                           f"got {found[:27]}...): delete {CACHE} and build again to fetch it anew")


def tarball_path(cache=CACHE, version=VERSION):
    return os.path.join(cache, f"pyodide-{version}.tgz")


def fetch(cache=CACHE, version=VERSION):
    """The tarball in the cache, fetched with `npm pack` when it is not there yet."""
    path = tarball_path(cache, version)
    if os.path.isfile(path):
        return path
    hint = (f"the site's calculators need Pyodide {version} from npm: install npm (apt-get install npm) "
            f"and run `python tools/pyodide_dist.py` once with the network on, or put pyodide-{version}.tgz "
            f"(from `npm pack pyodide@{version}`) into {cache}")
    npm = shutil.which("npm")
    if npm is None:
        raise PyodideError(f"npm is not installed; {hint}")
    os.makedirs(cache, exist_ok=True)
    done = subprocess.run([npm, "pack", f"pyodide@{version}", "--pack-destination", cache, "--silent"],
                          capture_output=True, text=True)
    if done.returncode != 0 or not os.path.isfile(path):
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise PyodideError(f"`npm pack pyodide@{version}` failed ({last}); {hint}")
    return path


def unpack(cache=CACHE, version=VERSION, integrity=INTEGRITY):
    """The folder holding the run-time files (``RUNTIME``), unpacked from the checked tarball.

    The tarball is checked on every call (a second), the files unpacked when they are missing."""
    path = fetch(cache, version)
    with open(path, "rb") as f:
        data = f.read()
    verify(data, integrity)
    folder = os.path.join(cache, version)
    stamp = os.path.join(folder, ".integrity")
    if os.path.isfile(stamp) and open(stamp).read() == integrity \
            and all(os.path.isfile(os.path.join(folder, name)) for name in RUNTIME):
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = {m.name.removeprefix("package/"): m for m in tar.getmembers() if m.isfile()}
        missing = [name for name in RUNTIME if name not in members]
        if missing:
            raise PyodideError(f"the Pyodide {version} tarball lacks {', '.join(missing)}")
        for name in RUNTIME:
            with tar.extractfile(members[name]) as src, open(os.path.join(folder, name), "wb") as dst:
                shutil.copyfileobj(src, dst)
    with open(stamp, "w") as f:
        f.write(integrity)
    return folder


if __name__ == "__main__":
    try:
        print(unpack())
    except PyodideError as e:
        sys.exit(f"error: {e}")
