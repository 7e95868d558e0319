"""Build the book with warnings as errors, optionally from the committed notebook outputs.

`make book` re-executes every notebook so the site shows a fresh run. `make test` has just
re-executed and checked every notebook with nbval, so it builds from the committed outputs
(--no-execute) instead of running them a second time.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--no-execute", action="store_true", help="use the outputs stored in the notebooks")
    args = p.parse_args()
    config = os.path.join(ROOT, "_config.yml")
    with open(config) as f:
        text = f.read()
    if args.no_execute:
        if "execute_notebooks: force" not in text:
            sys.exit("error: _config.yml must say 'execute_notebooks: force' for --no-execute to override it")
        text = text.replace("execute_notebooks: force", 'execute_notebooks: "off"')
    # A fresh Sphinx environment: cached glue data must never stand in for the notebooks' own.
    for cached in ("_build/.doctrees", "_build/jupyter_execute"):
        shutil.rmtree(os.path.join(ROOT, cached), ignore_errors=True)
    with tempfile.NamedTemporaryFile("w", suffix=".yml", dir=ROOT, prefix=".config-", delete=False) as f:
        f.write(text)
    try:
        jb = os.path.join(os.path.dirname(sys.executable), "jupyter-book")
        cmd = [jb, "build", ROOT, "--all", "-W", "-n", "--keep-going", "--config", f.name]
        sys.exit(subprocess.call(cmd, cwd=ROOT))
    finally:
        os.unlink(f.name)


if __name__ == "__main__":
    main()
