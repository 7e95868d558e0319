"""The automatic checker behind every chapter's exercises: each lab computes its own answers."""
import contextlib
import io


def check(answers, question, answer, rel=0.01):
    """True when ``answer`` is within ``rel`` of ``answers[question]()``; prints the verdict."""
    if question not in answers:
        raise ValueError(f"no exercise {question!r}; the chapter has {', '.join(answers)}.")
    expected = answers[question]()
    ok = abs(answer - expected) <= rel * abs(expected)
    print(f"exercise {question}: {'correct' if ok else 'not yet, try again'}")
    return ok


def demonstrate(check, answers, question, wrong, how):
    """What a chapter's notebook shows of its checker: ``check`` given every computed answer, and the
    wrong ``wrong`` for ``question`` (described by ``how``), with the verdicts it prints captured.

    Returns {"accepted": the questions whose computed answer passed, "refused": whether the wrong
    answer failed, "text": a short report that reads as the demonstration it is}.
    """
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        accepted = [q for q, answer in answers.items() if check(q, answer())]
        refused = not check(question, wrong)
    verdict = printed.getvalue().splitlines()[-1]
    text = (f"the computed answers, each accepted: exercises {', '.join(accepted)}\n"
            f"a wrong answer is refused, as a demonstration:\n  given {how}\n  the checker says \"{verdict}\"")
    return {"accepted": accepted, "refused": refused, "text": text}
