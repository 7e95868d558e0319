"""labs/memory_budget/calculator.py: the chapter 1 calculator behind the sliders, and its tables for the
static site."""
import pytest

from labs.memory_budget import budget, calculator


def test_calculate_is_the_budget_at_the_sliders_settings():
    r = calculator.calculate(model="7B", world_size=16, tp=2, pp=2, zero_stage=3)
    want = budget.budget("7B", 16, 2, 2, 3, "mixed", 4096, 1, "selective", sp=True, attention="flash")
    assert r == want
    assert calculator.calculate()["model"] == calculator.DEFAULTS["model"] == "70B"


def test_an_invalid_split_is_a_cell_not_an_exception():
    r = calculator.calculate(world_size=12)  # tp = 8 does not divide 12
    assert "not divisible by tp*pp = 8" in r["error"] and calculator.cell(r) == "—"
    with pytest.raises(ValueError, match="no slider named gpus"):
        calculator.calculate(gpus=8)


def test_markdown_table_cells_come_from_calculate():
    text = calculator.markdown_table({"tp": [1, 8]}, ("model", ["7B", "70B"]), pp=1)
    lines = text.splitlines()
    assert lines[0] == "| tp | model 7B | model 70B |" and lines[1] == "|---|---|---|"
    for line, tp in zip(lines[2:], (1, 8)):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == str(tp)
        for c, model in zip(cells[1:], ("7B", "70B")):
            r = calculator.calculate(model=model, tp=tp, pp=1)
            assert c == f"{r['gib_per_device']['total']:.1f}" + ("" if r["fits"] else " ✗")
    assert len(lines) == 4


def test_show_prints_every_part_and_the_verdict(capsys):
    calculator.show(model="405B", tp=1)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out[:-1]] == list(budget.budget()["gib_per_device"])
    assert out[-1] == "does not fit in 80 GiB"
    assert max(map(len, out)) <= 88


def test_sliders_start_at_the_defaults():
    controls = calculator.sliders()
    assert {k: w.value for k, w in controls.items()} == calculator.DEFAULTS
    assert list(controls["world_size"].options) == calculator.SLIDERS["world_size"]


def test_tp_must_divide_the_kv_heads_as_megatron_core_requires():
    """Qwen3-235B has 4 KV heads: TP 8 would copy them (chapter 4's lab layout), which Megatron-Core's
    TransformerConfig refuses, so the planner refuses it too and never ranks it; TP 4 passes the rule.
    Catches the rule taken from `kv_layout` alone (which accepts the copies)."""
    from labs.dims import ParallelDims
    from labs.formulas.planning import planner as pl, shapes
    from labs.planning.published_tables import MODEL_SHAPES
    job = pl.Job(MODEL_SHAPES["qwen3-235b"], shapes.DGX_H100, 64, 4 * 2 ** 20)
    assert "does not divide the 4 KV heads" in pl.broken_rule(job, ParallelDims(tp=8, dp=8))
    assert pl.broken_rule(job, ParallelDims(tp=4, dp=16)) is None
