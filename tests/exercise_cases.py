"""What every chapter's test of its exercise checkers asks (tests/test_exercise_answers*.py).

A case is (module, question, wrong answer, the mistake it stands for); the wrong answer is computed
from that mistake here, not typed in and not taken from the module. The checker must accept the
module's own answer and refuse the wrong one, say which way the wrong one misses, and name the
mistake in the words given (the module's ``MISTAKES`` or the checker's slips).
"""
from labs.measure import exercises


def refuses(check, answers, question, wrong, mistake, capsys):
    right = answers[question]()
    assert check(question, right), (question, right)
    assert not check(question, wrong), (question, wrong, mistake)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"exercise {question}: correct"
    assert out[1].startswith(f"exercise {question}: not yet, "), out
    assert ("too high" if wrong > right else "too low") in out[1], (wrong, right, out)
    assert mistake in out[1], (mistake, out)
    assert len(out) == 2


def ids(cases):
    return [f"{m.__name__.split('.')[-1]}-{q}-{i}" for i, (m, q, *_) in enumerate(cases)]


def untested(cases, modules):
    """The exercises of ``modules`` for which no case gives a wrong answer, and the mistakes a module
    names that no case makes (each one must be tested with a wrong answer computed here)."""
    covered = {(m.__name__, q) for m, q, *_ in cases}
    named = {(m.__name__, q, what) for m, q, _, what in cases}
    slips = {what for _, what in exercises.SLIPS}
    return ({(m.__name__, q) for m in modules for q in m.EXERCISES} - covered) | {
        (m.__name__, q, what) for m in modules for q, listed in getattr(m, "MISTAKES", {}).items()
        for _, what in listed if what not in slips} - named
