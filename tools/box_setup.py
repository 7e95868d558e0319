"""Set up a GPU box to run the tests and notebooks with the Python and torch it already has.

No virtual environment and no torch download: a GPU box comes with its own CUDA build of torch,
and the labs support torch 2.11 and newer. pip installs only what `requirements-box.txt` lists and
the box lacks, under `.box/` in the repository (nothing outside it changes), from a folder of
wheels the user brings (``--wheels DIR``; `make box-wheels` fills one on a machine with network)
or from the package registry when the box can reach one. The installed torch is pinned as a
constraint, so no requirement can pull another.

It ends by writing `.box/env`, which `make box-test` sources: PYTHONPATH with the repository and
the directory pip installed into.
"""
import argparse
import glob
import os
import subprocess
import sys

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


def pip_install(prefix, wheels, torch_version):
    constraints = os.path.join(prefix, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={torch_version}\n")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--prefix", prefix, "--no-warn-script-location",
           "-r", os.path.join(ROOT, "requirements-box.txt"), "-c", constraints]
    if wheels:
        if not os.path.isdir(wheels):
            fail(f"--wheels {wheels} is not a directory; pass the folder `make box-wheels` filled.")
        cmd += ["--no-index", "--find-links", os.path.abspath(wheels)]
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
    args = parser.parse_args(argv)
    torch_version = installed_torch()
    os.makedirs(args.prefix, exist_ok=True)
    pip_install(args.prefix, args.wheels, torch_version)
    path = os.pathsep.join([ROOT, *site_dirs(args.prefix)])
    with open(os.path.join(args.prefix, "env"), "w") as f:
        f.write(f"export PYTHONPATH={path}${{PYTHONPATH:+:$PYTHONPATH}}\n")
        f.write(f"export PATH={os.path.join(args.prefix, 'bin')}:$PATH\n")
    print(f"box ready: Python {sys.version.split()[0]}, torch {torch_version}, "
          f"extra packages under {args.prefix}")


if __name__ == "__main__":
    main()
