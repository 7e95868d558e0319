"""The automatic checker behind every chapter's exercises: each lab computes its own answers.

A chapter lists its answers (``EXERCISES``: question -> a function computing the answer) and the
usual mistakes (``MISTAKES``: question -> [(the answer that mistake gives, what the mistake is)],
each value computed from the mistake, not typed in), and builds its checker with ``checker``. A
wrong answer is told which way and by how much it misses, and the mistake it matches, if any: the
chapter's own first, then the slips any exercise invites (GB for GiB, bits for bytes, a factor 2).
A named mistake whose answer lies inside the tolerance is tested before the tolerance: an answer
nearer to it than to the right one is refused and the mistake named. Where several named mistakes
match, the one whose answer lies nearest is named first.

An answer that is a count (an ``int``: GPUs, micro-batches, bytes, elements, steps) must be exact;
any other answer must be within ``rel`` (1 % unless the chapter says otherwise).
"""
import contextlib
import io
import math
import textwrap

GB_PER_GIB = 2**30 / 1e9
MB_PER_MIB = 2**20 / 1e6

# Slips that any exercise invites, as (answer / expected, what the slip is). Checked after the
# chapter's own mistakes, so a chapter's more precise description wins.
SLIPS = [
    (2.0, "a factor 2 too many"),
    (0.5, "a factor 2 left out"),
    (GB_PER_GIB, "GiB and GB mixed up, a GiB being 2^30 bytes and a GB 10^9"),
    (1 / GB_PER_GIB, "GiB and GB mixed up, a GiB being 2^30 bytes and a GB 10^9"),
    (MB_PER_MIB, "MiB and MB mixed up, a MiB being 2^20 bytes and a MB 10^6"),
    (1 / MB_PER_MIB, "MiB and MB mixed up, a MiB being 2^20 bytes and a MB 10^6"),
    (8.0, "bits and bytes mixed up, a factor 8"),
    (1 / 8, "bits and bytes mixed up, a factor 8"),
    (100.0, "a percentage and a fraction mixed up, a factor 100"),
    (1 / 100, "a percentage and a fraction mixed up, a factor 100"),
    (1e3, "a unit prefix off by 1000, such as ms for s or MB for GB"),
    (1e-3, "a unit prefix off by 1000, such as ms for s or MB for GB"),
]


def question_key(answers, question):
    """``question`` as a key of ``answers``: 1 and "1" are the same exercise; one sentence if absent."""
    key = str(int(question)) if isinstance(question, float) and question.is_integer() else str(question)
    if key not in answers:
        raise ValueError(f"there is no exercise {question!r} in this chapter; its exercises are "
                         f"{', '.join(answers)}.")
    return key


def as_number(key, answer):
    """``answer`` as a float, or one sentence saying what the checker takes."""
    if isinstance(answer, (str, bytes, bool)) or answer is None:
        raise TypeError(f"exercise {key} takes a number, e.g. check({key!r}, 153.0), not {answer!r}: "
                        "give the value alone, in the unit the question asks for.")
    try:
        value = float(answer)
    except (TypeError, ValueError):
        raise TypeError(f"exercise {key} takes a number, e.g. check({key!r}, 153.0), not a "
                        f"{type(answer).__name__}: give the value alone, in the unit the question asks "
                        "for.") from None
    if not math.isfinite(value):
        raise ValueError(f"exercise {key} takes a finite number, not {answer!r}.")
    return value


def close(a, b, rel):
    return abs(a - b) <= rel * abs(b)


def factor(ratio):
    x = max(ratio, 1 / ratio)
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def percent(ratio):
    pct = abs(ratio - 1) * 100
    return f"{pct:.0f} %" if pct >= 10 else f"{pct:.2g} %"


def miss(answer, expected):
    """Which way and by how much ``answer`` misses ``expected``, in words."""
    way = "too high" if answer > expected else "too low"
    ratio = answer / expected if expected else math.inf
    if ratio <= 0:
        return "the wrong sign" if answer else f"{way}: zero"
    large = not 2 / 3 < ratio < 1.5
    if isinstance(expected, int):  # a count: the difference itself, and its share when it is large
        diff = abs(answer - expected)
        text = f"{way} by {diff:,}" if isinstance(diff, int) else f"{way} by {diff:,.6g}"
        if not expected or diff < 0.01 * abs(expected):
            return text
        return f"{text} (a factor {factor(ratio)})" if large else f"{text} ({percent(ratio)})"
    if not expected:
        return f"{way} by {abs(answer):.3g}"
    return f"{way} by a factor {factor(ratio)}" if large else f"{percent(ratio)} {way}"


def _nearest_first(answer, hits):
    """The descriptions of ``hits`` ((value, what)), the mistake whose value is nearest ``answer``
    first: two mistakes that land within the tolerance of each other are both named, nearer first."""
    found = []
    for _, what in sorted(hits, key=lambda h: abs(answer - h[0])):
        found += [what] if what not in found else []
    return found


def mistakes_matched(answer, expected, mistakes, rel, slips=None):
    """What the chapter's ``mistakes`` that give ``answer`` are, nearest first (else the first of
    ``slips``, by default `SLIPS`, that does)."""
    hits = []
    for value, what in mistakes:
        value = value() if callable(value) else value
        hit = answer == value if isinstance(value, int) else close(answer, value, rel)
        # named only when the answer is nearer to the mistake than to the right answer: 48.3 for
        # 48.81 is no "model's name" mistake just because that mistake's 48.75 lies within 1 %
        if hit and value != expected and abs(answer - value) < abs(answer - expected):
            hits.append((value, what))
    found = _nearest_first(answer, hits)
    for ratio, what in (SLIPS if slips is None else slips) if expected and not found else ():
        slip = expected * ratio  # a count only slips by a whole factor: 14 GPUs for 13 is no GiB
        if ((answer == slip) if isinstance(expected, int) else close(answer, slip, rel)) \
                and abs(answer - slip) < abs(answer - expected):
            return [what]
    return found


def mistakes_inside(answer, expected, mistakes, rel):
    """For an ``answer`` the tolerance would accept: the chapter's mistakes whose answer lies
    within ``rel`` of ``expected`` (the nominal 13e9 for Llama-2 13B's 13.016e9 is 0.12 % off) and
    nearer to ``answer`` than ``expected`` is. The tolerance would accept them, so the checker
    tests them first: on a mistake's side the accepted band ends halfway to it, and everything
    beyond is refused (the band stays one interval: no answer farther off is accepted again)."""
    hits = []
    if not close(answer, expected, rel):  # outside the tolerance the usual matching names it
        return hits
    for value, what in mistakes:
        value = value() if callable(value) else value
        if value != expected and close(value, expected, rel) and abs(answer - value) < abs(answer - expected):
            hits.append((value, what))
    return _nearest_first(answer, hits)


def verdict(answers, question, answer, rel=0.01, mistakes=None, slips=None):
    """(whether ``answer`` is right, the one-line verdict) for ``answers[question]``; ``slips``
    replaces `SLIPS` where a unit slip means nothing (a ratio)."""
    key = question_key(answers, question)
    value = as_number(key, answer)
    expected = answers[key]()
    exact = isinstance(expected, int) and not isinstance(expected, bool)
    if value == expected:
        return True, f"exercise {key}: correct"
    inside = mistakes_inside(value, expected, (mistakes or {}).get(key, ()), rel) if not exact else []
    if inside:  # a named mistake within the tolerance: checked before the tolerance accepts it
        which = "this mistake gives" if len(inside) == 1 else "each of these mistakes gives"
        return False, (f"exercise {key}: not yet, {miss(value, expected)}; nearer to what {which} "
                       f"than to the answer: "
                       f"{'; or '.join(inside)}")
    if not exact and close(value, expected, rel):
        return True, f"exercise {key}: correct"
    if exact and value.is_integer():
        value = int(value)
    text = f"exercise {key}: not yet, {miss(value, expected)}"
    found = mistakes_matched(value, expected, (mistakes or {}).get(key, ()), rel, slips)
    if found:
        which = "this mistake gives" if len(found) == 1 else "each of these mistakes gives"
        text += f"; that is what {which}: {'; or '.join(found)}"
    elif exact and close(value, expected, rel):
        text += "; close, but the answer is a count: give it exactly"
    return False, text


def check(answers, question, answer, rel=0.01, mistakes=None, slips=None):
    """True when ``answer`` is ``answers[question]()`` (exactly for a count, else within ``rel``);
    prints the verdict: correct, or which way and how far it misses and the mistake it matches."""
    ok, text = verdict(answers, question, answer, rel, mistakes, slips)
    print(text)
    return ok


def checker(answers, mistakes=None, rel=0.01):
    """A chapter's ``check(question, answer)`` over its ``answers`` and ``mistakes``."""
    def check_answer(question, answer, rel=rel):
        return check(answers, question, answer, rel, mistakes)
    check_answer.__doc__ = (f"Automatic checker: True when the answer is the computed one (exactly for a "
                            f"count, else within {rel:.0%}); prints which way and how far a wrong answer "
                            "misses.")
    return check_answer


def demonstrate(check, answers, question, wrong, how):
    """What a chapter's notebook shows of its checker: ``check`` given every computed answer, and the
    wrong ``wrong`` for ``question`` (described by ``how``), with the verdicts it prints captured.

    Returns {"accepted": the questions whose computed answer passed, "refused": whether the wrong
    answer failed, "text": a short report that reads as the demonstration it is, lines of at most
    88 columns}.
    """
    with contextlib.redirect_stdout(io.StringIO()):
        accepted = [q for q, answer in answers.items() if check(q, answer())]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        refused = not check(question, wrong)
    said = textwrap.fill(f'the checker says "{printed.getvalue().strip()}"', 88,
                         initial_indent="  ", subsequent_indent="    ")
    text = (f"the computed answers, each accepted: exercises {', '.join(accepted)}\n"
            f"a wrong answer is refused, as a demonstration:\n  given {how}\n{said}")
    return {"accepted": accepted, "refused": refused, "text": text}
