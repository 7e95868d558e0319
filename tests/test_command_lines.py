"""Every command line the README and the book print still parses.

Each `python -m labs.<package>.<module> ...` (or `torchrun ... -m labs...`) found in README.md and
book/*.md is run as `python -m` runs it (runpy), with the printed arguments. The argument
parser runs for real (an unknown flag, a bad choice or a renamed module fails here), then a patched
`parse_args` stops the lab before it starts any rank: the test checks the contract, not the lab.
"""
import argparse
import glob
import os
import re
import runpy
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `python -m labs.x.y args` or `torchrun [options] -m labs.x.y args`, up to a closing backtick, a
# comment, a pipe or the end of the line (a trailing backslash continues the line)
COMMAND = re.compile(r"(?:python|torchrun[^`\n]*?) -m (labs\.[\w.]+)([^`\n#|&]*)")
# placeholders the prose uses in a template line, not in a command to run
PLACEHOLDER = re.compile(r"^[A-Z]+$|[<>\[\]]")


def _commands():
    found = set()
    for path in [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "book", "*.md")))]:
        text = open(path).read().replace("\\\n", " ")
        for module, rest in COMMAND.findall(text):
            args = rest.split()
            if module.endswith(".") or any(PLACEHOLDER.search(a) for a in args):
                continue
            found.add((os.path.relpath(path, REPO), module, tuple(args)))
    return sorted(found)


COMMANDS = _commands()
# runpy warns when the module was imported earlier in this process (by another test); harmless
# here: the module's code is executed afresh as __main__, as `python -m` would
pytestmark = pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")


class _Parsed(Exception):
    pass


def test_the_scan_finds_the_labs_command_lines():
    modules = {m for _, m, _ in COMMANDS}
    assert (len(COMMANDS) > 30
            and {"labs.launcher.hello", "labs.memory_budget.budget", "labs.precision"} <= modules)


def _refusal(module, args, monkeypatch):
    """None if `python -m module args` parses; otherwise why not, in one sentence."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        raise _Parsed(real(self, argv, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [module, *args])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # what `python -m` does
    except _Parsed:
        return None
    except ImportError as exc:
        return f"{module} does not import: {exc}"
    except SystemExit as exc:
        return (None if exc.code == 0 and "--help" in args
                else f"its parser refuses `{' '.join(args)}` (exit {exc.code})")
    finally:
        monkeypatch.undo()
    return f"{module} ran without parsing its arguments"


@pytest.mark.parametrize("where,module,args", COMMANDS,
                         ids=[f"{w}:{m}:{' '.join(a)}" for w, m, a in COMMANDS])
def test_each_printed_command_line_parses(where, module, args, monkeypatch):
    why = _refusal(module, args, monkeypatch)
    assert why is None, f"{where} prints `python -m {module} {' '.join(args)}`: {why}"


def test_a_renamed_flag_or_module_is_caught(monkeypatch, capsys):
    """What a rename leaves behind in the prose fails the check above."""
    assert _refusal("labs.launcher.hello", ["--world-size", "2"], monkeypatch) is None
    assert "refuses" in _refusal("labs.launcher.hello", ["--world-sizes", "2"], monkeypatch)
    assert "refuses" in _refusal("labs.zero.stages", ["--stage", "4"], monkeypatch)
    assert "does not import" in _refusal("labs.launch", [], monkeypatch)
