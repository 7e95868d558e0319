"""Set up a GPU box to run the tests and notebooks with the Python and torch it already has.

No virtual environment and no torch download: a GPU box comes with its own CUDA build of torch,
and the labs support torch 2.11 and newer. pip installs only what `requirements-box.txt` lists and
the box lacks, under `.box/` in the repository (nothing outside it changes), from a folder of
wheels the user brings (``--wheels DIR``; `make box-wheels` fills one on a machine with network)
or from the package registry when the box can reach one. The installed torch is pinned as a
constraint, so no requirement can pull another.

Two uses, one list: ``--for test`` (`make box-test`) installs the lines of requirements-box.txt
without a tag; ``--for lab`` (`make box-lab`: JupyterLab, which a GPU box usually lacks) also those
tagged ``# lab``. Only the requirements no installed distribution satisfies go to pip, and
``--plan`` prints them, with the pip command, without installing anything.

It ends by writing `.box/env`, which `make box-test` and `make box-lab` source: PYTHONPATH with the
repository and the directory pip installed into.
"""
import argparse
import glob
import os
import subprocess
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLDEST_TORCH = (2, 11)


def fail(sentence):
    print(f"error: {sentence}", file=sys.stderr)
    sys.exit(1)


def installed_torch():
    """The box's torch version string; one sentence if it is missing or older than we support."""
    if sys.version_info < (3, 11):
        fail(f"Python {sys.version.split()[0]} is too old; run with Python 3.11 or 3.12 "
             f"(make box-test BOX_PYTHON=/path/to/python3).")
    try:
        import torch
    except ImportError:
        fail(f"{sys.executable} has no torch; run with the Python that has the box's torch "
             f"(make box-test BOX_PYTHON=/path/to/python3), or use `make test` to install one.")
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < OLDEST_TORCH:
        fail(f"torch {torch.__version__} is older than 2.11, the oldest the labs support; "
             f"upgrade torch or use `make test`, which installs its own.")
    return torch.__version__


def requirements(target, path=os.path.join(ROOT, "requirements-box.txt")):
    """The requirement lines ``target`` ("test" or "lab") needs: the untagged ones, and for "lab"
    also those ending in ``# lab``."""
    out = []
    with open(path) as f:
        for line in f:
            spec, _, tag = line.partition("#")
            if spec.strip() and (not tag.strip() or (tag.strip() == "lab" and target == "lab")):
                out.append(spec.strip())
    return out


def _installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def missing(reqs, installed=_installed):
    """The requirements no installed distribution satisfies (``installed(name)`` -> version or None)."""
    from packaging.requirements import Requirement
    out = []
    for line in reqs:
        req = Requirement(line)
        have = installed(req.name)
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            out.append(line)
    return out


def pip_command(prefix, wheels, reqs, constraints):
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--prefix", prefix, "--no-warn-script-location",
           *reqs, "-c", constraints]
    if wheels:
        cmd += ["--no-index", "--find-links", os.path.abspath(wheels)]
    return cmd


def pip_install(prefix, wheels, torch_version, reqs):
    if wheels and not os.path.isdir(wheels):
        fail(f"--wheels {wheels} is not a directory; pass the folder `make box-wheels` filled.")
    constraints = os.path.join(prefix, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={torch_version}\n")
    cmd = pip_command(prefix, wheels, reqs, constraints)
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode != 0:
        where = f"the wheels in {wheels}" if wheels else "the package registry"
        fail(f"pip could not install requirements-box.txt from {where}; bring the missing wheels "
             f"(make box-wheels on a machine with network) and pass --wheels DIR.")


def site_dirs(prefix):
    """Where pip put the packages: the layout under --prefix differs between Python builds
    (lib/pythonX.Y/site-packages, or Debian's local/lib/pythonX.Y/dist-packages)."""
    found = glob.glob(os.path.join(prefix, "**", "site-packages"), recursive=True)
    found += glob.glob(os.path.join(prefix, "**", "dist-packages"), recursive=True)
    return sorted(found)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", help="a folder of wheels to install from, with no index")
    parser.add_argument("--prefix", default=os.path.join(ROOT, ".box"))
    parser.add_argument("--for", dest="target", choices=("test", "lab"), default="test",
                        help="test: what make box-test needs; lab: that and JupyterLab (make box-lab)")
    parser.add_argument("--plan", action="store_true", help="print what would be installed; install nothing")
    args = parser.parse_args(argv)
    torch_version = installed_torch()
    todo = missing(requirements(args.target))
    if args.plan:
        print(f"Python {sys.version.split()[0]}, torch {torch_version}; for {args.target}, missing: "
              + (", ".join(todo) or "nothing"))
        if todo:
            print("would run:", " ".join(pip_command(args.prefix, args.wheels, todo,
                                                      os.path.join(args.prefix, "constraints.txt"))))
        return
    os.makedirs(args.prefix, exist_ok=True)
    if todo:
        pip_install(args.prefix, args.wheels, torch_version, todo)
    else:
        print(f"the box already has everything {args.target} needs: nothing to install")
    path = os.pathsep.join([ROOT, *site_dirs(args.prefix)])
    with open(os.path.join(args.prefix, "env"), "w") as f:
        f.write(f"export PYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}}\n")
        f.write(f"export PATH={os.path.join(args.prefix, 'bin')}:$PATH\n")
    print(f"box ready: Python {sys.version.split()[0]}, torch {torch_version}, "
          f"extra packages under {args.prefix}")


if __name__ == "__main__":
    main()
