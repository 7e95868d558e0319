"""The automatic checker behind every chapter's exercises: each lab computes its own answers."""


def check(answers, question, answer, rel=0.01):
    """True when ``answer`` is within ``rel`` of ``answers[question]()``; prints the verdict."""
    if question not in answers:
        raise ValueError(f"no exercise {question!r}; the chapter has {', '.join(answers)}.")
    expected = answers[question]()
    ok = abs(answer - expected) <= rel * abs(expected)
    print(f"exercise {question}: {'correct' if ok else 'not yet, try again'}")
    return ok
