"""What every chapter's test of its exercise checkers asks (tests/test_exercise_answers*.py).

A case is (module, question, wrong answer, the mistake it stands for); the wrong answer is computed
from that mistake, not typed in. The checker must accept the module's own answer, refuse the
wrong one, and print one verdict for each.
"""


def refuses(check, answers, question, wrong, mistake, capsys):
    right = answers[question]()
    assert check(question, right), (question, right)
    assert not check(question, wrong), (question, wrong, mistake)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"exercise {question}: correct", f"exercise {question}: not yet, try again"]


def ids(cases):
    return [f"{m.__name__.split('.')[-1]}-{q}-{i}" for i, (m, q, *_) in enumerate(cases)]


def untested(cases, modules):
    """The exercises of ``modules`` for which no case gives a wrong answer."""
    covered = {(m.__name__, q) for m, q, *_ in cases}
    return {(m.__name__, q) for m in modules for q in m.EXERCISES} - covered
