"""labs/measure/exercises.py: the checker, and the demonstration each lab notebook shows of it."""
from labs.measure import exercises

ANSWERS = {"1": lambda: 12.0, "2": lambda: 0.5}


def check(question, answer):
    return exercises.check(ANSWERS, question, answer)


def test_check_accepts_within_one_percent_and_says_so(capsys):
    assert check("1", 12.1) and not check("1", 12.2)
    assert capsys.readouterr().out.splitlines() == ["exercise 1: correct", "exercise 1: not yet, try again"]


def test_demonstrate_reads_as_a_demonstration_and_prints_nothing_itself(capsys):
    demo = exercises.demonstrate(check, ANSWERS, "2", 1.0, "twice the answer")
    assert capsys.readouterr().out == ""
    assert demo["accepted"] == ["1", "2"] and demo["refused"]
    assert demo["text"].splitlines() == ["the computed answers, each accepted: exercises 1, 2",
                                         "a wrong answer is refused, as a demonstration:",
                                         "  given twice the answer",
                                         '  the checker says "exercise 2: not yet, try again"']


def test_demonstrate_reports_a_checker_that_accepts_the_wrong_answer():
    demo = exercises.demonstrate(check, ANSWERS, "2", 0.5, "the right answer")
    assert not demo["refused"]
